"""`h2o-local serve`: the OpenAI-compatible server, driven with the official `openai` client and raw HTTP."""
import contextlib
import http.client
import json
import threading
import time

import pytest

import openai
import uvicorn

from h2o_local import Llama
from h2o_local.sampling import CHAT_SURFACE
from h2o_local.server import create_app, serve_in_background
from tiny_model import write_tiny_llama
from engine_view import eval_with_riders
from device_tolerance import CPU_BACKEND

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("srv") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))


@contextlib.contextmanager
def serving(model, *, slots=3, budget=48, session_mib=64, max_waiting=8, app_kwargs=None, **llama_kwargs):
    llm = Llama(model, budget=budget, n_seq_max=slots, kv_unified=False, keep="system", n_threads=1,
                **{"policy": "h2o" if budget is not None else None, **llama_kwargs})
    app = create_app(llm, model_id="tiny", max_waiting=max_waiting, session_mib=session_mib, max_body_bytes=64 * 1024,
                     **(app_kwargs or {}))
    with serve_in_background(app) as port:
        key = (app_kwargs or {}).get("api_key", "none")
        yield port, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model) as s:
        yield s


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, json.loads(r.read())


def raw_request(port, method, path, headers, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def post(port, path, body, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=raw if raw is not None else json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read())


USER = [{"role": "system", "content": "You are tiny."}, {"role": "user", "content": "Say something."}]


def test_models_and_health(server):
    port, client = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, health = get(port, "/health")
    assert status == 200 and health["status"] == "ok" and health["slots_total"] == 3


def test_completion_and_chat_with_the_openai_client(server):
    _, client = server
    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens <= 12
    again = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert again.choices[0].text == c.choices[0].text  # greedy is deterministic
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 10
    stopped = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                        stop=[c.choices[0].text[2:4]] if len(c.choices[0].text) > 4 else None)
    assert len(stopped.choices[0].text) <= len(c.choices[0].text)


def test_streaming_chat_gives_the_same_text(server):
    _, client = server
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_streams_are_decoded_together_and_equal_one_by_one(chat_model):
    """On the CPU backend, whose results do not depend on a batch's size; a GPU's matrix products round differently
    by batch size, so there a near tie of this random model forks a greedy text (tests/engine/test_batch.py)."""
    prompts = [f"Story number {i}:" for i in range(3)]
    with serving(chat_model, slots=4, session_mib=0, **CPU_BACKEND) as (port, client):
        alone = [client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0).choices[0].text
                 for p in prompts]
        results, barrier = [None] * 3, threading.Barrier(3)
        # a long answer runs in a slot of its own meanwhile, so that the three streams surely share steps with it
        # (without it three short answers on a fast machine could each end before the next one starts)
        long = client.completions.create(model="tiny", prompt="Once", max_tokens=100_000, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))

        def stream(i):
            barrier.wait()
            out = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=40, temperature=0, stream=True)
            results[i] = "".join(ch.choices[0].text for ch in out)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        long.close()
        assert results == alone  # each slot has its own cache: batching changes nothing but speed
        from benchmarks.server_faults import wait_idle

        health = wait_idle(f"http://127.0.0.1:{port}", timeout_s=30)  # the long answer's slot is freed too
        assert health["peak_batch"] >= 2 and health["slots_processing"] == 0


def test_a_continued_conversation_reuses_its_cache(chat_model):
    """A saved cache is continued only when the new prompt's tokens, tokenized as a fresh request tokenizes them,
    start with the tokens it holds: the whole first exchange when its answer tokenizes back to the tokens generated,
    else the first prompt (saved on its own). With no eviction the answer is a fresh request's (on the CPU backend:
    a GPU's products round differently when a prefix was computed in another batch, and a near tie forks)."""
    llm = Llama(chat_model, policy="h2o", budget=1000, n_threads=1, **CPU_BACKEND)
    with serving(chat_model, budget=1000, **CPU_BACKEND) as (port, client):  # a budget that never evicts
        first_messages = [USER[0], {"role": "user", "content": "Say something."}]
        first = client.chat.completions.create(model="tiny", messages=first_messages, max_tokens=20, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        history = first_messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                    {"role": "user", "content": "And then?"}]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=20, temperature=0)
        _, health = get(port, "/health")
    first_tokens = llm.chat_tokens(first_messages)[0]
    second_tokens = llm.chat_tokens(history)[0]
    assert second.usage.prompt_tokens == len(second_tokens)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens == len(first_tokens)
    assert health["session_hits"] == 1
    # the server's chat defaults (CHAT_SURFACE: a repeat penalty) under the request's temperature
    chat_defaults = CHAT_SURFACE.replace(max_tokens=20, temperature=0)
    assert second.choices[0].message.content == llm.generate(second_tokens, sampling=chat_defaults)


