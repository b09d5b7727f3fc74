"""Structured output: the GBNF grammars that llama.cpp's grammar sampler constrains generation with.

`SamplingParams(grammar=...)` takes GBNF text (llama.cpp's grammar format, rule `root`); `response_format_grammar`
turns an OpenAI `response_format` into one: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
"json_schema": {"schema": {...}}}` (OpenAI) or `{"type": "json_object", "schema": {...}}` (llama-cpp-python). The
schema is converted by llama-cpp-python's converter, taken from the pinned sdist at build time
(`h2o_local._llama_grammar`), not written here.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional

from . import _llama_grammar

# any JSON object (llama.cpp's grammars/json.gbnf)
JSON_GRAMMAR: str = _llama_grammar.JSON_GBNF

# llama.cpp's GBNF parser recurses once per nested group: tens of thousands of '(' overflow a thread's stack (a
# crash, not an error); no grammar a person or a schema converter writes comes near this
MAX_GRAMMAR_NESTING = 256


# what can hold a parenthesis without opening a group: a literal, a character class, a comment
_GROUP_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*|[()]')


def check_nesting(gbnf: str) -> None:
    """Raise ValueError when groups `( ... )` nest deeper than MAX_GRAMMAR_NESTING (outside literals, character
    classes and comments)."""
    depth = 0
    for m in _GROUP_TOKENS.finditer(gbnf):
        c = m.group()
        if c == "(":
            depth += 1
            if depth > MAX_GRAMMAR_NESTING:
                raise ValueError(f"the grammar nests groups deeper than {MAX_GRAMMAR_NESTING} levels")
        elif c == ")":
            depth = max(depth - 1, 0)


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """GBNF that accepts exactly the JSON values `schema` describes. A schema the converter cannot read raises
    ValueError."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        return _llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, AssertionError) as e:
        raise ValueError(f"the JSON schema could not be converted to a grammar: {e!r}") from None


def response_format_grammar(response_format: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The grammar an OpenAI-style `response_format` asks for; None for plain text. Anything else raises
    ValueError naming what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object, got {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return JSON_GRAMMAR if schema is None else json_schema_grammar(schema)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON schema object)")
        return json_schema_grammar(spec["schema"])
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
