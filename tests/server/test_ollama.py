"""Ollama's API, driven by Ollama's own Python client: /api/chat and /api/generate run on the same slots as the
OpenAI routes (the same greedy answers), stream one JSON object per line by default, count what they read and
wrote, and go on from an answer's `context`; bad input is Ollama's {"error": "..."} with a 400."""
import json
import time

import httpx
import ollama
import pytest

from test_server import CHATML, get, post, serving
from tiny_model import write_tiny_llama

GREEDY = {"temperature": 0, "num_predict": 8}
RAW = {**GREEDY, "repeat_penalty": 1.0}  # Ollama samples with a 1.1 penalty; a text completion with none
MESSAGES = [{"role": "system", "content": "You are tiny."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("ollama") / "chat.gguf", chat_template=CHATML,
                                n_ctx_train=4096))


@pytest.fixture(scope="module")
def server(chat_model):
    with serving(chat_model, slots=2, budget=48) as (port, openai_client):
        yield port, openai_client, ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)


def test_a_chat_answers_as_the_openai_route_does_whole_or_streamed(server):
    port, openai_client, client = server
    whole = client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
    same = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    assert whole.message.role == "assistant" and whole.message.content == same.choices[0].message.content
    assert whole.done and whole.done_reason == same.choices[0].finish_reason == "length"
    assert (whole.prompt_eval_count, whole.eval_count) == (same.usage.prompt_tokens, 8)
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.eval_duration > 0
    chunks = list(client.chat(model="tiny", messages=MESSAGES, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == 8 and chunks[-1].done_reason == "length"


def test_a_stream_is_one_json_object_per_line_unless_told_otherwise(server):
    port, _, _ = server
    with httpx.stream("POST", f"http://127.0.0.1:{port}/api/generate",
                      json={"model": "tiny", "prompt": "Once", "raw": True, "options": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and not any(x["done"] for x in lines[:-1]) and lines[-1]["eval_count"] == 8


def test_a_raw_generate_is_a_text_completion_and_its_context_goes_on_from_it(server):
    port, openai_client, client = server
    first = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=RAW)
    same = openai_client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=8)
    assert first.response == same.choices[0].text
    prompt = post(port, "/tokenize", {"content": "Once upon a time", "add_special": True})[1]["tokens"]
    assert first.context[:len(prompt)] == prompt and len(first.context) == len(prompt) + 8
    assert post(port, "/detokenize", {"tokens": first.context[len(prompt):]})[1]["content"] == first.response
    more = client.generate(model="tiny", prompt=" and then", raw=True, context=first.context, options=RAW)
    tail = post(port, "/tokenize", {"content": " and then"})[1]["tokens"]
    assert more.context[:len(first.context) + len(tail)] == first.context + tail
    assert more.prompt_eval_count == len(first.context) + len(tail)
    # the same tokens as one completion: the same answer
    whole = openai_client.completions.create(model="tiny", prompt=first.context + tail, temperature=0, max_tokens=8)
    assert more.response == whole.choices[0].text


def test_a_generate_without_raw_is_a_chat_with_its_system_prompt(server):
    _, _, client = server
    generated = client.generate(model="tiny", prompt="Say something.", system="You are tiny.", options=GREEDY)
    assert generated.response == client.chat(model="tiny", messages=MESSAGES, options=GREEDY).message.content


def test_format_constrains_the_answer_to_json_or_a_schema(server):
    _, _, client = server
    answer = client.chat(model="tiny", messages=MESSAGES, format={"type": "string", "enum": ["yes", "no"]},
                         options={"num_predict": 10})
    assert json.loads(answer.message.content) in ("yes", "no")
    answer = client.generate(model="tiny", prompt="x", format="json", options={"num_predict": 12})
    assert answer.response.lstrip().startswith(("{", "["))


def test_bad_input_is_ollama_s_error_with_a_400_and_the_server_goes_on(server):
    port, _, client = server
    cases = [(dict(options={"bogus": 1}), "options.bogus"), (dict(options={"temperature": "hot"}), "options.temperature"),
             (dict(options={"num_predict": "many"}), "options.num_predict"), (dict(think=True), "think")]
    for kwargs, named in cases:
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="tiny", messages=MESSAGES, **kwargs)
        assert e.value.status_code == 400 and named in e.value.error, kwargs
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=MESSAGES, tools=[{"type": "function", "function": {"name": ""}}])
    assert e.value.status_code == 400 and "tools[0].function.name" in e.value.error
    for path, body in (("/api/chat", b"{not json"), ("/api/chat", b'{"messages": "hi"}'),
                       ("/api/generate", b'{"prompt": "x", "context": [999999]}'),
                       ("/api/generate", b'{"prompt": "x", "suffix": "y"}')):
        r = httpx.post(f"http://127.0.0.1:{port}{path}", content=body)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (body, r.text)
    assert client.generate(model="tiny", prompt="still", raw=True, options=GREEDY).eval_count == 8


