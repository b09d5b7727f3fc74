"""Chat templates: the GGUF's Jinja template rendered with jinja2, llama.cpp's built-ins as the fallback."""
import json

import pytest

from h2o_local import Llama
from h2o_local import tool_formats, tools as tools_mod
from h2o_local.chat_template import ChatTemplate, normalize_messages
from tiny_model import write_tiny_llama
from engine_view import builtin_template
from real_templates import pinned_templates

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("t") / "bare.gguf", n_ctx_train=1024))


@pytest.mark.slow
def test_the_gguf_template_renders_as_llama_cpp_renders_it(smol_model):
    llm = Llama(smol_model, policy="h2o", budget=64)
    assert llm.chat_template.is_jinja
    for messages in (CONVERSATION, CONVERSATION[:2]):
        pairs = [(m["role"], m["content"]) for m in messages]
        for agp in (True, False):
            assert llm.apply_chat_template(messages, agp) == builtin_template(llm, pairs, agp, "")
    # without a system message the model's own template adds its default one, which llama.cpp's built-in leaves out
    jinja = llm.apply_chat_template(CONVERSATION[1:])
    builtin = builtin_template(llm, [(m["role"], m["content"]) for m in CONVERSATION[1:]], True, "")
    assert jinja.startswith("<|im_start|>system\nYou are a helpful AI assistant") and jinja.endswith(builtin)


def test_openai_message_forms():
    msgs = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                               {"role": "assistant", "content": None, "name": "bot"}])
    assert msgs == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"}]
    named = ChatTemplate("{% for m in messages %}{{ m.name or m.role }}: {{ m.content }}\n{% endfor %}")
    assert named.render([{"role": "user", "name": "ann", "content": "hi"}]) == "ann: hi\n"
    for bad, error in ((["hi"], TypeError), ([{"content": "x"}], ValueError), ([{"role": "user"}], ValueError),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ValueError),
                       ([{"role": "user", "content": [{"type": "text"}]}], ValueError),
                       ([{"role": "user", "content": 3}], TypeError), ("hi", TypeError)):
        with pytest.raises(error):
            named.render(bad)
    with pytest.raises(ValueError, match="needs 'text'"):
        named.render([{"role": "user", "content": [{"type": "text", "text": None}]}])


def test_a_template_given_by_the_user(bare_model):
    jinja = Llama(bare_model, policy="h2o", budget=16, chat_template=CHATML)
    builtin = Llama(bare_model, policy="h2o", budget=16, chat_template="chatml")  # a llama.cpp built-in, by name
    assert jinja.apply_chat_template(CONVERSATION) == builtin.apply_chat_template(CONVERSATION)
    assert jinja.apply_chat_template(CONVERSATION).endswith("<|im_start|>assistant\n")
    out = jinja.create_chat_completion(CONVERSATION, max_tokens=3)
    assert out["usage"]["prompt_tokens"] == len(jinja.chat_tokens(CONVERSATION)[0])
    # a name llama.cpp does not know is named, with the names it knows (not "this model's template")
    with pytest.raises(ValueError, match="'chatmll' is not a chat template llama.cpp knows: .*chatml, .*llama3"):
        Llama(bare_model, policy="h2o", budget=16, chat_template="chatmll").apply_chat_template(CONVERSATION)


def test_no_template_is_a_clear_error(bare_model):
    llm = Llama(bare_model, policy="h2o", budget=16)
    with pytest.raises(ValueError, match="no chat template"):
        llm.create_chat_completion(CONVERSATION)
    assert llm.generate("still usable", max_tokens=2, temperature=0) is not None
    with pytest.raises(TypeError):
        Llama(bare_model, policy="h2o", budget=16, chat_template=42)


def test_a_template_that_rejects_the_messages_says_so():
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}ok")
    with pytest.raises(ValueError, match="must start with user"):
        strict.render(CONVERSATION[2:])
    assert strict.render(CONVERSATION[1:]) == "ok"


def test_a_gguf_template_jinja_cannot_render_falls_back_to_llama_cpp(bare_model, tmp_path):
    # a template jinja2 cannot parse but llama.cpp recognises (it contains ChatML's markers), shipped in the GGUF
    broken = CHATML.replace("{% endfor %}", "{% endfor %}{% bogus_tag %}")
    llm = Llama(str(write_tiny_llama(tmp_path / "broken.gguf", chat_template=broken)), policy="h2o", budget=16)
    assert not llm.chat_template.is_jinja and "bogus_tag" in llm.chat_template.jinja_error
    assert llm.apply_chat_template(CONVERSATION) == Llama(bare_model, policy="h2o", budget=16, chat_template="chatml").apply_chat_template(CONVERSATION)


