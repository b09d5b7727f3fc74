"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official Anthropic client, as
Claude Code and the SDK call llama-server and Ollama: text and blocks in, a message of blocks out, its events
streamed, tools and the round trip of a tool's result, thinking blocks, Anthropic's errors and its `x-api-key`."""
import json

import anthropic
import pytest

from test_reasoning import OPENED
from test_server import post, serving
from tiny_model import write_tiny_llama
from tool_template import HERMES

SAID = {"grammar": 'root ::= "Hi. Bye."'}
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


def read(m):
    """The prompt tokens a message's answer read: Anthropic counts those found in a saved cache apart."""
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


def client_of(port, key="none"):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("anthropic") / "tools.gguf", chat_template=HERMES,
                                 n_ctx_train=4096))
    with serving(model, slots=2, budget=256) as (port, openai_client):
        yield port, client_of(port), openai_client


def test_a_message_is_answered_with_text_blocks_and_its_stop_reason(server):
    port, client, openai_client = server
    m = client.messages.create(model="tiny", max_tokens=20, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}], extra_body=SAID)
    assert (m.type, m.role, m.stop_reason, m.stop_sequence) == ("message", "assistant", "end_turn", None)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hi. Bye." and m.id.startswith("msg_")
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=20, extra_body=SAID, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert (read(m), m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert client.messages.count_tokens(model="tiny", system="Be brief.", messages=[
        {"role": "user", "content": "Hello"}]).input_tokens == read(m)
    stopped = client.messages.create(model="tiny", max_tokens=20, messages=[{"role": "user", "content": "Hello"}],
                                     stop_sequences=["Bye"], extra_body=SAID)
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "Bye", "Hi. ")
    cut = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hello"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    blocks = client.messages.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}])
    assert read(blocks) == read(cut)


def test_a_streamed_message_comes_as_its_events(server):
    port, client, _ = server
    events = list(client.messages.create(model="tiny", max_tokens=20, stream=True,
                                         messages=[{"role": "user", "content": "Hello"}], extra_body=SAID))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                   "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Hi. Bye."
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 0
    with client.messages.stream(model="tiny", max_tokens=20, messages=[{"role": "user", "content": "Hello"}],
                                extra_body=SAID) as stream:
        assert "".join(stream.text_stream) == "Hi. Bye."
        assert stream.get_final_message().content[0].text == "Hi. Bye."


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_and_its_result_go_round(server, stream):
    port, client, openai_client = server
    kw = dict(model="tiny", max_tokens=200, tools=[WEATHER], tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and set(use.input) == {"city", "unit"}
    named = client.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.content[-1].name == "get_weather"
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                  "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "21 C"}]},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    again = client.messages.create(model="tiny", max_tokens=2, tools=[WEATHER], messages=history)
    chat = openai_client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 C"}, {"role": "user", "content": "And tomorrow?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}])
    assert read(again) == chat.usage.prompt_tokens and again.usage.cache_read_input_tokens > 0  # the call, saved


def test_errors_come_in_anthropics_shape(server):
    port, client, _ = server
    ask = [{"role": "user", "content": "hi"}]
    for body, words in (({"messages": ask}, "max_tokens"),
                        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "messages.0"),
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "image"),
                        ({"max_tokens": 4, "messages": ask, "tools": [{"type": "web_search_20250305",
                                                                       "name": "web_search"}]}, "tools.0"),
                        ({"max_tokens": 4, "messages": ask, "thinking": {"type": "sometimes"}}, "thinking.type"),
                        ({"max_tokens": 4, "messages": ask, "tool_choice": {"type": "all"}}, "tool_choice.type")):
        status, out = post(port, "/v1/messages", body)
        assert status == 400 and out["type"] == "error", (body, out)
        assert out["error"]["type"] == "invalid_request_error" and words in out["error"]["message"], (body, out)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}])


def test_a_thinking_models_thinking_is_its_own_block_and_x_api_key_is_a_key(tmp_path):
    """The template opens the think tags, so the tiny model's text is all thinking; `thinking: disabled` asks the
    template not to think (its enable_thinking)."""
    model = str(write_tiny_llama(tmp_path / "think.gguf", chat_template=OPENED, n_ctx_train=4096))
    with serving(model, slots=1, budget=128, app_kwargs={"api_key": "sesame"}) as (port, _):
        client = client_of(port, "sesame")
        ask = [{"role": "user", "content": "Think."}]
        m = client.messages.create(model="tiny", max_tokens=6, messages=ask, extra_body={"temperature": 0})
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
        events = list(client.messages.create(model="tiny", max_tokens=6, messages=ask, stream=True,
                                             extra_body={"temperature": 0}))
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas) == m.content[0].thinking
        quiet = client.messages.count_tokens(model="tiny", messages=ask, thinking={"type": "disabled"})
        assert quiet.input_tokens > read(m)  # the template's empty think block
        with pytest.raises(anthropic.AuthenticationError):
            client_of(port, "wrong").messages.create(model="tiny", max_tokens=1, messages=ask)
