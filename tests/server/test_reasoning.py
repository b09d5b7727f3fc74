"""A thinking model's reasoning apart from its answer, as llama-server gives it (`reasoning_content`, its default
"auto"; "none" leaves the answer as written) and as Ollama does (`think`, `message.thinking`); through `Llama`,
the OpenAI route and Ollama's, whole and streamed. The tiny model writes what a grammar tells it to."""
import json

import httpx
import ollama
import pytest

from h2o_local import Llama
from test_server import post, serving
from tiny_model import write_tiny_llama
from real_templates import pinned_templates
from tool_template import WEATHER

# Qwen3's shape, reduced: think tags, `enable_thinking`, calls as <tool_call> JSON
THINKING = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ (m.content or '').split('</think>')[-1].lstrip() }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{%- endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# DeepSeek-R1's distills: the generation prompt opens the tags, the answer starts inside them
OPENED = THINKING.replace("<|im_start|>assistant\n{%- if enable_thinking", "<|im_start|>assistant\n<think>\n{% if enable_thinking")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
WRITTEN = "<think>\nTwo and two, a < b.\n</think>\n\nIt is 4."


def forced(text):
    return 'root ::= ' + json.dumps(text)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("think") / "think.gguf", chat_template=THINKING,
                                n_ctx_train=4096))


@pytest.fixture(scope="module")
def opened_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("think") / "r1.gguf", chat_template=OPENED, n_ctx_train=4096))


@pytest.fixture(scope="module")
def llm(model):
    return Llama(model, budget=256, n_threads=1)


