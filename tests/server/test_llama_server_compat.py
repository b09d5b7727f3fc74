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
    assert answer.usage.input_tokens == len(prefill)