def test_a_request_with_nothing_to_answer_loads_the_model_as_ollama_s_does(server):
    _, _, client = server
    assert client.generate(model="tiny").done_reason == "load"
    assert client.chat(model="tiny", messages=[]).done_reason == "load"


def test_tags_show_ps_and_version_describe_the_one_model(server, chat_model):
    port, _, client = server
    (model,) = client.list().models
    assert model.model == "tiny" and model.details.format == "gguf" and model.details.family == "llama"
    shown = client.show("tiny")
    assert shown.capabilities == ["completion", "tools"]  # CHATML has no call format: the generic fallback
    assert shown.template == CHATML and shown.modelinfo["llama.context_length"] == 4096
    assert [m.model for m in client.ps().models] == ["tiny"]
    assert get(port, "/api/version")[1]["version"]


def test_a_client_that_leaves_a_stream_frees_its_slot(server):
    port, _, _ = server
    with httpx.stream("POST", f"http://127.0.0.1:{port}/api/chat",
                      json={"model": "tiny", "messages": MESSAGES, "options": {"num_predict": 4000}}) as r:
        next(r.iter_lines())  # one line, then gone
    for _ in range(100):
        if get(port, "/health")[1]["slots_processing"] == 0:
            break
        time.sleep(0.1)
    assert get(port, "/health")[1]["slots_processing"] == 0


def test_tool_calls_go_in_and_come_out_in_ollama_s_shape(tmp_path):
    """A conversation with a call and its result, in Ollama's shape (arguments as an object, the result by tool
    name), reads as the same conversation in OpenAI's shape; a parsed call comes back with its arguments as an
    object."""
    from h2o_local.server.ollama import ollama_calls
    from h2o_local.tools import parse_calls
    from tool_template import HERMES, WEATHER

    model = str(write_tiny_llama(tmp_path / "hermes.gguf", chat_template=HERMES, n_ctx_train=4096))
    # Ollama's client sends a tool's schema with the keys it knows (no maxLength): the OpenAI request sends the same
    tool = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)
    asked = [{"role": "user", "content": "Weather in Oslo?"}]
    ollama_turns = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]},
        {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"}]
    openai_turns = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "content": "12 degrees", "tool_call_id": "c1"}]
    with serving(model, slots=1, budget=256) as (port, openai_client):
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        assert client.show("tiny").capabilities == ["completion", "tools"]
        answer = client.chat(model="tiny", messages=ollama_turns, tools=[tool], options=GREEDY)
        same = openai_client.chat.completions.create(model="tiny", messages=openai_turns, tools=[tool],
                                                     temperature=0, max_tokens=8, extra_body={"repeat_penalty": 1.1})
        assert answer.prompt_eval_count == same.usage.prompt_tokens
        assert answer.message.content == (same.choices[0].message.content or "")
    # the fields of Ollama's messages that templates read under OpenAI's names
    from h2o_local.server.ollama import openai_message
    assert openai_message(2, ollama_turns[2])["name"] == "get_weather"
    assert openai_message(1, {"role": "assistant", "content": "4", "thinking": "2 + 2"})["reasoning_content"] == "2 + 2"
    _, calls = parse_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
                           '</tool_call>')
    assert ollama_calls(calls) == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]


def test_pulling_the_served_model_succeeds_and_any_other_or_managing_models_is_a_clear_error(server):
    """Clients pull the model before they chat: the one this server runs is there at once; another is a 404 naming
    the one it runs, and creating, copying, pushing or deleting models is a 403 (one model, given at the start)."""
    port, _, client = server
    assert client.pull("tiny").status == "success"
    assert [p.status for p in client.pull("tiny:latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 404 and "'tiny'" in e.value.error
    for call in (lambda: client.delete("tiny"), lambda: client.copy("tiny", "other"),
                 lambda: client.create(model="other", from_="tiny")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 403 and "one model" in e.value.error


def test_a_route_ollama_s_api_lacks_here_answers_in_ollama_s_error_shape(server):
    port, _, client = server
    status, out = post(port, "/api/no-such-route", {})
    assert status == 404 and out["error"] == "Not Found: POST /api/no-such-route"
    status, out = get(port, "/api/chat")
    assert status == 405 and "GET /api/chat" in out["error"]


def test_a_stream_that_fails_once_started_ends_with_ollama_s_error_line(server, monkeypatch):
    """An error after the first line (the answer already streaming): the stream's last line is {"error": ...}, as
    Ollama ends a broken stream, and the server goes on."""
    from h2o_local.server import answers

    real = answers.job_steps

    async def breaking(state, job):
        async for step in real(state, job):
            yield step
            raise RuntimeError("the device went away")

    port, _, client = server
    monkeypatch.setattr(answers, "job_steps", breaking)
    with httpx.stream("POST", f"http://127.0.0.1:{port}/api/generate",
                      json={"model": "tiny", "prompt": "Once", "raw": True, "options": GREEDY}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and "the device went away" in lines[-1]["error"]
    assert not any(x.get("done") for x in lines)
    monkeypatch.setattr(answers, "job_steps", real)
    assert client.generate(model="tiny", prompt="Once", raw=True, options=GREEDY).done