def test_a_prompt_resent_as_it_was_is_not_read_again_and_answers_the_same(chat_model):
    """A regenerated answer, a retried request: the prompt equals a saved cache's tokens, whose snapshot holds the
    logits after them, so nothing is read and the first token is drawn from the same logits (with a bounded
    cache that evicted while it read, the state is the one the first reading left)."""
    with serving(chat_model, budget=32, **CPU_BACKEND) as (port, client):
        messages = [USER[0], {"role": "user", "content": "Say something long about the sea and the ships. " * 3}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        status, done = post(port, "/completion", {"prompt": "Once upon a time there", "n_predict": 6, "temperature": 0})
        status, redone = post(port, "/completion", {"prompt": "Once upon a time there", "n_predict": 6,
                                                    "temperature": 0})
    assert first.usage.model_extra["kv_cache"]["evicted"] > 0  # the budget evicted while the prompt was read
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    assert (redone["tokens_cached"], redone["timings"]["prompt_n"]) == (redone["tokens_evaluated"], 0)
    assert redone["content"] == done["content"] and done["tokens_cached"] < done["tokens_evaluated"]


def test_a_whole_exchange_is_continued_when_the_prompt_holds_its_tokens(chat_model):
    """A prompt of token ids that holds a finished request's prompt and generated tokens continues its saved cache:
    only the token shown last (not fed) and what follows are fed."""
    llm = Llama(chat_model, policy="h2o", budget=1000, n_threads=1)
    prompt = llm.tokenize("Once upon a time")
    generated = [e.token for e in llm.generate_events(prompt, max_tokens=12, temperature=0) if e.token is not None]
    with serving(chat_model, budget=1000) as (port, client):
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert first.usage.completion_tokens == len(generated)
        again = client.completions.create(model="tiny", prompt=prompt + generated + llm.tokenize(" and", add_bos=False),
                                          max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt) + len(generated) - 1


def test_no_request_changes_what_another_conversation_continues(chat_model):
    """Whatever the saved sessions hold (planted through the other endpoint, a text cut inside a word, special
    tokens in a completion), every greedy answer equals the one a server without sessions gives, and a chat keeps
    its protected system prompt. On the CPU backend, as the test above."""
    def script(port, client):
        out = []
        chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
        answer = chat.choices[0].message.content
        history = USER + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
        text = CHATML_TEXT(USER) + answer  # the text a client could plant through /v1/completions
        out.append(answer)
        # a completion whose prompt is the chat's rendered text and answer, generating nothing
        out.append(client.completions.create(model="tiny", prompt=text, max_tokens=0).choices[0].text)
        out.append(client.chat.completions.create(model="tiny", messages=history, max_tokens=12,
                                                  temperature=0).choices[0].message.content)
        # a completion continued in the middle of a word, and one with special tokens in its text
        for prompt in ("The lighthouse keep", "The lighthouse keeper wrote", "<|im_start|>user\nhi<|im_end|>\n"):
            c = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            out.append((c.choices[0].text, c.usage.prompt_tokens))
        return out

    with serving(chat_model, budget=1000, session_mib=0, **CPU_BACKEND) as (port, client):
        fresh = script(port, client)
    with serving(chat_model, budget=1000, **CPU_BACKEND) as (port, client):
        reused = script(port, client)
        _, health = get(port, "/health")
    assert reused == fresh
    assert health["session_hits"] >= 1
    llm = Llama(chat_model, policy="h2o", budget=1000, n_threads=1)
    assert fresh[-1][1] == len(llm.tokenize("<|im_start|>user\nhi<|im_end|>\n", special=True))  # parsed as special


def CHATML_TEXT(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def test_a_planted_completion_does_not_change_a_chat_s_next_answer(chat_model):
    """With eviction, a chat's cache depends on its protected system prompt: a completion that sends the chat's text
    and answer (generating nothing) must not become what the chat's next turn continues."""
    def second_turn(plant):
        with serving(chat_model, budget=80) as (port, client):
            chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0)
            answer = chat.choices[0].message.content
            if plant:
                client.completions.create(model="tiny", prompt=CHATML_TEXT(USER) + answer, max_tokens=0)
            history = USER + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
            again = client.chat.completions.create(model="tiny", messages=history, max_tokens=16, temperature=0)
            return again.choices[0].message.content, again.usage.prompt_tokens_details.cached_tokens

    assert second_turn(plant=True) == second_turn(plant=False)


def test_bad_requests_get_openai_errors(server):
    port, client = server
    for body, param in (({"messages": []}, "messages"), ({"messages": USER, "temperature": -1}, "temperature"),
                        ({"messages": USER, "n": 17}, "n"), ({"messages": [{"content": "x"}]}, "messages"),
                        ({"messages": USER, "max_tokens": "ten"}, "max_tokens"), ({}, "messages")):
        status, err = post(port, "/v1/chat/completions", body)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", (body, err)
        assert param in (err["error"]["param"] or "") + err["error"]["message"], (body, err)
    status, err = post(port, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400 and "error" in err
    status, err = post(port, "/v1/completions", {"prompt": [999999]})
    assert status == 400 and "token id 999999 is outside" in err["error"]["message"]
    status, err = post(port, "/v1/completions", {"prompt": [-1]})
    assert status == 400 and "token id -1" in err["error"]["message"]
    status, err = post(port, "/v1/completions", {"prompt": "x" * 100_000})
    assert status == 413
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert client.completions.create(model="tiny", prompt="still fine", max_tokens=2).choices  # still serving


def test_a_prompt_that_does_not_fit_the_full_cache_is_a_400(chat_model):
    with serving(chat_model, budget=None, slots=1, n_ctx=256) as (port, client):
        status, err = post(port, "/v1/completions", {"prompt": "word " * 300, "max_tokens": 4})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded"
        out = client.completions.create(model="tiny", prompt="short", max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length")


def test_busy_slots_give_429_and_a_client_that_leaves_frees_its_slot(chat_model):
    with serving(chat_model, slots=1, max_waiting=0, session_mib=0) as (port, client):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "long", "max_tokens": 100000, "stream": True,
                                                                "temperature": 1.0, "ignore_eos": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read1(64)  # streaming
        status, err = post(port, "/v1/completions", {"prompt": "another", "max_tokens": 2})
        assert status == 429 and err["error"]["type"] == "rate_limit_error"
        conn.close()  # the client goes away mid-stream
        deadline = time.time() + 10
        while get(port, "/health")[1]["slots_processing"] and time.time() < deadline:
            time.sleep(0.05)
        assert get(port, "/health")[1]["slots_processing"] == 0
        assert client.completions.create(model="tiny", prompt="now", max_tokens=2).choices


def test_a_request_whose_client_left_is_cancelled_by_its_watcher():
    """While a request waits for its slot or for its whole answer, a watcher asks the connection (Starlette's
    Request.is_disconnected) every half second; once the client is gone, the request is cancelled (a waiting one is
    then never admitted, a running one frees its slot at its next step)."""
    import asyncio

    from starlette.requests import Request

    from h2o_local.sampling import SamplingParams
    from h2o_local.server import answers
    from h2o_local.server.scheduler import Job, JobRequest

    async def gone():
        return {"type": "http.disconnect"}

    cancelled = []
    state = type("State", (), {"scheduler": type("Scheduler", (), {"cancel": staticmethod(cancelled.append)})()})()
    job = Job(JobRequest([1, 2], SamplingParams(max_tokens=2)))
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, gone)
    asyncio.run(asyncio.wait_for(answers.disconnected(state, request, job), timeout=5))
    assert cancelled == [job]


def test_faults_leave_the_server_serving(chat_model):
    """benchmarks/server_faults.py at a small size: malformed and oversized bodies (declared and chunked) get 4xx,
    extreme but valid values are answered, clients that leave mid-stream or while waiting free their slot and end
    their handler (the server stops in time), a burst past the slots gets only 200 and 429, and the greedy answer
    afterwards equals the one before."""
    from benchmarks.server_faults import run_faults

    with serving(chat_model, slots=2, max_waiting=2, budget=256, n_batch=16) as (port, _):
        report = run_faults(f"http://127.0.0.1:{port}", slots=2, max_waiting=2, body_limit=64 * 1024,
                            disconnects=3, sequential=20, long_prompt_words=60,
                            render=Llama(chat_model, policy="h2o", budget=64).apply_chat_template)
    assert len(report.checks) > 40 and not report.failed, report.failed


def test_llama_servers_typical_p_and_mirostat_reach_the_sampler(server, chat_model):
    """The same draws as `Llama`'s with the same settings and seed; llama-server's samplers this server does not have
    are a 400 naming them unless their value asks for nothing."""
    port, _ = server
    llm = Llama(chat_model, policy="h2o", budget=48)
    for fields, mine in (({"typical_p": 0.3}, {"typical_p": 0.3}),
                         ({"mirostat": 2, "mirostat_tau": 30.0, "mirostat_eta": 0.2},
                          {"mirostat_mode": 2, "mirostat_tau": 30.0, "mirostat_eta": 0.2}),
                         ({"mirostat_mode": 1, "mirostat_tau": 3.0}, {"mirostat_mode": 1, "mirostat_tau": 3.0})):
        status, out = post(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "seed": 7,
                                                     "temperature": 1.0, **fields})
        assert status == 200, out
        want = llm.create_completion("Once upon a time", max_tokens=12, seed=7, temperature=1.0, **mine)
        assert out["choices"][0]["text"] == want["choices"][0]["text"], fields
    plain = llm.create_completion("Once upon a time", max_tokens=12, seed=7, temperature=1.0)["choices"][0]["text"]
    status, out = post(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "seed": 7,
                                                 "temperature": 1.0, "mirostat": 2, "mirostat_tau": 30.0})
    assert out["choices"][0]["text"] != plain  # Mirostat draws otherwise than the default chain: the fields count
    for field, value in (("xtc_probability", 0.2), ("dry_multiplier", 0.8), ("mirostat", 3),
                         ("typical_p", 0), ("mirostat_tau", -1)):
        status, err = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
        assert status == 400 and field in json.dumps(err), (field, err)
    status, err = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, "mirostat": 1, "mirostat_mode": 2})
    assert status == 400 and err["error"]["param"] == "mirostat_mode"
    status, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, "tfs_z": 0.9, "xtc_probability": 0,
                                               "mirostat": 0})
    assert status == 200


