"""The routes of the servers a client may have been written for, beside OpenAI's: llama-server's /completion,
/tokenize, /detokenize, /apply-template and /props, llama-cpp-python's /extras/tokenize, /extras/tokenize/count and
/extras/detokenize. Each gives what `Llama` or the OpenAI route gives for the same call; bad input is a 400 naming
its field."""
import os
import http.client
import json

import openai
import pytest

from test_server import CHATML, USER, get, post, raw_request, serving
from tiny_model import write_tiny_llama

SLOTS = 2
BUDGET = 48
TEXT = "Once upon a time, é and 😀 <|im_end|> end"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tok") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096,
                                special_tokens=["<|im_start|>", "<|im_end|>"]))


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model, slots=SLOTS, budget=BUDGET) as s:
        yield s


@pytest.fixture(scope="module")
def llm(chat_model):
    from h2o_local import Llama
    return Llama(chat_model, budget=BUDGET, n_threads=1)


@pytest.mark.parametrize("add_special", [False, True])
@pytest.mark.parametrize("parse_special", [True, False])
def test_tokenize_gives_llama_s_tokens_and_detokenize_gives_the_text_back(server, llm, add_special, parse_special):
    port, _ = server
    status, out = post(port, "/tokenize", {"content": TEXT, "add_special": add_special, "parse_special": parse_special})
    assert status == 200
    assert out["tokens"] == llm.tokenize(TEXT, add_bos=add_special, special=parse_special)
    status, back = post(port, "/detokenize", {"tokens": out["tokens"]})
    assert (status, back["content"]) == (200, llm.detokenize(out["tokens"], special=True).decode())
    plain = TEXT.replace("<|im_end|>", "")  # after a special token, this SPM vocabulary starts a word with a space
    tokens = post(port, "/tokenize", {"content": plain, "add_special": add_special})[1]["tokens"]
    assert post(port, "/detokenize", {"tokens": tokens})[1]["content"].endswith(plain)  # after BOS, where added


def test_special_token_text_is_one_token_when_parsed_and_plain_text_when_not(server, llm):
    port, _ = server
    end = llm.tokenize("<|im_end|>", add_bos=False, special=True)
    assert len(end) == 1
    assert post(port, "/tokenize", {"content": "<|im_end|>"})[1]["tokens"] == end
    as_text = post(port, "/tokenize", {"content": "<|im_end|>", "parse_special": False})[1]["tokens"]
    assert len(as_text) > 1 and end[0] not in as_text


def test_pieces_are_strings_or_the_bytes_of_a_part_of_a_character(server, llm):
    """llama-server's with_pieces: each id with its text, a list of byte values where a token holds part of a UTF-8
    character (this model's byte tokens split é and 😀); the pieces' bytes put together are the text's (as the
    tokenizer reads it)."""
    port, _ = server
    status, out = post(port, "/tokenize", {"content": TEXT, "with_pieces": True, "parse_special": False})
    assert status == 200
    ids = [p["id"] for p in out["tokens"]]
    assert ids == llm.tokenize(TEXT, add_bos=False, special=False)
    pieces = [p["piece"] for p in out["tokens"]]
    assert any(isinstance(p, list) for p in pieces) and any(isinstance(p, str) for p in pieces)
    joined = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces)
    assert joined.lstrip(b" ") == TEXT.encode()  # an SPM vocabulary starts the text with a space


def test_llama_cpp_python_s_extras_count_the_tokens_its_tokenize_gives(server, llm):
    port, _ = server
    expected = llm.tokenize(TEXT, add_bos=True, special=True)  # llama-cpp-python's: BOS added, special text parsed
    assert post(port, "/extras/tokenize", {"input": TEXT, "model": "tiny"}) == (200, {"tokens": expected})
    assert post(port, "/extras/tokenize/count", {"input": TEXT}) == (200, {"count": len(expected)})
    status, out = post(port, "/extras/detokenize", {"tokens": llm.tokenize(TEXT, add_bos=False)})
    assert (status, out["text"]) == (200, TEXT)


