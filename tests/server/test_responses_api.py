"""OpenAI's Responses API (`POST /v1/responses`) through the official client: text and message inputs, the
response object, its events streamed (and the client's own stream helper), function tools and the round trip of a
call's output, structured output, a thinking model's reasoning item, and what a stateless server refuses."""
import json

import openai
import pytest

from test_reasoning import OPENED
from test_server import CHATML, post, serving
from tiny_model import write_tiny_llama
from tool_template import HERMES

SAID = 'root ::= "All well."'
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("resp") / "tools.gguf", chat_template=HERMES,
                                 n_ctx_train=4096))
    with serving(model, slots=2, budget=256) as s:
        yield s


def test_a_text_input_gets_a_response_object_as_openai_gives_it(server):
    port, client = server
    r = client.responses.create(model="tiny", input="How are you?", temperature=0, extra_body={"grammar": SAID})
    assert (r.object, r.status, r.output_text, r.model) == ("response", "completed", "All well.", "tiny")
    assert r.id.startswith("resp_") and [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "How are you?"}],
                                          temperature=0, extra_body={"grammar": SAID})
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = client.responses.create(model="tiny", input="How are you?", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and not r.store


def test_instructions_and_message_items_are_the_chat_s_messages(server):
    port, client = server
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi. "}, {"type": "input_text", "text": "Go."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Going."}]},
             {"role": "user", "content": "Faster."}]
    r = client.responses.create(model="tiny", instructions="Be brief.", input=items, max_output_tokens=2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi. Go."},
                {"role": "assistant", "content": "Going."}, {"role": "user", "content": "Faster."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_response_comes_as_its_events(server):
    port, client = server
    events = list(client.responses.create(model="tiny", input="How are you?", temperature=0, stream=True,
                                          extra_body={"grammar": SAID}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == "All well."
    with client.responses.stream(model="tiny", input="How are you?", temperature=0,
                                 extra_body={"grammar": SAID}) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == "All well."
        assert stream.get_final_response().output_text == "All well."


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_output_go_round(server, stream):
    port, client = server
    kw = dict(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", temperature=0,
              max_output_tokens=200)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and set(json.loads(call.arguments)) == {"city", "unit"}
    forced = {"type": "function", "name": "get_weather"}
    assert client.responses.create(**{**kw, "tool_choice": forced}).output[-1].name == "get_weather"
    again = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=2, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert again.usage.input_tokens > r.usage.input_tokens  # the call and its output were read
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                                   if k != "type"}}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_shapes_the_text(server):
    port, client = server
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A number?", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "number", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["n"], int)


def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(server):
    port, client = server
    for extra, param in ((dict(previous_response_id="resp_1"), "previous_response_id"),
                         (dict(background=True), "background"),
                         (dict(tools=[{"type": "web_search"}]), "tools.0"),
                         (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                          "input.0.content.0"),
                         (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input.0.type"),
                         (dict(input=[{"role": "robot", "content": "x"}]), "input.0.role"),
                         (dict(text={"format": {"type": "yaml"}}), "text.format"),
                         (dict(max_output_tokens=0), "max_output_tokens"), (dict(input=[]), "input"),
                         (dict(top_logprobs=3), "top_logprobs")):
        status, out = post(port, "/v1/responses", {"model": "tiny", "input": "hi", **extra})
        assert status == 400 and out["error"]["param"] == param, (extra, out)
    status, out = post(port, "/v1/responses", {"model": "tiny", "input": "hi", "store": True, "metadata": {"a": "b"},
                                               "max_output_tokens": 1})
    assert status == 200 and out["store"] is False and out["metadata"] == {"a": "b"}


def test_a_thinking_models_reasoning_is_its_own_item(tmp_path):
    """The template opens the think tags, so the tiny model's text is all reasoning."""
    model = str(write_tiny_llama(tmp_path / "think.gguf", chat_template=OPENED, n_ctx_train=4096))
    with serving(model, slots=1, budget=128) as (port, client):
        r = client.responses.create(model="tiny", input="Think.", max_output_tokens=6, temperature=0)
        assert [item.type for item in r.output] == ["reasoning"] and r.output[0].content[0].text
        events = list(client.responses.create(model="tiny", input="Think.", max_output_tokens=6, temperature=0,
                                              stream=True))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == r.output[0].content[0].text and events[-1].type == "response.incomplete"
    plain = str(write_tiny_llama(tmp_path / "plain.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(plain, slots=1, budget=128) as (port, client):
        assert [i.type for i in client.responses.create(model="tiny", input="Hi", max_output_tokens=2).output] == \
            ["message"]