def test_unsupported_fields_are_named_and_bad_values_are_400_not_dumps(server, chat_model):
    port, _ = server
    status, err = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, "best_of": 3})
    assert status == 400 and err["error"]["param"] == "best_of" and "not supported" in err["error"]["message"]
    status, err = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, "suffix": "end"})
    assert status == 400 and err["error"]["param"] == "suffix" and "fill-in-the-middle" in err["error"]["message"]
    # the values that ask for nothing are accepted (clients send their defaults)
    status, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, "presence_penalty": 0,
                                               "frequency_penalty": 0.0, "logit_bias": {}, "user": "u1"})
    assert status == 200
    # penalties and bias out of their ranges, or naming no token of the model, are a 400 naming the field
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repeat_penalty", 0),
                         ("logit_bias", {"5": 101}), ("logit_bias", {"": 1}), ("logit_bias", {str(10**8): 1}),
                         ("repeat_last_n", -1)):
        status, err = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
        assert status == 400 and field in json.dumps(err), (field, value, err)
    status, out = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 10**15})  # capped by the server
    assert status == 200 and out["usage"]["completion_tokens"] <= 4096
    # and within them they reach the sampler: a bias of 100 makes the token every greedy choice
    token = Llama(chat_model, policy="h2o", budget=16).tokenize(" banana", add_bos=False)[0]
    piece = Llama(chat_model, policy="h2o", budget=16).token_to_piece(token).decode()
    status, out = post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                 "logit_bias": {str(token): 100}, "presence_penalty": 0.5,
                                                 "repetition_penalty": 1.1})
    assert status == 200 and out["choices"][0]["text"] == piece * 3
    status, err = post(port, "/v1/completions", {"prompt": [1, True, 3], "max_tokens": 1})
    assert status == 400  # a JSON boolean is not a token id
    status, err = post(port, "/v1/completions", {"prompt": [2**40], "max_tokens": 1})
    assert status == 400 and "incompatible" not in err["error"]["message"]
    raw = b'{"prompt": "caf\\ud800", "max_tokens": 1}'  # a lone surrogate
    status, err = post(port, "/v1/completions", None, raw=raw)
    assert status == 400 and "surrogate" in err["error"]["message"] and "incompatible" not in err["error"]["message"]
    ids = Llama(chat_model, policy="h2o", budget=16).tokenize("Hi there", add_bos=False)
    status, out = post(port, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True})
    assert status == 200 and out["choices"][0]["text"].startswith("Hi there")  # token ids are echoed as text


