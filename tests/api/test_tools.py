"""Tool calls in OpenAI's shape, through templates in each format `tool_formats` reads (Hermes / Qwen2.5's
`<tool_call>` JSON, Qwen3.5's `<function=...>` tags, GLM's `<arg_key>` pairs, Llama 3.1's bare JSON): forced calls
by a grammar, parsed calls, the round trip with a tool's result, streaming, and refusal where a template has no
format."""
import json

import numpy as np
import pytest

import openai

from h2o_local import Llama, SamplingParams, tool_formats
from h2o_local import tools as tools_mod
from h2o_local.chat_template import ChatTemplate
from h2o_local.server import create_app
from h2o_local.chat_template import PROBE_ARGUMENTS, PROBE_TOOL
from h2o_local.tools import parse_calls
from real_templates import pinned_templates
from tiny_model import write_tiny_llama
from tool_template import HERMES, TEMPLATES, WEATHER

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def model(request, tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tools") / f"{request.param}.gguf",
                                chat_template=TEMPLATES[request.param], n_ctx_train=4096))


def test_a_forced_call_follows_the_tools_schema(model):
    llm = Llama(model, budget=512, n_batch=64)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        for seed in range(3):
            out = llm.create_chat_completion(ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200,
                                             temperature=0.7, seed=seed)
            choice0 = out["choices"][0]
            assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
            (call,) = choice0["message"]["tool_calls"]
            assert call["type"] == "function" and call["id"].isascii() and len(call["id"]) >= 9 and \
                call["function"]["name"] in names
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
            else:
                assert set(args) == {"zone"} and isinstance(args["zone"], int)
    # the tools are described by the template; with "none" they are, and nothing is parsed or forced
    assert "get_weather" in llm.apply_chat_template(ASK, tools=[WEATHER])
    out = llm.create_chat_completion(ASK, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert "tool_calls" not in out["choices"][0]["message"]


def test_parsing_calls_out_of_text():
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": 2}'}
    assert parse_calls("no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_calls(broken) == (broken, [])
    for arguments in ('"not json"', "[1]", '"[1]"'):  # a call's arguments are an object (Ollama's and Anthropic's)
        odd = '<tool_call>{"name": "get_time", "arguments": %s}</tool_call>' % arguments
        assert parse_calls(odd, ["get_time"]) == (odd, [])
    assert json.loads(parse_calls('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": 1}"}</tool_call>')[1][0]
                      ["function"]["arguments"]) == {"zone": 1}  # JSON text of an object, as some models write
    # where <tool_call> is a control token (Qwen2.5) its text is not in the answer: bare calls of known tools count
    bare = '{"name": "get_time", "arguments": {"zone": 1}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    content, calls = parse_calls(bare, ["get_time", "get_weather"])
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert parse_calls('{"name": "other", "arguments": {}}', ["get_time"])[1] == []
    assert parse_calls(bare)[1] == []  # no tool names given: text stays text


def test_the_xml_formats_read_values_by_the_tools_schema():
    """In `<function=...>` / `<arg_key>` calls a value is text: a string parameter's as written (a number-like
    string stays a string), another's as JSON (text that is not JSON stays text)."""
    tools = [WEATHER, TIME]
    tags = ('Checking.\n<tool_call>\n<function=get_time>\n<parameter=zone>\n2\n</parameter>\n</function>\n</tool_call>'
            '<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=unit>\nc\n'
            '</parameter>\n</function>\n</tool_call>')
    content, calls = parse_calls(tags, tools, tool_formats.FunctionTags())
    assert content == "Checking." and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"zone": 2}, {"city": "007", "unit": "c"}]
    keys = "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>two</arg_value>\n</tool_call>"
    content, (call,) = parse_calls(keys, tools, tool_formats.ArgKeys())
    assert content is None and json.loads(call["function"]["arguments"]) == {"zone": "two"}
    assert parse_calls("<tool_call>\n<function=get_time>\n", tools, tool_formats.FunctionTags()) == \
        ("<tool_call>\n<function=get_time>\n", [])  # cut short: text