def test_llama_gives_the_reasoning_apart_when_asked_and_the_answer_as_written_by_default(llm):
    kw = dict(max_tokens=80, temperature=0, grammar=forced(WRITTEN))
    assert llm.create_chat_completion(ASK, **kw)["choices"][0]["message"] == {"role": "assistant", "content": WRITTEN}
    message = llm.create_chat_completion(ASK, reasoning_format="auto", **kw)["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "\nTwo and two, a < b.\n", "content": "It is 4."}
    deltas = [c["choices"][0]["delta"] for c in llm.create_chat_completion(ASK, stream=True, reasoning_format="auto", **kw)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    with pytest.raises(ValueError, match="reasoning_format"):
        llm.create_chat_completion(ASK, reasoning_format="sometimes", **kw)


def test_a_chat_session_streams_the_reasoning_apart_and_keeps_the_answer_as_written(llm, tmp_path):
    """`ChatSession.send_split`, what `h2o-local chat` shows: (reasoning, answer) pieces; the history keeps them apart
    (as a server's client sends an answer back), and the template drops the old reasoning at the next turn."""
    from h2o_local.chat_session import ChatSession

    session = ChatSession(llm, max_tokens=80, temperature=0, grammar=forced(WRITTEN))
    parts = list(session.send_split("What is 2 + 2?"))
    assert all(bool(thought) != bool(text) for thought, text in parts)
    assert "".join(p[0] for p in parts) == "\nTwo and two, a < b.\n" and "".join(p[1] for p in parts) == "It is 4."
    assert session.messages[-1] == {"role": "assistant", "content": "It is 4.",
                                    "reasoning_content": "\nTwo and two, a < b.\n"}
    saved = tmp_path / "chat.session"
    session.save(saved)
    again = ChatSession(llm)
    again.load(saved)  # a history with reasoning_content loads
    assert again.messages == session.messages
    list(session.send("And 3 + 3?", max_tokens=3, grammar=None))
    assert "Two and two" not in llm.detokenize(llm.chat_tokens(session.messages)[0]).decode()
    raw = ChatSession(llm, reasoning_format="none", max_tokens=80, temperature=0, grammar=forced(WRITTEN))
    parts = list(raw.send_split("What is 2 + 2?"))
    assert not any(thought for thought, _ in parts) and "".join(text for _, text in parts) == WRITTEN
    assert raw.messages[-1] == {"role": "assistant", "content": WRITTEN}
    quiet = ChatSession(llm, chat_template_kwargs={"enable_thinking": False}, max_tokens=1)
    list(quiet.send("Hi"))
    assert quiet.last.prompt_tokens > len(llm.chat_tokens([{"role": "user", "content": "Hi"}])[0])  # the empty block
    with pytest.raises(ValueError, match="reasoning_format"):
        ChatSession(llm, reasoning_format="sometimes")
    with pytest.raises(ValueError):
        ChatSession(llm, chat_template_kwargs={"add_generation_prompt": False})


def test_an_answer_that_starts_inside_the_tags_or_never_closes_them(opened_model):
    opened = Llama(opened_model, budget=256)
    assert opened.apply_chat_template(ASK).endswith("<think>\n")
    out = opened.create_chat_completion(ASK, reasoning_format="auto", max_tokens=40, temperature=0,
                                        grammar=forced("Sum it.\n</think>\nIt is 4."))["choices"][0]["message"]
    assert (out["reasoning_content"], out["content"]) == ("Sum it.\n", "It is 4.")
    cut = opened.create_chat_completion(ASK, reasoning_format="auto", max_tokens=5, temperature=0)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == "" and cut["message"]["reasoning_content"]


def test_the_server_splits_by_default_as_llama_server_and_a_call_follows_the_reasoning(model):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    with serving(model, slots=2, budget=256) as (port, client):
        kw = dict(model="tiny", messages=ASK, max_tokens=80, temperature=0, extra_body={"grammar": forced(WRITTEN)})
        message = client.chat.completions.create(**kw).choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == ("It is 4.", "\nTwo and two, a < b.\n")
        raw = client.chat.completions.create(**{**kw, "extra_body": {"grammar": forced(WRITTEN), "reasoning_format": "none"}})
        assert raw.choices[0].message.content == WRITTEN
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "\nTwo and two, a < b.\n"
        assert "".join(d.content or "" for d in deltas) == "It is 4."
        status, out = post(port, "/v1/chat/completions", {"messages": ASK, "reasoning_format": "maybe"})
        assert status == 400 and out["error"]["param"] == "reasoning_format"
        tooled = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=120,
                                                temperature=0, extra_body={"grammar": forced("<think>x</think>" + call)})
        message = tooled.choices[0].message
        assert message.model_extra["reasoning_content"] == "x" and message.tool_calls[0].function.name == "get_weather"
        # the reasoning goes back with the answer; the template drops it from the history
        history = ASK + [{"role": "assistant", "content": WRITTEN}, {"role": "user", "content": "And 3 + 3?"}]
        assert client.chat.completions.create(model="tiny", messages=history, max_tokens=2).choices[0].finish_reason


def test_ollama_thinks_as_told(opened_model):
    """A model whose prompt opens the tags (so that the tiny model's text is all reasoning): `think: true` gives it
    as `message.thinking`, `false` tells the template (Qwen3's enable_thinking), unset leaves the answer as written."""
    with serving(opened_model, slots=2, budget=256) as (port, _):
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        options = {"temperature": 0, "num_predict": 6}
        asked = client.chat(model="tiny", messages=ASK, think=True, options=options)
        unset = client.chat(model="tiny", messages=ASK, options=options)
        assert asked.message.thinking == unset.message.content and asked.message.content == ""
        assert unset.message.thinking is None
        quiet = client.chat(model="tiny", messages=ASK, think=False, options=options)
        assert quiet.prompt_eval_count > unset.prompt_eval_count  # the template's empty think block
        lines = list(client.chat(model="tiny", messages=ASK, think=True, options=options, stream=True))
        assert "".join(x.message.thinking or "" for x in lines) == asked.message.thinking
        assert "".join(x.message.content or "" for x in lines) == ""
        generated = client.generate(model="tiny", prompt="What is 2 + 2?", think=True, options=options)
        assert generated.thinking and generated.response == ""
        assert "thinking" in client.show("tiny").capabilities
        with pytest.raises(ollama.ResponseError, match="think"):
            client.chat(model="tiny", messages=ASK, think="high")


def test_think_tags_that_are_control_tokens_still_split_the_answer(tmp_path):
    """DeepSeek-R1's vocabulary has control tokens for its tags: the answer shows their text when the reasoning is
    split (preserved_tokens), so that the split finds them."""
    llm = Llama(str(write_tiny_llama(tmp_path / "ctl.gguf", chat_template=OPENED, n_ctx_train=4096,
                                     special_tokens=["<think>", "</think>"])), budget=256)
    close = llm.tokenize("</think>", add_bos=False, special=True)
    assert len(close) == 1 and llm.preserved_tokens(["</think>"]) == tuple(close)
    kw = dict(max_tokens=40, temperature=0, grammar=forced("Sum it.</think>It is 4."), logit_bias={close[0]: 30.0})
    assert "</think>" not in llm.create_chat_completion(ASK, **kw)["choices"][0]["message"]["content"]  # hidden
    message = llm.create_chat_completion(ASK, reasoning_format="auto", **kw)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Sum it.", "It is 4.")


REAL = pinned_templates()


@pytest.mark.skipif(not REAL, reason="the pinned llama.cpp sdist is not on this machine")
def test_gpt_oss_answers_come_apart_by_channel(tmp_path):
    """gpt-oss (OpenAI's Harmony format, its real template): the analysis channel is the reasoning, the final one the
    answer; its marks are control tokens, shown even with reasoning_format "none" (else the channels' names run
    into the text)."""
    marks = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
    llm = Llama(str(write_tiny_llama(tmp_path / "oss.gguf", chat_template=REAL["openai-gpt-oss-120b"],
                                     n_ctx_train=4096, special_tokens=marks)), budget=512)
    controls = [llm.tokenize(m, add_bos=False, special=True)[0] for m in marks[:4]]
    written = "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    kw = dict(max_tokens=120, temperature=0, grammar=forced(written), logit_bias={t: 30.0 for t in controls})
    assert llm.create_chat_completion(ASK, **kw)["choices"][0]["message"]["content"] == written
    message = llm.create_chat_completion(ASK, reasoning_format="auto", **kw)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and two.", "It is 4.")
    # the answer goes back as a message; the template writes its final channel
    assert "<|channel|>final<|message|>It is 4." in llm.apply_chat_template(ASK + [message], add_generation_prompt=False)
    # its calls: a message to functions.NAME, after its reasoning or forced
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Oslo", "unit": "c"}')
    thought_then_called = written.split("<|end|>")[0] + "<|end|>" + call
    tools_kw = dict(kw, tools=[WEATHER], reasoning_format="auto", max_tokens=200)
    message = llm.create_chat_completion(ASK, **{**tools_kw, "grammar": forced(thought_then_called)})["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two." and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Oslo", "unit": "c"})]
    forced_call = {k: v for k, v in tools_kw.items() if k not in ("grammar", "logit_bias")}
    (called,) = llm.create_chat_completion(ASK, tool_choice="required", **forced_call)["choices"][0]["message"]["tool_calls"]
    assert called["function"]["name"] == "get_weather" and set(json.loads(called["function"]["arguments"])) == {"city", "unit"}
    # Ollama's think levels are gpt-oss's reasoning effort, as its template reads it
    assert "Reasoning: low" in llm.apply_chat_template(ASK, chat_template_kwargs={"reasoning_effort": "low"})
    with serving(llm.model_path, slots=1, budget=512) as (port, _):
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        said = client.chat(model="oss", messages=ASK, think="low", options={"temperature": 0, "num_predict": 2})
        status, out = post(port, "/apply-template", {"messages": ASK, "chat_template_kwargs": {"reasoning_effort": "low"}})
        assert status == 200 and said.prompt_eval_count == len(llm.tokenize(out["prompt"], special=True))


@pytest.mark.skipif(not REAL, reason="the pinned llama.cpp sdist is not on this machine")
def test_gemma_4_thinks_when_asked_and_its_thought_channel_is_the_reasoning(tmp_path):
    """Gemma 4 (its real template) thinks only with `enable_thinking` (Ollama's `think: true` sets it); its reasoning
    is a `<|channel>thought` block closed by `<channel|>`, control tokens shown for the split; without thinking the
    prompt ends with an empty block and the answer is all content."""
    marks = ["<|channel>", "<channel|>", "<|turn>", "<turn|>", "<|think|>"]
    template = REAL["google-gemma-4-31B-it"]
    llm = Llama(str(write_tiny_llama(tmp_path / "gemma4.gguf", chat_template=template, n_ctx_train=4096,
                                     special_tokens=marks)), budget=512)
    on = {"enable_thinking": True}
    assert "<|think|>" in llm.apply_chat_template(ASK, chat_template_kwargs=on)
    assert llm.apply_chat_template(ASK).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    controls = [llm.tokenize(m, add_bos=False, special=True)[0] for m in marks[:2]]
    written = "<|channel>thought\nSum it.\n<channel|>It is 4."
    kw = dict(max_tokens=60, temperature=0, grammar=forced(written), logit_bias={t: 30.0 for t in controls})
    message = llm.create_chat_completion(ASK, reasoning_format="auto", chat_template_kwargs=on, **kw)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nSum it.\n", "It is 4.")
    plain = llm.create_chat_completion(ASK, reasoning_format="auto", max_tokens=20, temperature=0,
                                       grammar=forced("It is 4."))["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "It is 4."}
    with serving(llm.model_path, slots=1, budget=512) as (port, _):
        client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=60)
        options = {"temperature": 0, "num_predict": 2}
        thinking = client.chat(model="gemma4", messages=ASK, think=True, options=options)
        unset = client.chat(model="gemma4", messages=ASK, options=options)
        assert thinking.prompt_eval_count > unset.prompt_eval_count  # the system turn with <|think|>
        assert "thinking" in client.show("gemma4").capabilities