def test_ignore_eos_runs_to_max_tokens_even_when_the_end_is_forced(server, chat_model):
    """llama-server's ignore_eos: an end token biased to be every greedy choice ends the answer at once without it,
    and never with it (the answer runs to max_tokens)."""
    port, _ = server
    end = Llama(chat_model, policy="h2o", budget=16).eog_tokens()[0]
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "logit_bias": {str(end): 100}}
    status, out = post(port, "/v1/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] <= 1
    status, out = post(port, "/v1/completions", {**body, "ignore_eos": True})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5


def test_an_answer_is_capped_by_the_server_when_the_request_sets_no_limit_or_a_larger_one(chat_model):
    """A bounded cache never fills up, so a model that never ends would hold its slot for good: answers stop at the
    server's max_tokens (default: the trained context) with finish_reason 'length'."""
    with serving(chat_model, slots=1, budget=32, app_kwargs={"max_tokens": 5}) as (port, _):
        for asked in ({}, {"max_tokens": 1000}):
            status, out = post(port, "/v1/chat/completions", {"messages": USER, "ignore_eos": True, **asked})
            assert status == 200 and out["usage"]["completion_tokens"] == 5, out
            assert out["choices"][0]["finish_reason"] == "length"
        status, out = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and out["usage"]["completion_tokens"] == 3  # a smaller limit stays the request's
    app = create_app(Llama(chat_model, policy="h2o", budget=32), model_id="tiny")
    assert app.state.server.max_tokens == 4096  # by default the tiny model's trained context


def unwrapped(result):
    """A scheduler's result as the test reads it: a step's event, a failure's error, Started as it is."""
    from h2o_local.server.scheduler import Failed, Step

    return result.event if isinstance(result, Step) else result.error if isinstance(result, Failed) else result


def recorded_jobs(log):
    """Jobs whose results go to `log` as (name, event or error), in the order the scheduler thread gives them."""
    from h2o_local.server.scheduler import Job, JobRequest

    def job(name, tokens, params):
        j = Job(JobRequest(tokens, params))
        j.put = lambda item: log.append((name, unwrapped(item)))
        return j

    return job


def wait_for(predicate, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_long_prompt_is_read_between_the_running_requests_tokens(chat_model):
    """Head of line: the running request gets a token between every two chunks of a long prompt, and a long prompt
    whose client leaves stops at the next chunk."""
    from h2o_local.sampling import SamplingParams
    from h2o_local.server.scheduler import Cancelled, Scheduler

    llm = Llama(chat_model, policy="h2o", budget=32, n_seq_max=2, kv_unified=False, n_batch=16, n_threads=1)
    scheduler = Scheduler(llm, session_bytes=0)
    log = []
    job = recorded_jobs(log)
    try:
        # it runs until the scheduler closes, however fast the machine: every wait below needs it running
        running = job("running", [1, 5, 6, 7], SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True))
        scheduler.submit(running)
        wait_for(lambda: any(n == "running" and getattr(e, "token", None) is not None for n, e in log))
        long = job("long", list(range(10, 10 + 16 * 12)), SamplingParams(max_tokens=1, temperature=0))
        mark = len(log)
        scheduler.submit(long)
        wait_for(lambda: any(n == "long" for n, _ in log[mark:]))
        started = next(i for i, (n, _) in enumerate(log) if n == "long")
        during = [e for n, e in log[mark:started] if n == "running" and e.token is not None]
        assert len(during) >= 10  # 12 chunks: a token of the running request between every two

        # the next long prompt's client leaves while it is read (once admitted, the running request's next token
        # comes from between its chunks): it stops at the next chunk and never starts; the other goes on
        leaving = job("leaving", list(range(10, 10 + 16 * 12)), SamplingParams(max_tokens=1, temperature=0))

        def cancel_once_admitted(item):
            log.append(("running", unwrapped(item)))
            if scheduler.holds_slot(leaving):
                leaving.progress.cancelled = True

        running.put = cancel_once_admitted
        mark = len(log)
        scheduler.submit(leaving)
        wait_for(lambda: any(n == "leaving" for n, _ in log[mark:]))
        end = next(i for i, (n, _) in enumerate(log) if n == "leaving")
        assert isinstance(log[end][1], Cancelled)  # it never started
        assert sum(1 for n, _ in log[mark:end] if n == "running") < 12  # fewer tokens than its chunks
        wait_for(lambda: scheduler.stats()["slots_processing"] == 1)
        before = sum(1 for n, _ in log if n == "running")
        wait_for(lambda: sum(1 for n, _ in log if n == "running") > before + 3)  # still decoding
    finally:
        scheduler.close()


def test_the_running_slots_tokens_are_decoded_with_the_prompts_chunks(chat_model):
    """Continuous batching: between two chunks of a long prompt every running slot draws its next token, and that
    token is decoded in the same llama_decode as the next chunk (one decode per chunk, not two), giving the tokens
    the running slot gives alone (on the CPU backend, whose results do not depend on a batch's size)."""
    from h2o_local.sampling import SamplingParams

    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    alone = Llama(chat_model, policy="h2o", budget=32, n_seq_max=2, kv_unified=False, n_batch=16, n_threads=1,
                  **CPU_BACKEND)
    slots = alone.slots()
    with slots.owned():
        slots.start(0, [1, 5, 6, 7], params)
        expected = [e.token for _ in range(14) for e in slots.step()]

    llm = Llama(chat_model, policy="h2o", budget=32, n_seq_max=2, kv_unified=False, n_batch=16, n_threads=1,
                **CPU_BACKEND)
    slots = llm.slots()
    got = []

    def between_chunks():
        events, riders = slots.ride()
        got.extend(e.token for e in events)
        assert list(riders) == [0] and len(riders[0]) == 1
        return riders

    with slots.owned():
        slots.start(0, [1, 5, 6, 7], params)
        got += [e.token for e in slots.step()]
        before = llm.stats()["decodes"]
        long_prompt = list(range(10, 10 + 15 * 12))  # 12 chunks of 15 tokens (n_batch 16 leaves one for a rider);
        # without riders: 12 chunks of 16 and less, and 11 decodes of the running slot between them
        slots.start(1, long_prompt, SamplingParams(max_tokens=1, temperature=0), between_chunks=between_chunks)
        assert llm.stats()["decodes"] - before == 12  # the 11 riders went with the chunks
        got += [e.token for e in slots.step() if e.index == 0]
    assert got == expected[:len(got)] and len(got) == 13
    assert llm.kv_state(1).n_seen == len(long_prompt) and llm.kv_state(0).n_seen == 4 + len(got)  # every token fed


SLOW = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if 'slow' in m['content'] %}"
                      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}")