def test_mistrals_calls_follow_their_control_token_and_get_ids_its_templates_take():
    """[TOOL_CALLS] then a JSON list (Nemo) or NAME[ARGS]{...} (Small 3.2, with or without [CALL_ID]); the ids
    given are 9 letters and digits, as Mistral's templates demand of the history they are sent back in."""
    listed = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 2}, "id": "a1b2c3d4e"}, ' \
             '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}, "id": "f5g6h7i8j"}]'
    content, calls = parse_calls(listed, [WEATHER, TIME], tool_formats.MistralList())
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    args = 'Checking.[TOOL_CALLS]get_time[CALL_ID]x1y2z3w4v[ARGS]{"zone": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    content, calls = parse_calls(args, [WEATHER, TIME], tool_formats.MistralArgs())
    assert content == "Checking." and [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"zone": 2}, {"city": "Oslo"}]
    assert parse_calls("[TOOL_CALLS]get_time[ARGS]{\"zone", [TIME], tool_formats.MistralArgs())[1] == []


def test_a_bare_json_call_is_the_whole_answer_and_of_a_tool_given():
    """Llama 3.1's format: an answer that is one JSON object naming a tool given (after `<|python_tag|>`, if the
    model writes it) is a call; JSON that names no tool, or text around it, is an answer."""
    bare = tool_formats.BareJson()
    content, (call,) = parse_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}', [TIME], bare)
    assert content is None and json.loads(call["function"]["arguments"]) == {"zone": 2}
    for text in ('{"name": "get_date", "parameters": {}}', 'Sure: {"name": "get_time", "parameters": {"zone": 2}}',
                 '{"name": "get_time", "parameters": {"zone": 2}} and more', '{"name": "get_time", "param'):
        assert parse_calls(text, [TIME], bare) == (text, [])


def _accepts(llm, grammar, text):
    """Whether `grammar` lets the sampler write exactly `text` (the tiny model's vocabulary is bytes) and end."""
    sampler = llm.sampler(SamplingParams(temperature=0, grammar=grammar))
    tokens = llm.tokenize(text, add_bos=False, special=False)
    if llm.token_to_piece(tokens[0]) == b" ":
        tokens = tokens[1:]  # the tokenizer's own leading space (SentencePiece's word marker)
    for token in tokens + [llm.token_eos()]:
        logits = np.zeros(llm.n_vocab(), np.float32)
        logits[token] = 10.0
        if sampler.sample(logits) != token:
            return False
    return True


REAL = pinned_templates()


@pytest.mark.skipif(not REAL, reason="the pinned llama.cpp sdist is not on this machine")
def test_a_forced_call_is_written_as_each_real_template_writes_calls(tiny_model):
    """For every real template with a format (35 of the pinned llama.cpp's 70): the call its grammar forces is
    exactly the template's own rendering of that call (its wrapping tag, its line breaks), and nothing else: not a
    tool that was not given, not a call without a required parameter."""
    llm = Llama(tiny_model, budget=64)
    ask = [{"role": "user", "content": "Look the probe up."}]
    called = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "probe_tool", "arguments": PROBE_ARGUMENTS}}]}]
    checked = 0
    for name, source in sorted(REAL.items()):
        template = ChatTemplate(source)
        fmt = template.tool_format
        if fmt is None:
            continue
        described = template.render(ask, tools=[PROBE_TOOL])
        written = template.render(called, add_generation_prompt=False, tools=[PROBE_TOOL])
        written = written[len(described):] if written.startswith(described) else written
        start, end = [f[:2] for f in fmt.find(written, [PROBE_TOOL]) if f[2] == "probe_tool"][-1]
        grammar = fmt.grammar([PROBE_TOOL])
        assert _accepts(llm, grammar, written[start:end]), name
        assert not _accepts(llm, grammar, written[start:end].replace("probe_tool", "probe_tooo")), name
        assert not _accepts(llm, grammar, written[start:end].replace("probe_arg", "probe_arh")), name
        checked += 1
    assert checked >= 35


def test_bad_tools_and_choices_are_refused(model):
    llm = Llama(model, budget=64)
    for tools, choice in (([{"type": "function", "function": {}}], None), ([WEATHER], "sometimes"),
                          ([WEATHER], {"type": "function", "function": {"name": "other"}}), (None, "required")):
        with pytest.raises(ValueError):
            llm.create_chat_completion(ASK, tools=tools, tool_choice=choice, max_tokens=2)
    with pytest.raises(ValueError, match="not several"):
        llm.create_chat_completion(ASK, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})