def test_apply_template_gives_the_prompt_a_chat_request_is_read_as(server, llm):
    port, _ = server
    status, out = post(port, "/apply-template", {"messages": USER})
    assert status == 200 and out["prompt"] == llm.apply_chat_template(USER)
    assert out["prompt"].startswith("<|im_start|>system\nYou are tiny.<|im_end|>")
    assert out["prompt"].endswith("<|im_start|>assistant\n")
    # variables the template does not read change nothing (llama-server's chat_template_kwargs)
    status, out = post(port, "/apply-template", {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and out["prompt"] == llm.apply_chat_template(USER)
    status, out = post(port, "/apply-template", {"messages": USER, "add_generation_prompt": False})
    assert status == 200 and out["prompt"] == llm.apply_chat_template(USER, add_generation_prompt=False)
    assert not out["prompt"].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [5, 100000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/extras/detokenize", {"tokens": "12"}, "tokens"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"text": "the wrong name"}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/extras/tokenize", {"content": "llama-server's name"}, "input"),
    ("/apply-template", {"messages": [{"role": "narrator", "content": "x"}]}, "messages.0.role"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
])
def test_bad_input_is_a_400_naming_its_field_and_the_server_goes_on(server, path, body, param):
    port, client = server
    status, out = post(port, path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert post(port, "/tokenize", {"content": "still here"})[0] == 200


def test_text_longer_than_the_server_takes_is_refused_before_it_is_tokenized(chat_model):
    with serving(chat_model, slots=1, budget=BUDGET, app_kwargs={"max_prompt_tokens": 64}) as (port, _):
        status, out = post(port, "/tokenize", {"content": "x" * 5000})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded"
        status, out = post(port, "/extras/tokenize/count", {"input": "x" * 5000})
        assert status == 400 and out["error"]["param"] == "input"


def test_props_say_the_slots_the_longest_prompt_and_the_template(server, llm):
    port, _ = server
    status, props = get(port, "/props")
    assert status == 200
    assert props["total_slots"] == SLOTS and props["chat_template"] == CHATML
    assert props["model_path"] == os.path.basename(llm.model_path)  # the file's name, not where it lives
    status, health = get(port, "/health")
    assert props["kv_cache"]["budget"] == BUDGET and props["kv_cache"]["cells_per_slot"] > BUDGET
    # a bounded cache evicts as it reads: a prompt may be longer than a slot's cells
    assert props["default_generation_settings"]["n_ctx"] == 4096 > props["kv_cache"]["cells_per_slot"]
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8


def test_props_of_a_full_cache_give_the_prompt_that_fits_in_a_slot(chat_model):
    with serving(chat_model, slots=1, policy="full", budget=None, n_ctx=256) as (port, _):
        props = get(port, "/props")[1]
        assert props["default_generation_settings"]["n_ctx"] == props["kv_cache"]["cells_per_slot"] - 1 == 255
        too_long = {"prompt": [65] * 256, "max_tokens": 1}
        assert post(port, "/v1/completions", too_long)[1]["error"]["code"] == "context_length_exceeded"
        assert post(port, "/v1/completions", {**too_long, "prompt": [65] * 255})[0] == 200


def test_an_api_key_guards_the_token_routes_too(chat_model):
    with serving(chat_model, slots=1, app_kwargs={"api_key": "s3cret"}) as (port, _):
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
                             ("POST", "/extras/tokenize"), ("GET", "/props")):
            body = json.dumps({"content": "x"}) if method == "POST" else None
            status, _, data = raw_request(port, method, path, {"Content-Type": "application/json"}, body)
            assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", path
        headers = {"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
        status, _, data = raw_request(port, "POST", "/tokenize", headers, json.dumps({"content": "x"}))
        assert status == 200 and json.loads(data)["tokens"]


def test_an_empty_prompt_is_completed_from_the_bos_token(server):
    _, client = server
    out = client.completions.create(model="tiny", prompt="", max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == 1 and out.usage.completion_tokens == 3


def test_llama_server_s_completion_answers_as_the_openai_route_does_whole_or_streamed(server):
    port, client = server
    same = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    status, out = post(port, "/completion", {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0,
                                             "ignore_eos": True})
    assert status == 200 and out["stop"] and out["content"] == same.choices[0].text
    assert (out["tokens_predicted"], out["tokens_evaluated"]) == (8, same.usage.prompt_tokens)
    assert out["stopped_limit"] and out["timings"]["predicted_n"] == 8 and out["timings"]["predicted_ms"] > 0
    assert (out["stop_type"], out["stopping_word"], out["stopped_word"], out["stopped_eos"]) == ("limit", "", False, False)
    word = out["content"].strip()[2:5]  # a stop string the greedy answer holds
    status, cut = post(port, "/completion", {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0,
                                             "ignore_eos": True, "stop": ["never there", word]})
    assert (cut["stop_type"], cut["stopping_word"], cut["stopped_word"]) == ("word", word, True)
    assert cut["content"] == out["content"][:out["content"].find(word)] and not cut["stopped_limit"]
    status, ended = post(port, "/completion", {"prompt": "x", "n_predict": 8, "grammar": 'root ::= "ab"'})
    assert (ended["content"], ended["stop_type"], ended["stopped_eos"]) == ("ab", "eos", True)
    ids = post(port, "/tokenize", {"content": "Once upon a time", "add_special": True})[1]["tokens"]
    assert post(port, "/completion", {"prompt": ids, "n_predict": 8, "temperature": 0,
                                      "ignore_eos": True})[1]["content"] == out["content"]
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/completion", body=json.dumps({"prompt": "Once upon a time", "n_predict": 8, "temperature": 0,
                                                     "ignore_eos": True, "stream": True}),
              headers={"Content-Type": "application/json"})
    lines = c.getresponse().read().decode().splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == out["content"] and events[-1]["tokens_predicted"] == 8
    for body, param in (({"prompt": "x", "n_predict": "many"}, "n_predict"), ({"prompt": "x", "n_probs": 21}, "n_probs"),
                        ({"prompt": [10**6]}, "prompt"), ({"n_predict": 2}, "prompt")):
        status, err = post(port, "/completion", body)
        assert status == 400 and err["error"]["param"] == param, (body, err)