def test_a_slow_template_is_rendered_off_the_event_loop_and_stopped(tmp_path):
    model = str(write_tiny_llama(tmp_path / "slow.gguf", chat_template=SLOW, n_ctx_train=4096))
    llm = Llama(model, policy="h2o", budget=64, n_seq_max=1, kv_unified=False, n_threads=1)
    app = create_app(llm, model_id="tiny", template_timeout_s=4.0)
    with serve_in_background(app) as port:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(port, "/v1/chat/completions",
                                                                   {"messages": [{"role": "user", "content": "slow"}]})))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.3)
        status, _ = get(port, "/health")
        # the event loop answered while the template ran: the slow request is not answered yet (no clock: a loaded
        # machine slows both alike)
        assert status == 200 and t.is_alive() and "r" not in result
        t.join(60)
        status, err = result["r"]
        assert status == 400 and "time limit" in err["error"]["message"] and time.monotonic() - t0 < 30
        status, _ = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "fast"}],
                                                        "max_tokens": 2})
        assert status == 200


def test_stop_lists_and_prompts_are_bounded(chat_model):
    llm = Llama(chat_model, policy="h2o", budget=64, n_seq_max=1, kv_unified=False, n_threads=1)
    app = create_app(llm, model_id="tiny", max_prompt_tokens=100)
    with serve_in_background(app) as port:
        status, err = post(port, "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]})
        assert status == 400 and "stop" in err["error"]["message"]
        status, err = post(port, "/v1/completions", {"prompt": "x", "stop": "s" * 257})
        assert status == 400 and "stop" in err["error"]["message"]
        status, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(16)]})
        assert status == 200
        status, err = post(port, "/v1/completions", {"prompt": list(range(5, 106)), "max_tokens": 2})
        assert status == 400 and err["error"]["code"] == "context_length_exceeded"


