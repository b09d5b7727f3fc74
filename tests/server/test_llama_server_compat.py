"""What llama-server's clients send works unchanged (issue 74): a system prompt with tools on a Llama 3.x template,
llama-server's logit_bias forms, CORS preflights with the headers browser SDKs send, and its context-overflow error
shape on its own routes."""
import http.client
import json


import pytest

from h2o_local import Llama
from real_templates import pinned_templates
from test_server import CHATML, post, serving
from tiny_model import write_tiny_llama
from tool_template import WEATHER


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("compat") / "chat.gguf", chat_template=CHATML,
                                n_ctx_train=512))


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model, slots=1, budget=48, app_kwargs={"cors_origins": "*", "max_prompt_tokens": 64}) as s:
        yield s


def test_a_system_prompt_with_tools_on_a_llama_3_template_is_kept_by_its_tokens(tmp_path):
    """Llama 3.1's template writes tools into the first user message and raises without one: the system prompt
    rendered alone was a 400; its protected prefix is now measured before a placeholder user message."""
    source = pinned_templates().get("meta-llama-Llama-3.1-8B-Instruct")
    if source is None:
        pytest.skip("optional: the pinned llama.cpp sdist (its templates) is not on this machine")
    model = str(write_tiny_llama(tmp_path / "llama31.gguf", chat_template=source, n_ctx_train=4096))
    llm = Llama(model, budget=512, keep="system")
    messages = [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": "Oslo?"}]
    with pytest.raises(ValueError):  # what the old way asked of the template
        llm.apply_chat_template(messages[:1], add_generation_prompt=False, tools=[WEATHER])
    tokens, n_keep = llm.chat_tokens(messages, tools=[WEATHER])
    assert n_keep > len(llm.tokenize("You are a weather bot.", add_bos=False))
    assert "You are a weather bot." in llm.detokenize(tokens[:n_keep]).decode()
    with serving(model, slots=1, budget=512) as (port, _):
        status, out = post(port, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 2})
        assert status == 200, out


def first_token(port, prompt, **extra):
    status, out = post(port, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, **extra})
    assert status == 200, out
    return out["content"]


def test_llama_servers_logit_bias_forms_reach_the_sampler(server, chat_model):
    """A token forced with +100 in one form is banned again by each other form (the later entry wins)."""
    port, _ = server
    token = Llama(chat_model, budget=48).tokenize("q", add_bos=False)[-1]  # after the tokenizer's leading space
    assert first_token(port, "Once upon", logit_bias=[[token, 100]]) == "q"
    assert first_token(port, "Once upon", logit_bias={str(token): 100}) == "q"
    for ban in ([[token, False]], [["q", False]], [["q", -100]]):
        assert first_token(port, "Once upon", logit_bias=[[token, 100]] + ban) != "q", ban
    assert first_token(port, "Once upon", logit_bias={str(token): 100, "q": False}) != "q"
    for bad in ([[token]], [["", 1]], {str(token): 101}, [[-1, 1]], [[token, "x"]]):
        status, out = post(port, "/completion", {"prompt": "x", "n_predict": 1, "logit_bias": bad})
        assert status == 400 and "logit_bias" in json.dumps(out), bad


def test_a_cors_preflight_takes_the_headers_browser_sdks_send(server):
    port, _ = server
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("OPTIONS", "/v1/messages", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key,anthropic-version,x-stainless-os,content-type"})
    r = c.getresponse()
    r.read()
    assert r.status == 200
    assert "x-stainless-os" in r.getheader("access-control-allow-headers").lower()


def test_a_context_overflow_on_llama_servers_routes_has_its_shape(server):
    port, _ = server
    status, out = post(port, "/completion", {"prompt": list(range(10, 110)), "n_predict": 1})
    assert status == 400
    error = out["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_prompt_tokens"] == 100 and error["n_ctx"] == 64
    status, out = post(port, "/v1/completions", {"prompt": list(range(10, 110)), "max_tokens": 1})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and out["error"]["n_prompt_tokens"] == 100


def test_a_final_assistant_message_is_continued_when_asked(server, chat_model):
    """An assistant prefill (JSON started, "go on"): continue_final_message / add_generation_prompt: false (vLLM's,
    transformers' and llama-server's fields) and Anthropic's API continue it instead of opening a new turn."""
    port, client = server
    llm = Llama(chat_model, budget=48)
    messages = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"name": "'}]
    closed, _ = llm.chat_tokens(messages)
    prefill, _ = llm.chat_tokens(messages, continue_final=True)
    assert llm.detokenize(prefill).decode().endswith('<|im_start|>assistant\n{"name": "')
    assert len(prefill) < len(closed)
    for fields in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=fields)
        assert out.usage.prompt_tokens == len(prefill), fields
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == len(closed)  # OpenAI's: a new answer after it
    import anthropic

    answer = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0).messages.create(
        model="tiny", messages=messages, max_tokens=1)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == len(prefill)


