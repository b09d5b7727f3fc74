"""Structured output: llama.cpp's grammar sampler with GBNF text, JSON and JSON-schema grammars (the converter is
llama-cpp-python's, taken from the pinned sdist at build time)."""
import json

import pytest

from h2o_local import Llama
from h2o_local.grammar import JSON_GRAMMAR, json_schema_grammar, response_format_grammar

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return Llama(tiny_model, policy="h2o", budget=24, n_batch=32)


def test_a_grammar_constrains_every_sampler_path(llm):
    for temperature in (0, 1.5):
        for seed in range(3):
            text = llm.generate("Pick:", grammar='root ::= "yes" | "no" | "maybe"', max_tokens=8,
                                temperature=temperature, seed=seed)
            assert text in ("yes", "no", "maybe")
    digits = llm.generate("Number:", grammar="root ::= [0-9]{3} \"!\"", max_tokens=10, temperature=1.0, seed=4)
    assert len(digits) == 4 and digits[:3].isdigit() and digits[3] == "!"


def test_a_finished_grammar_ends_the_answer_even_when_the_end_token_is_banned(llm):
    """ignore_eos (or a logit_bias of -inf on the end tokens) and a grammar that is complete rule out every token:
    the text is complete, so the answer ends there (it once raised 'Unexpected empty grammar stack')."""
    never_end = {t: float("-inf") for t in llm.eog_tokens()}
    for temperature in (0, 1.0):
        for extra in ({"ignore_eos": True}, {"logit_bias": never_end}):
            out = llm.create_completion("Pick:", grammar='root ::= "yes"', max_tokens=6, temperature=temperature,
                                        **extra)
            assert out["choices"][0]["text"] == "yes" and out["choices"][0]["finish_reason"] == "stop", extra


def test_json_schema_output_parses_and_follows_the_schema(llm):
    for seed in range(3):
        text = llm.generate("JSON:", grammar=json_schema_grammar(SCHEMA), max_tokens=120, temperature=0.8, seed=seed)
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)
        assert value["n"] >= 0


def test_response_format_on_chat(chat_llm):
    out = chat_llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=120, temperature=0,
                                          response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert set(json.loads(out["choices"][0]["message"]["content"])) == {"ok", "n"}
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == JSON_GRAMMAR
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, "json", {"type": "json_schema", "json_schema": {"schema": 3}}):
        with pytest.raises(ValueError):
            response_format_grammar(bad)


def test_bad_grammars_raise_and_leave_the_llama_usable(llm):
    before = llm.generate("abc", max_tokens=6, temperature=0)
    for grammar in ('root ::= "open', "start ::= \"a\"", "root ::= undefined-rule"):
        with pytest.raises(ValueError, match="grammar"):
            llm.generate("abc", grammar=grammar, max_tokens=4)
    with pytest.raises(TypeError):
        llm.generate("abc", grammar=123, max_tokens=4)
    # groups nested past what llama.cpp's recursive parser survives are refused before it runs (20,000 crashed it);
    # parentheses inside literals, classes and comments do not count, and 256 levels parse
    with pytest.raises(ValueError, match="nests groups deeper than 256"):
        llm.generate("abc", grammar="root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000, max_tokens=4)
    deep = 'root ::= "((((" [(] ' + "(" * 256 + '"a"' + ")" * 256 + " # (((("
    assert llm.generate("abc", grammar=deep, max_tokens=4, temperature=0).startswith("((((")
    with pytest.raises(ValueError, match="not several"):
        llm.create_chat_completion([{"role": "user", "content": "hi"}], grammar='root ::= "a"',
                                   response_format={"type": "json_object"})
    assert llm.generate("abc", max_tokens=6, temperature=0) == before


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    from tiny_model import write_tiny_llama

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return Llama(str(write_tiny_llama(tmp_path_factory.mktemp("g") / "chat.gguf", chat_template=template)), policy="h2o", budget=64)


def test_schema_text_with_escapes_and_long_strings_comes_out_as_json(llm):
    """Found by random schemas (tests/server/test_bounded_work.py): the converter left backslashes unescaped (an enum value
    with a control character or a backslash gave text that is not JSON), let strings hold raw control characters,
    and wrote maxLength 1,000 as 1,000 nested groups (refused). Its output is JSON now."""
    weird = ["\x1f", "a\\b", 'q"', "é"]
    for seed in range(4):
        text = llm.generate("JSON:", grammar=json_schema_grammar({"enum": weird}), max_tokens=40, temperature=1.5,
                            seed=seed)
        assert json.loads(text) in weird
    long = json_schema_grammar({"type": "string", "maxLength": 1000})
    for seed in range(3):
        text = llm.generate("JSON:", grammar=long, max_tokens=60, temperature=1.5, seed=seed, ignore_eos=True)
        if text.rstrip().endswith('"') and len(text.strip()) > 1:
            value = json.loads(text)
            assert isinstance(value, str) and len(value) <= 1000
        else:  # cut by max_tokens: every character so far is one JSON allows in a string
            assert not any(ord(c) < 0x20 for c in text)