def test_a_template_given_by_the_user_that_does_not_render_is_an_error_not_a_guess(bare_model):
    broken = CHATML.replace("{% endfor %}", "{% endfor %}{% bogus_tag %}")
    for source in (broken, "{% nonsense %}", CHATML.replace("m['content']", "m['content'] | no_such_filter")):
        with pytest.raises(ValueError, match="chat template given does not render"):
            Llama(bare_model, policy="h2o", budget=16, chat_template=source).apply_chat_template(CONVERSATION)


def test_a_template_that_writes_the_bos_does_not_get_a_second_one(tmp_path):
    model = str(write_tiny_llama(tmp_path / "bos.gguf", chat_template="{{ bos_token }}" + CHATML))
    llm = Llama(model, policy="h2o", budget=16)
    tokens, _ = llm.chat_tokens(CONVERSATION)
    assert tokens[0] == llm.token_bos() and tokens[1] != llm.token_bos()
    assert llm.apply_chat_template(CONVERSATION).startswith(llm.detokenize([llm.token_bos()], special=True).decode())


def test_llama_cpp_pythons_chat_format_names_a_built_in_template(tiny_model):
    """`chat_format=` as llama-cpp-python takes it: its names, llama.cpp's where they differ; a name that is no
    template is refused when the Llama is made."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    for name, same_as in (("qwen", "chatml"), ("llama-2", "llama2-sys"), ("llama-3", "llama3"), ("gemma", "gemma")):
        assert Llama(tiny_model, budget=16, chat_format=name).apply_chat_template(messages) == \
            Llama(tiny_model, budget=16, chat_template=same_as).apply_chat_template(messages)
    assert Llama(tiny_model, budget=16, chat_format="qwen").apply_chat_template(messages).startswith("<|im_start|>system")
    with pytest.raises(ValueError, match="not a chat template"):
        Llama(tiny_model, budget=16, chat_format="nonsense")
    with pytest.raises(ValueError, match="not both"):
        Llama(tiny_model, budget=16, chat_format="qwen", chat_template="chatml")


# ------------------------------------------------------------------ the real templates llama.cpp tests itself with
REAL = pinned_templates()
needs_real = pytest.mark.skipif(not REAL, reason="the pinned llama.cpp sdist is not on this machine")
# Fireworks' template reads a `functions` variable that only Fireworks' own server passes
NEEDS_ITS_OWN_SERVER = {"fireworks-ai-llama-3-firefunction-v2"}


def _in_order(text, contents):
    at = 0
    for c in contents:
        found = text.find(c, at)
        if found < 0:
            return False
        at = found + len(c)
    return True


@needs_real
@pytest.mark.parametrize("name", sorted(REAL))
def test_every_real_template_writes_every_message_in_order(name):
    """Loop controls (`{% break %}`), Hugging Face's `{% generation %}`, `tojson(ensure_ascii=False)`, lists a
    template builds itself: whatever 70 families' templates use, each message's content is in the prompt, the turns
    in order, the system message's too (where the template takes no system role, in the user's turn; Mistral's put
    it in the last one)."""
    template = ChatTemplate(REAL[name], bos_token="<s>", eos_token="</s>")
    assert template.is_jinja, template.jinja_error
    for messages in (CONVERSATION[1:2], CONVERSATION[:2], CONVERSATION):
        if name in NEEDS_ITS_OWN_SERVER:
            with pytest.raises(ValueError, match="'functions' is undefined"):
                template.render(messages)
            continue
        text = template.render(messages)
        assert _in_order(text, [m["content"] for m in messages if m["role"] != "system"]), text
        assert all(m["content"] in text for m in messages), text


@needs_real
def test_a_template_without_a_system_role_gets_the_system_message_in_the_users_turn():
    """Gemma 2 refuses a system message (raise_exception): as llama.cpp and Ollama do, it is written at the start of
    the first user message; a system message alone is the user's."""
    gemma = ChatTemplate(REAL["google-gemma-2-2b-it"], bos_token="<bos>")
    assert not gemma.supports_system_role
    assert gemma.render(CONVERSATION) == gemma.render([{"role": "user", "content": "Be brief.\nHi"}] + CONVERSATION[2:])
    assert gemma.render(CONVERSATION[:1]) == gemma.render([{"role": "user", "content": "Be brief."}])
    assert ChatTemplate(REAL["Qwen-Qwen2.5-7B-Instruct"]).supports_system_role