def test_one_settings_declaration_for_the_cli_the_environment_and_create_app(chat_model, monkeypatch):
    from pydantic import ValidationError

    from h2o_local.cli import main
    from h2o_local.server import ServerSettings

    monkeypatch.setenv("H2O_LOCAL_MAX_WAITING", "3")
    assert ServerSettings().max_waiting == 3 and ServerSettings(max_waiting=5).max_waiting == 5
    llm = Llama(chat_model, policy="h2o", budget=64, n_threads=1)
    app = create_app(llm, session_mib=0, model_id="m")
    assert app.state.server.scheduler.max_waiting == 3 and app.state.server.model_id == "m"
    app.state.server.scheduler.close()
    with pytest.raises(ValidationError):
        create_app(Llama(chat_model, policy="h2o", budget=64, n_threads=1), max_waiting=-1)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", chat_model, "--port", "70000"])
    assert e.value.code == 2


@pytest.mark.parametrize("probe", ["question", "repeat"])
def test_a_probing_policy_serves_concurrent_long_prompts_as_one_by_one(chat_model, probe):
    """Long prompts under a probing policy: each slot's prompt is probed and evicted in its stream, batching
    changes nothing but speed (on the CPU backend, as above), and a continued chat goes on from its cache."""
    from h2o_local import TOVA

    prompts = [f"Story {i}: " + "the lighthouse keeper wrote about ships. " * 6 + "What did he write?" for i in range(3)]
    policy = TOVA(budget=48, recent=8, probe=probe, pool=3)
    with serving(chat_model, budget=None, policy=policy, session_mib=16, **CPU_BACKEND) as (port, client):
        alone = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in prompts]
        results, barrier = [None] * 3, threading.Barrier(3)

        def complete(i):
            barrier.wait()
            results[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12,
                                                   temperature=0).choices[0].text

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == alone
        first = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
        again = USER + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": prompts[0]}]
        second = client.chat.completions.create(model="tiny", messages=again, max_tokens=8, temperature=0)
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
        deadline = time.monotonic() + 10  # a slot is released just after its response is sent
        while get(port, "/health")[1]["slots_processing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(port, "/health")[1]["slots_processing"] == 0


def test_api_key_guards_every_route_and_cors_answers_the_allowed_origin(chat_model):
    with serving(chat_model, slots=1, app_kwargs={"api_key": "s3cret", "cors_origins": "http://ui.example"}) as (port, client):
        body = json.dumps({"prompt": "x", "max_tokens": 1})
        for auth in (None, "Bearer wrong", "s3cret", "Bearer s3cret2", "Basic s3cret"):
            headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
                status, head, data = raw_request(port, method, path, headers, body if method == "POST" else None)
                assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", (auth, path)
                assert head["www-authenticate"] == "Bearer"
            # /health is public, as llama-server's (container probes carry no key), and then says only that
            status, _, data = raw_request(port, "GET", "/health", headers)
            assert status == 200 and json.loads(data) == {"status": "ok"}
        status, _, data = raw_request(port, "GET", "/health", {"Authorization": "Bearer s3cret"})
        assert status == 200 and "slots_total" in json.loads(data)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # the official client sends the key
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens <= 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        status, head, _ = raw_request(port, "OPTIONS", "/v1/chat/completions", preflight)
        assert status == 200 and head["access-control-allow-origin"] == "http://ui.example"
        status, head, _ = raw_request(port, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "http://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in head


def test_no_cors_and_no_key_by_default(server):
    port, _ = server
    status, head, _ = raw_request(port, "GET", "/health", {"Origin": "http://ui.example"})
    assert status == 200 and "access-control-allow-origin" not in head


def scrape(port):
    from prometheus_client.parser import text_string_to_metric_families

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}


def test_usage_says_what_the_cache_did_and_metrics_count_it(server):
    port, client = server
    before = scrape(port)
    out = client.completions.create(model="tiny", prompt="word " * 80, max_tokens=4, temperature=0)
    kv = out.usage.model_extra["kv_cache"]  # an extension field: the official client keeps it aside
    fed = out.usage.prompt_tokens + out.usage.completion_tokens
    assert kv["budget"] == 48 and kv["policy"].startswith("h2o-48") and 0 < kv["kept"] <= 48
    assert kv["kept"] + kv["evicted"] in (fed - 1, fed)  # the last token shown may not be fed
    after = scrape(port)
    delta = lambda name, labels=(): after.get((name, labels), 0) - before.get((name, labels), 0)
    assert delta("h2o_local_requests_total", (("outcome", "ok"),)) == 1
    assert delta("h2o_local_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("h2o_local_completion_tokens_total") == out.usage.completion_tokens
    assert delta("h2o_local_kv_evicted_entries_total") == kv["evicted"]
    assert delta("h2o_local_time_to_first_token_seconds_count") == 1
    assert after[("h2o_local_slots_total", ())] == 3 and after[("h2o_local_requests_waiting", ())] == 0


def test_a_system_prompt_longer_than_the_budget_protects_what_fits(server):
    port, client = server
    out = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0,
                                         messages=[{"role": "system", "content": "rule " * 60},
                                                   {"role": "user", "content": "hi"}])
    kv = out.usage.model_extra["kv_cache"]
    assert kv["protected"] == 24 and kv["protected_asked"] > 48 and kv["kept"] <= 48  # half the budget of 48
    out = client.completions.create(model="tiny", max_tokens=3, temperature=0, prompt="no system prompt here")
    assert out.usage.model_extra["kv_cache"]["protected"] == 0 and "protected_asked" not in out.usage.model_extra["kv_cache"]


def test_structured_output_through_the_official_client(server):
    port, client = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "answer", "schema": schema}})
    assert list(json.loads(out.choices[0].message.content)) == ["ok"]
    out = client.completions.create(model="tiny", prompt="Pick:", max_tokens=5, temperature=1.0,
                                    extra_body={"grammar": 'root ::= "left" | "right"'})
    assert out.choices[0].text in ("left", "right")
    status, err = post(port, "/v1/completions", {"prompt": "x", "grammar": 'root ::= "open'})
    assert status == 400 and err["error"]["param"] == "grammar" and "grammar" in err["error"]["message"]
    status, err = post(port, "/v1/chat/completions", {"messages": USER, "json_schema": {"type": "object"},
                                                      "grammar": 'root ::= "a"'})
    assert status == 400 and "not several" in err["error"]["message"]