def test_the_official_client_round_trip_and_streaming(model):
    from h2o_local.server import serve_in_background

    llm = Llama(model, budget=512, n_seq_max=1, kv_unified=False, keep="system", n_threads=1)
    with serve_in_background(create_app(llm, model_id="hermes")) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        first = client.chat.completions.create(model="hermes", messages=ASK, tools=[WEATHER], tool_choice="required",
                                               max_tokens=200, temperature=0)
        assert first.choices[0].finish_reason == "tool_calls"
        call = first.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
        # the call and the tool's result go back; the template renders both and the model answers
        history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'}]
        second = client.chat.completions.create(model="hermes", messages=history, tools=[WEATHER], max_tokens=6,
                                                temperature=0)
        assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
        assert '{"temperature": 3}' in llm.apply_chat_template(history, tools=[WEATHER])
        stream = client.chat.completions.create(model="hermes", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                max_tokens=200, temperature=0, stream=True)
        chunks = list(stream)
        deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert deltas and deltas[0][0].function.name == "get_weather"
        assert json.loads(deltas[0][0].function.arguments) == json.loads(call.function.arguments)  # greedy: the same
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="hermes", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           response_format={"type": "json_object"})


def test_a_calls_logprobs_come_whole_or_streamed(model):
    """A call's answer is parsed whole, then streamed: its tokens' logprobs come with the first piece after the role."""
    llm = Llama(model, budget=512, n_batch=64)
    kwargs = dict(tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0, logprobs=True, top_logprobs=1)
    whole = llm.create_chat_completion(ASK, **kwargs)
    content = whole["choices"][0]["logprobs"]["content"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and len(content) == whole["usage"]["completion_tokens"]
    chunks = list(llm.create_chat_completion(ASK, stream=True, **kwargs))
    carried = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert carried == [whole["choices"][0]["logprobs"]] and chunks[1]["choices"][0]["logprobs"] == carried[0]


@pytest.mark.parametrize("fmt", ["json", "arg-keys"])
def test_markup_that_is_a_control_token_is_shown_so_that_the_call_is_read(tmp_path, fmt):
    """Where the vocabulary has control tokens for a format's tags (GLM's <arg_key>, Qwen's <tool_call>), an answer
    does not show their text, and the call could not be read: a chat keeps them shown (llama-server's
    preserved_tokens)."""
    from h2o_local import tools as tools_mod

    tags = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
    llm = Llama(str(write_tiny_llama(tmp_path / "ctl.gguf", chat_template=TEMPLATES[fmt], n_ctx_train=4096,
                                     special_tokens=tags)), budget=512, n_batch=64)
    plan = tools_mod.plan(llm.chat_template, [WEATHER], "required")
    controls = llm.preserved_tokens(plan.format.tags)
    assert set(controls) == {llm.tokenize(t, add_bos=False, special=True)[0] for t in plan.format.tags}
    prefer = {"max_tokens": 200, "temperature": 0, "logit_bias": {t: 30.0 for t in controls}}  # as a trained model
    tokens, _ = llm.chat_tokens(ASK, tools=plan.tools)
    hidden = "".join(e.text for e in llm.generate_events(tokens, grammar=plan.grammar, **prefer))
    assert "<tool_call>" not in hidden  # the grammar wrote the control token; its text is not shown
    out = llm.create_chat_completion(ASK, tools=[WEATHER], tool_choice="required", **prefer)
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


def test_kimi_calls_are_read_with_their_section_marks():
    kimi = tool_formats.KimiCalls()
    text = ('Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>'
            '{"zone": 2}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
            '{"city": "Oslo", "unit": "c"}<|tool_call_end|><|tool_calls_section_end|>')
    content, calls = parse_calls(text, [WEATHER, TIME], kimi)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    broken = "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{not json"
    assert parse_calls(broken, [TIME], kimi) == (broken, [])


def test_gemma_4_calls_are_read_in_its_own_notation():
    """Gemma 4 writes arguments in a notation of its own: keys bare and sorted, strings between <|"|> marks, None
    for null; they come back as JSON. Text that is not a whole call stays text."""
    gemma = tool_formats.GemmaCalls()
    text = ('Sure.<|tool_call>call:get_time{deep:{a:[1,<|"|>x, y<|"|>,true,None],b:-2.5e-3},zone:2}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,unit:<|"|>c<|"|>}<tool_call|>')
    content, calls = parse_calls(text, [WEATHER, TIME], gemma)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"deep": {"a": [1, "x, y", True, None], "b": -0.0025},
                                                             "zone": 2}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    for broken in ('<|tool_call>call:get_time{zone:2', '<|tool_call>call:get_time{zone 2}<tool_call|>',
                   '<|tool_call>call:get_time{city:<|"|>Oslo}<tool_call|>'):
        assert parse_calls(broken, [TIME], gemma) == (broken, [])