def test_the_developer_role_is_the_system_role_unless_the_template_knows_it():
    """OpenAI's newer clients send "developer" for system instructions; llama.cpp reads it as "system"."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate(CHATML).render(messages).startswith("<|im_start|>system\nBe brief.")
    knows = ChatTemplate(CHATML.replace("{% for", "{# developer #}{% for"))
    assert knows.render(messages).startswith("<|im_start|>developer\nBe brief.")


def test_json_in_a_prompt_is_written_as_json_not_escaped_for_html():
    """jinja2's own tojson writes <, > and & as \\u003c ...; the prompt gets them as the model saw them in
    training (Hugging Face's tojson, with its keywords)."""
    template = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(ensure_ascii=False, indent=1) }}|"
                            "{{ tools | map(attribute='name') | tojson }}|{{ '[1]' | from_json | length }}")
    tools = [{"name": "cmp", "description": "a < b && c > 'd' é"}]
    text = template.render([{"role": "user", "content": "hi"}], tools=tools)
    assert text == (json.dumps(tools, ensure_ascii=False) + "|" + json.dumps(tools, ensure_ascii=False, indent=1)
                    + '|["cmp"]|1')


def test_a_template_cannot_change_the_callers_messages_or_loop_past_its_time_limit():
    grows = ChatTemplate("{% set ns = namespace(l=[1]) %}{% for x in ns.l %}{% set _ = ns.l.append(x) %}{% endfor %}")
    with pytest.raises(ValueError, match="time limit"):
        grows.render([{"role": "user", "content": "hi"}], time_limit_s=0.2)
    messages = [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]
    ChatTemplate("{% set _ = messages[0].tool_calls.append(1) %}{{ messages[0].tool_calls | length }}").render(messages)
    assert len(messages[0]["tool_calls"]) == 1


@needs_real
def test_tools_go_to_the_templates_whose_calls_are_read_back():
    """A template takes tools when it describes them and writes a call in a format `tool_formats` reads back, found
    by rendering a probe call: `<tool_call>` JSON (Hermes, Qwen2.5, Qwen3), `<function=...>` tags (Qwen3-Coder,
    Qwen3.5, Seed-OSS with its own wrapping tag), `<arg_key>` pairs (GLM 4.6 with line breaks, 4.7 without), the
    bare JSON answer (Llama 3.1-3.3), Mistral's `[TOOL_CALLS]` list (Nemo) or `[ARGS]` (Small 3.2 with its
    `[CALL_ID]`, Devstral without), gpt-oss's messages to `functions.NAME`, Gemma 4's notation, Kimi K2's
    sections. Other formats (DeepSeek's) are refused, not misread."""
    formats = {name: ChatTemplate(source).tool_format for name, source in REAL.items()}
    named = {name: fmt.name for name, fmt in formats.items() if fmt is not None}
    assert {named[n] for n in ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
                               "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use")} == {"json"}
    assert {named[n] for n in ("Qwen3-Coder", "Qwen3.5-4B", "ByteDance-Seed-OSS")} == {"function-tags"}
    assert {named[n] for n in ("GLM-4.6", "GLM-4.7-Flash")} == {"arg-keys"}
    assert {named[n] for n in ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
                               "meta-llama-Llama-3.3-70B-Instruct")} == {"bare-json"}
    assert formats["ByteDance-Seed-OSS"] == tool_formats.FunctionTags(open="<seed:tool_call>", lines=False)
    assert formats["GLM-4.6"].lines and not formats["GLM-4.7-Flash"].lines
    assert named["mistralai-Mistral-Nemo-Instruct-2407"] == "mistral-list"
    assert formats["Mistral-Small-3.2-24B-Instruct-2506"] == tool_formats.MistralArgs(call_id=True)
    assert formats["unsloth-mistral-Devstral-Small-2507"] == tool_formats.MistralArgs(call_id=False)
    assert named["openai-gpt-oss-120b"] == "harmony"
    assert {named[n] for n in ("google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved")} == {"gemma"}
    assert {named[n] for n in ("moonshotai-Kimi-K2", "Kimi-K2-Instruct", "Kimi-K2-Thinking")} == {"kimi"}
    assert not named.keys() & {"deepseek-ai-DeepSeek-V3.1", "HuggingFaceTB-SmolLM3-3B"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert tools_mod.plan(ChatTemplate(REAL["deepseek-ai-DeepSeek-V3.1"]), [tool], "auto").format.name == "generic"
    assert tools_mod.plan(ChatTemplate(REAL["Qwen3.5-4B"]), [tool], "auto").format.name == "function-tags"


@needs_real
def test_a_calls_arguments_reach_the_template_in_the_form_it_takes():
    """OpenAI sends a call's arguments as JSON text, Ollama and Hugging Face as an object: each template gets the
    form it reads (probed, as llama.cpp does), so either gives the same prompt."""
    def history(arguments):
        return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call00001", "content": "3 C"}, {"role": "user", "content": "Thanks"}]
    for name, takes_objects in (("Qwen3.5-4B", True), ("GLM-4.6", True), ("meta-llama-Llama-3.1-8B-Instruct", True),
                                ("meetkai-functionary-medium-v3.2", False)):
        template = ChatTemplate(REAL[name])
        assert template.takes_object_arguments == takes_objects, name
        text = template.render(history('{"city": "Oslo"}'))
        assert text == template.render(history({"city": "Oslo"})) and "Oslo" in text and "{'city'" not in text


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_the_renderers_own():
    """llama-server's and vLLM's `chat_template_kwargs`: Qwen3's `enable_thinking`, say."""
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                            "{{ messages[0].content }}")
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi, variables={"enable_thinking": False}) == "/no_think hi"
    assert template.render(hi) == template.render(hi, variables={"enable_thinking": True}) == "hi"
    for bad, error in (({"messages": []}, ValueError), ({"not a name": 1}, ValueError), ([("a", 1)], TypeError)):
        with pytest.raises(error, match="chat_template_kwargs"):
            template.render(hi, variables=bad)