def test_conversations_with_the_same_system_prompt_start_from_its_saved_cache(chat_model):
    """The answer after a saved system prompt equals a fresh server's (on the CPU backend, as above)."""
    system = {"role": "system", "content": "You answer in the voice of a lighthouse keeper, briefly."}
    ask = lambda client, text: client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0, messages=[system, {"role": "user", "content": text}])
    with serving(chat_model, slots=1, budget=256, **CPU_BACKEND) as (_, client):
        first = ask(client, "What do you see?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = ask(client, "Any ships tonight?")  # another conversation, same system prompt
        n_system = second.usage.model_extra["kv_cache"]["protected"]
        assert n_system > 0 and second.usage.prompt_tokens_details.cached_tokens == n_system
    with serving(chat_model, slots=1, budget=256, **CPU_BACKEND) as (_, fresh):  # a server that saved nothing
        alone = ask(fresh, "Any ships tonight?")
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == alone.choices[0].message.content
    with serving(chat_model, slots=1, budget=256, session_mib=0) as (_, off):  # sessions off: nothing saved or reused
        ask(off, "What do you see?")
        assert ask(off, "Any ships tonight?").usage.prompt_tokens_details.cached_tokens == 0


def test_riders_that_cannot_ride_are_refused_and_leave_the_sequences_usable(chat_model):
    """Only another sequence with a stream of its own, and a valid token, can ride with a prompt's chunks."""
    llm = Llama(chat_model, policy="h2o", budget=32, n_seq_max=2, kv_unified=False, n_batch=16, n_threads=1)
    long_prompt = list(range(10, 10 + 15 * 4))
    for riders, message in (({0: [5]}, "cannot ride: it is being fed"), ({1: []}, "has no token"),
                            ({1: [10**7]}, "out of range"), ({5: [5]}, "seq_id")):
        llm.reset()
        llm.eval([1, 5, 6], seq_id=1)
        with pytest.raises(ValueError, match=message):
            eval_with_riders(llm, {0: long_prompt}, lambda: riders)
        llm.eval([7], seq_id=1)  # both sequences go on
        llm.eval([8, 9], seq_id=0)
    unified = Llama(chat_model, policy="h2o", budget=32, n_seq_max=2, n_batch=16, n_threads=1)
    unified.eval([1, 5, 6], seq_id=1)
    with pytest.raises(ValueError, match="a stream of its own"):
        eval_with_riders(unified, {0: long_prompt}, lambda: {1: [5]})


def test_a_batch_of_prompts_and_n_samples_give_a_choice_each_as_separate_requests_would(server):
    """OpenAI's batch forms (evaluation harnesses send a list of prompts): choice i*n + k is prompt i's k-th sample,
    each what a request of its own gives (greedy: the same text; with a seed, sample k draws with seed + k)."""
    port, client = server
    prompts = ["Once upon a time", "The sea was", "In the year"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [client_tokens(port, p) for p in prompts[:2]]
    assert [c.text for c in client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices] \
        == [a.choices[0].text for a in alone[:2]]
    sampled = client.completions.create(model="tiny", prompt=prompts[:2], n=3, max_tokens=6, temperature=1.0, seed=7)
    assert len(sampled.choices) == 6
    for i, p in enumerate(prompts[:2]):
        for k in range(3):
            one = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=1.0, seed=7 + k)
            assert sampled.choices[i * 3 + k].text == one.choices[0].text
    assert sampled.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[:2])
    for body, param in (({"prompt": prompts, "stream": True}, "stream"), ({"prompt": ["x"] * 12}, "prompt"),
                        ({"prompt": "x", "n": 17}, "n"), ({"prompt": [[65, 66], [10**6]]}, "prompt")):
        status, err = post(port, "/v1/completions", {"max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)


def client_tokens(port, text):
    return post(port, "/tokenize", {"content": text, "add_special": True})[1]["tokens"]


def test_chat_n_gives_n_choices_as_n_requests_would(server):
    port, client = server
    ask = dict(model="tiny", messages=USER, max_tokens=6, temperature=1.0, seed=11)
    many = client.chat.completions.create(n=3, **ask)
    assert [c.index for c in many.choices] == [0, 1, 2]
    ones = [client.chat.completions.create(**{**ask, "seed": 11 + k}) for k in range(3)]
    assert [c.message.content for c in many.choices] == [o.choices[0].message.content for o in ones]
    assert many.usage.prompt_tokens == ones[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    for body, param in (({"n": 2, "stream": True}, "stream"), ({"n": 16}, "n")):  # 16 > slots + waiting here
        status, err = post(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