@pytest.mark.skipif(not REAL, reason="the pinned llama.cpp sdist is not on this machine")
def test_gemma_4_forced_calls_follow_the_schema_in_its_notation(tmp_path):
    """Gemma 4's real template, its marks as control tokens (shown so that the call is read): a forced call is
    written in its notation, the properties in its order, the required ones present, each value of its type."""
    marks = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|turn>", "<turn|>", "<|channel>", "<channel|>"]
    llm = Llama(str(write_tiny_llama(tmp_path / "gemma4.gguf", chat_template=REAL["google-gemma-4-31B-it"],
                                     n_ctx_train=4096, special_tokens=marks)), budget=512, n_batch=64)
    assert isinstance(llm.chat_template.tool_format, tool_formats.GemmaCalls)
    rich = {"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object", "properties": {
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "nights": {"type": "integer"}, "budget": {"type": "number"}, "rail": {"type": "boolean"},
        "Class": {"type": "string", "enum": ["first", "second"]},
        "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["stops", "nights", "Class"]}}}
    controls = llm.preserved_tokens(marks[:3])
    assert len(controls) == 3
    for seed in range(3):
        for tools, choice in (([WEATHER, TIME], "required"), ([rich], {"type": "function", "function": {"name": "plan_trip"}})):
            out = llm.create_chat_completion(ASK, tools=tools, tool_choice=choice, max_tokens=300, temperature=0.7,
                                             seed=seed, logit_bias={t: 3.0 for t in controls})
            (call,) = out["choices"][0]["message"]["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
            elif call["function"]["name"] == "get_time":
                assert set(args) == {"zone"} and isinstance(args["zone"], int)
            else:
                assert {"stops", "nights", "Class"} <= set(args) <= set(rich["function"]["parameters"]["properties"])
                assert all(isinstance(x, str) for x in args["stops"]) and isinstance(args["nights"], int)
                assert args["Class"] in ("first", "second") and isinstance(args.get("rail", True), bool)
    # thinking, then a call: the thought channel is the reasoning, the call is read from the rest
    written = ('<|channel>thought\nCheck.\n<channel|><|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,'
               'unit:<|"|>c<|"|>}<tool_call|>')
    out = llm.create_chat_completion(ASK, tools=[WEATHER], reasoning_format="auto", max_tokens=100, temperature=0,
                                     chat_template_kwargs={"enable_thinking": True}, grammar=f"root ::= {json.dumps(written)}",
                                     logit_bias={t: 30.0 for t in llm.preserved_tokens(marks)})
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == "\nCheck.\n" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}


@pytest.mark.parametrize("fmt", tool_formats.FORMATS, ids=lambda f: f.name)
def test_a_call_nested_deeper_than_python_reads_is_text_not_an_error(fmt):
    """A model can be made to write any nesting (a client's grammar): arguments nested past Python's recursion limit
    are no call, and the answer comes back as text rather than as an error."""
    deep = "[" * 50000 + "]" * 50000
    texts = {"json": '<tool_call>{"name": "x", "arguments": {"a": %s}}</tool_call>',
             "function-tags": "<tool_call>\n<function=x>\n<parameter=a>\n%s\n</parameter>\n</function>\n</tool_call>",
             "arg-keys": "<tool_call>x<arg_key>a</arg_key><arg_value>%s</arg_value></tool_call>",
             "bare-json": '{"name": "x", "parameters": {"a": %s}}',
             "mistral-list": '[TOOL_CALLS][{"name": "x", "arguments": {"a": %s}, "id": "abcdefghi"}]',
             "mistral-args": '[TOOL_CALLS]x[ARGS]{"a": %s}',
             "harmony": "<|channel|>commentary to=functions.x <|constrain|>json<|message|>{\"a\": %s}",
             "gemma": "<|tool_call>call:x{a:%s}<tool_call|>",
             "kimi": '<|tool_calls_section_begin|><|tool_call_begin|>functions.x:0<|tool_call_argument_begin|>{"a": %s}'}
    text = texts[fmt.name] % deep
    content, calls = parse_calls(text, ["x"], fmt)
    assert all(json.loads(c["function"]["arguments"]) != {"a": []} for c in calls)
    if fmt.name not in ("function-tags", "arg-keys"):  # the XML formats keep such a value as its text
        assert (content, calls) == (text, [])


HOSTILE = {"json": ["<tool_call>" * 20000, "<tool_call>x" + " " * 200000, "<tool_call>" * 20000 + "</tool_call>"],
           "function-tags": ["<function=x>" * 20000, "<function=" + "a" * 200000,
                             "<function=x>" + "<parameter=a>" * 15000 + "</parameter></function>"],
           "arg-keys": ["<tool_call>x<arg_key>a</arg_key><arg_value>" * 5000,
                        "<tool_call>x" + "<arg_key>" * 20000 + "</arg_value></tool_call>",
                        "<tool_call>x" + "<arg_key>a</arg_key><arg_value>v</arg_value>junk" * 4000 + "</tool_call>"],
           "bare-json": ["{" * 200000],
           "mistral-list": ["[TOOL_CALLS][" * 15000],
           "mistral-args": ["[TOOL_CALLS]x[ARGS]" * 10000],
           "harmony": ["[" * 200000, "to=functions.x " * 13000],
           "gemma": ["<|tool_call>call:x{" * 10000, '<|tool_call>call:x{a:<|"|>' * 8000,
                     "<|tool_call>call:x{}<tool_call|> " * 6000],
           "kimi": ["<|tool_call_begin|>functions.x:0<|tool_call_argument_begin|>{" * 4000,
                    "<|tool_call_begin|>" * 10000, "<|tool_calls_section_begin|>" + " " * 200000]}


@pytest.mark.parametrize("fmt", tool_formats.FORMATS, ids=lambda f: f.name)
def test_an_answer_made_to_defeat_the_reader_is_read_in_linear_time(fmt):
    """A client's grammar can make a model write any text: 200 k characters of openings without closings, of
    recipients without messages, took 3 to 42 s and more to read (the lazy patterns scanned the rest of the
    answer once per opening), time in which a server read nothing else. Now each is read at once; a bound far above
    a linear reader's time (milliseconds) and far below what a scan per opening takes (tens of seconds)."""
    import time

    for text in HOSTILE[fmt.name]:
        started = time.perf_counter()
        parse_calls(text, ["x"], fmt)
        assert time.perf_counter() - started < 3.0, text[:40]


LONG_CALLS = {"json": '<tool_call>{"name": "x", "arguments": %s}</tool_call>',
              "mistral-list": '[TOOL_CALLS][{"name": "x", "arguments": %s, "id": "abcdefghi"}]',
              "mistral-args": "[TOOL_CALLS]x[ARGS]%s",
              "harmony": "<|channel|>commentary to=functions.x <|constrain|>json<|message|>%s"}


@pytest.mark.parametrize("fmt", [f for f in tool_formats.FORMATS if f.name in LONG_CALLS], ids=lambda f: f.name)
def test_a_call_longer_than_the_readers_first_window_is_read_whole(fmt):
    """The JSON reader starts with a window of a few thousand characters and widens it while a value may go on past
    it: a call whose arguments hold strings of thousands of characters with escapes in them and a number of 4,200
    digits comes back whole."""
    arguments = {"text": "x" * 4085 + "\u00e9\n" + "y" * 20000, "n": int("7" * 4200)}
    content, calls = parse_calls(LONG_CALLS[fmt.name] % json.dumps(arguments), ["x"], fmt)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [arguments]


def test_a_template_without_a_call_format_gets_llama_servers_generic_json(tiny_model):
    """SmolLM2's ChatML names no tools: the tools are described in the system message and every answer is one JSON
    object, a call or a response, as llama-server's generic format (its grammar forces it)."""
    chatml = Llama(tiny_model, budget=64, chat_template="chatml", n_threads=1)
    plan = tools_mod.plan(chatml.chat_template, [WEATHER], "auto")
    assert plan.format.name == "generic" and plan.template_tools is None
    messages = plan.messages(ASK)
    assert messages[0]["content"].startswith("You help.\n\nYou can call any of the following tools")
    assert '"get_weather"' in messages[0]["content"] and "Respond in JSON format" in messages[0]["content"]
    assert [m["role"] for m in plan.messages(ASK[1:])] == ["system", "user"]  # one is added where there is none
    forced = chatml.create_chat_completion(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200,
                                           temperature=0)
    (call,) = forced["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert forced["choices"][0]["finish_reason"] == "tool_calls"
    content, calls = plan.parse('{"response": "It is sunny."}')
    assert (content, calls) == ("It is sunny.", [])
    content, calls = plan.parse('{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    history = plan.messages([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}])
    assert json.loads(history[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert json.loads(history[4]["content"]) == {"response": "Sunny."}