@needs_real
def test_qwen3_thinks_or_not_as_chat_template_kwargs_say(tiny_model):
    llm = Llama(tiny_model, budget=64, chat_template=REAL["Qwen-Qwen3-0.6B"])
    hi = [{"role": "user", "content": "hi"}]
    quiet = llm.apply_chat_template(hi, chat_template_kwargs={"enable_thinking": False})
    assert quiet.endswith("<think>\n\n</think>\n\n") and not llm.apply_chat_template(hi).endswith("</think>\n\n")
    assert llm.chat_tokens(hi, chat_template_kwargs={"enable_thinking": False})[0] == \
        llm.tokenize(quiet, special=True)
    out = llm.create_chat_completion(hi, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize(quiet, special=True))


@needs_real
def test_a_template_that_takes_only_nine_character_ids_gets_them(tiny_model):
    """Mistral's templates refuse a call id that is not 9 letters and digits: ids from elsewhere ("call_...") are
    written as 9 characters of their hash, the same for the call and its result; ids of 9 stay."""
    def history(call_id):
        return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "3 C"}]
    for name in ("mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506"):
        template = ChatTemplate(REAL[name])
        assert template.takes_nine_character_ids
        text = template.render(history("call_8f2c1a0e9b7d4c3a2f1e0d9c"))
        nine = __import__("hashlib").sha256(b"call_8f2c1a0e9b7d4c3a2f1e0d9c").hexdigest()[:9]
        assert text.count(nine) == 2 and "call_8f2c" not in text
        assert template.render(history("Ab3dE6gH9")).count("Ab3dE6gH9") == 2
    assert not ChatTemplate(REAL["Qwen-Qwen2.5-7B-Instruct"]).takes_nine_character_ids


def test_a_template_too_slow_to_probe_is_taken_as_taking_nothing_and_renders_within_its_limit():
    """The probes of what a template takes stop after PROBE_TIME_LIMIT_S each, and within a render's own limit."""
    import time
    from h2o_local import chat_template

    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                        "{{ messages[0].content }}")
    old, chat_template.PROBE_TIME_LIMIT_S = chat_template.PROBE_TIME_LIMIT_S, 0.2
    try:
        start = time.monotonic()
        assert not slow.supports_system_role and not slow.takes_object_arguments
        assert time.monotonic() - start < 5
        fresh = ChatTemplate(slow.source)
        with pytest.raises(ValueError, match="time limit"):
            fresh.render([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], time_limit_s=0.1)
    finally:
        chat_template.PROBE_TIME_LIMIT_S = old