def stream(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
    lines = c.getresponse().read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_completion_answers_with_llama_servers_fields_whole_and_streamed(server, chat_model):
    """Issue 74's seventh: tokens (with return_tokens, and in every stream chunk), has_new_line,
    generation_settings, prompt, id_slot, index, and the timings' cache_n and per-token figures."""
    port, _ = server
    llm = Llama(chat_model, budget=48)
    ask = {"prompt": "Far away", "n_predict": 6, "temperature": 0, "ignore_eos": True}  # read for the first time
    status, out = post(port, "/completion", ask)
    assert status == 200 and out["tokens"] == [] and out["index"] == 0 and out["id_slot"] == 0
    assert out["prompt"] == llm.detokenize(llm.tokenize("Far away"), special=True).decode()
    assert out["has_new_line"] == ("\n" in out["content"])
    settings = out["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["ignore_eos"], settings["stream"]) == (6, 0, True, False)
    timings = out["timings"]
    assert timings["cache_n"] == out["tokens_cached"] and timings["predicted_n"] == 6
    assert timings["predicted_per_token_ms"] * 5 == pytest.approx(timings["predicted_ms"])  # after the first token
    assert timings["prompt_per_second"] > 0 and timings["prompt_per_token_ms"] > 0
    status, with_ids = post(port, "/completion", {**ask, "return_tokens": True})
    assert len(with_ids["tokens"]) == 6
    assert llm.detokenize(with_ids["tokens"]).decode("utf-8", errors="replace") == out["content"]
    events = stream(port, "/completion", ask)
    pieces = [e for e in events if not e["stop"]]
    assert [t for e in pieces for t in e["tokens"]] == with_ids["tokens"]
    assert all(e["index"] == 0 and e["id_slot"] == 0 and e["tokens_evaluated"] == out["tokens_evaluated"] for e in pieces)
    assert events[-1]["stop"] and events[-1]["generation_settings"]["stream"] is True


def test_n_probs_gives_each_tokens_most_likely_alternatives_as_llama_server_does(server, chat_model):
    port, client = server
    ask = {"prompt": "Once upon", "n_predict": 4, "temperature": 0, "ignore_eos": True, "n_probs": 3}
    status, out = post(port, "/completion", ask)
    assert status == 200
    probs = out["completion_probabilities"]
    assert len(probs) == 4 and "".join(p["token"] for p in probs) == out["content"]
    for p in probs:
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"] and top[0]["logprob"] == p["logprob"]  # greedy: the likeliest
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert bytes(p["bytes"]).decode("utf-8", errors="replace") == p["token"]
    same = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    assert [p["logprob"] for p in probs] == pytest.approx(same.choices[0].logprobs.token_logprobs, abs=1e-5)
    streamed = [p for e in stream(port, "/completion", ask) for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]
    status, err = post(port, "/completion", {**ask, "post_sampling_probs": True})
    assert status == 400 and err["error"]["param"] == "post_sampling_probs"


def test_the_servers_seed_is_the_seed_of_requests_that_send_none(chat_model):
    ask = {"prompt": "Once upon", "n_predict": 8, "temperature": 1.0, "ignore_eos": True}
    with serving(chat_model, slots=1, budget=48, app_kwargs={"seed": 5}) as (port, _):
        seeded = [post(port, "/completion", ask)[1]["content"] for _ in range(2)]
        given = post(port, "/completion", {**ask, "seed": 5})[1]
    assert seeded[0] == seeded[1] == given["content"] and given["generation_settings"]["seed"] == 5


def test_metrics_carry_llama_servers_names(server):
    port, _ = server
    status, out = post(port, "/completion", {"prompt": "Once upon", "n_predict": 3, "ignore_eos": True})
    assert status == 200
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    response = c.getresponse()
    assert int(response.getheader("Process-Start-Time-Unix")) > 0
    text = response.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("llamacpp:")}
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE llamacpp:"))
    assert types["llamacpp:prompt_tokens_total"] == "counter" and types["llamacpp:requests_processing"] == "gauge"
    assert set(types) == set(values)  # every line has its TYPE under its own name, _total included
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_busy_slots_per_decode",
                 "prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred"):
        assert f"llamacpp:{name}" in values, name
    assert values["llamacpp:tokens_predicted_total"] >= 3 and values["llamacpp:prompt_tokens_total"] > 0
    assert values["llamacpp:n_decode_total"] >= 2 and values["llamacpp:requests_processing"] == 0
    assert 0 < values["llamacpp:n_busy_slots_per_decode"] <= 1  # one slot here