def test_llama_server_s_aliases_answer_as_their_routes_for_a_client_given_the_server_without_v1(server):
    """llama-server serves /chat/completions, /models and /v1/health beside the /v1 routes, and /completions as its
    own /completion: a client configured with the server's address alone (no /v1) reaches them."""
    port, client = server
    bare = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0, timeout=60)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    assert bare.chat.completions.create(**ask).choices[0].message.content == \
        client.chat.completions.create(**ask).choices[0].message.content
    assert [m.id for m in bare.models.list()] == [m.id for m in client.models.list()] == ["tiny"]
    assert get(port, "/v1/health")[0] == 200
    body = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0, "ignore_eos": True}
    assert post(port, "/completions", body)[1]["content"] == post(port, "/completion", body)[1]["content"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                                        ("/completion", {"prompt": "x", "n_predict": 2}),
                                        ("/api/generate", {"prompt": "x", "raw": True, "stream": False,
                                                           "options": {"num_predict": 2}})])
def test_a_body_sent_as_a_form_is_read_as_json_unless_a_browser_sent_it(server, path, body):
    """curl -d sends JSON with a form's content type (llama-server's and Ollama's examples do): read as JSON. A
    browser says its Origin, and a page on another site may send a form without asking first: that stays a 400."""
    port, _ = server
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, data = raw_request(port, "POST", path, form, json.dumps(body))
    assert status == 200, data
    status, _, data = raw_request(port, "POST", path, {}, json.dumps(body))  # no content type at all
    assert status == 200, data
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        status, _, data = raw_request(port, "POST", path, {"Content-Type": kind, "Origin": "http://evil.example"},
                                      json.dumps(body))
        assert status == 400, (kind, data)