def test_tools_on_a_template_without_a_call_format_take_llama_servers_generic_fallback(tmp_path):
    """SmolLM2's ChatML names no tool format: a request with tools was a 400 (an agent stopped there); the tools
    are now described in the system message and the answer is JSON, a call or a response."""
    model = str(write_tiny_llama(tmp_path / "chatml.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=1, budget=48) as (_, client):
        _generic_tool_calls(client)


def _generic_tool_calls(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                         tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert out.choices[0].finish_reason == "tool_calls"
    auto = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello?"}],
                                          tools=[WEATHER], max_tokens=200, temperature=0)
    message = auto.choices[0].message
    assert message.tool_calls or not message.content.lstrip().startswith('{"response"')  # a reply is unwrapped


def test_what_the_peer_run_found_answers_as_llama_server_does(server, chat_model):
    """llama.cpp's own tests (results/serving/peer-llama-server.md): a system_fingerprint on OpenAI's objects, both
    continue_final_message and add_generation_prompt is a 400, ignore_eos lists the banned end tokens in
    generation_settings.logit_bias, /props names the model file."""
    port, client = server
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.system_fingerprint.startswith("b") and out.system_fingerprint.endswith(_engine_commit())
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert done.system_fingerprint == out.system_fingerprint
    status, err = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Hel"}],
                                                      "continue_final_message": True, "add_generation_prompt": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    llm = Llama(chat_model, budget=48)
    status, out = post(port, "/completion", {"prompt": "Hi", "n_predict": 2, "ignore_eos": True})
    banned = out["generation_settings"]["logit_bias"]
    assert {b["token"] for b in banned} == set(llm.eog_tokens()) and all(b["bias"] is None for b in banned)
    status, out = post(port, "/completion", {"prompt": "Hi", "n_predict": 2, "logit_bias": [[5, 1.5]]})
    assert out["generation_settings"]["logit_bias"] == [{"token": 5, "bias": 1.5}]
    status, out = post(port, "/completion", {"prompt": "Hi", "n_predict": 1, "ignore_eos": True})
    # the first token is the prompt's (its last batch's logits): no generation rate of one token
    assert (out["timings"]["predicted_per_second"], out["timings"]["predicted_per_token_ms"]) == (0.0, 0.0)
    status, err = post(port, "/infill", {"input_prefix": "x", "input_extra": [{"filename": "ok"}]})
    assert status == 400 and err["error"]["param"].startswith("input_extra")  # a file's text is required


def test_a_template_that_reads_date_string_gets_today_as_llama_cpp_gives_it():
    import datetime

    from h2o_local.chat_template import ChatTemplate

    template = ChatTemplate("{{ date_string }}|{% for m in messages %}{{ m['content'] }}{% endfor %}")
    today = datetime.date.today().strftime("%d %b %Y")
    assert template.render([{"role": "user", "content": "hi"}]) == f"{today}|hi"
    assert template.render([{"role": "user", "content": "hi"}], variables={"date_string": "1 Jan 2000"}) == "1 Jan 2000|hi"


def _engine_commit():
    from h2o_local import _engine

    return _engine.LLAMA_CPP_COMMIT[:7]
