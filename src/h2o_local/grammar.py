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
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from . import _llama_grammar

# any JSON object (llama.cpp's grammars/json.gbnf)
JSON_GRAMMAR: str = _llama_grammar.JSON_GBNF

# llama.cpp's GBNF parser recurses once per nested group: tens of thousands of '(' overflow a thread's stack (a
# crash, not an error); no grammar a person or a schema converter writes comes near this
MAX_GRAMMAR_NESTING = 256


@dataclass(frozen=True)
class GrammarLimits:
    """How large a grammar may be, checked before any work is done on it (the server's settings raise them).

    The grammar sampler's work per token grows with the alternatives that are open at once (an enum of N values
    opens N), and llama.cpp copies a repeated item once per repetition, so a few bytes of schema (`minItems`:
    10,000,000) can ask for gigabytes. The defaults hold what real structured output needs: OpenAI's structured
    outputs take at most 1,000 enum values and 5,000 properties per schema, llama.cpp's GBNF parser refuses a
    repetition count over 2,000.

    Size is not work: nullable rules nested k deep open m^k parse stacks at once from a few hundred bytes, so the
    work itself is bounded too, by llama.cpp's grammar sampler as it runs (our patch 0010):

    max_bytes: GBNF text, bytes. max_rules: rules (`name ::= ...`). max_alternatives: `|` in the whole grammar.
    max_repetition: the largest count in `{m,n}` and in a schema's minItems / maxItems / minLength / maxLength /
        minProperties / maxProperties and its patterns' `{m,n}`.
    max_work: steps one grammar call may take (a candidate token's character matched is one, a parse-stack
        element visited eight): its parse, a check of the vocabulary, a token accepted. The default is about a second
        of one core, what max_alternatives (2,048) open alternatives checked against a 151k vocabulary take; a
        grammar whose start needs more is refused when its sampler is made, one that needs more later ends its
        generation with `_engine.GrammarWorkExceeded` (a GrammarError, a ValueError).
    """

    max_bytes: int = 256 * 1024
    max_rules: int = 10_000
    max_alternatives: int = 2_048
    max_repetition: int = 2_000
    max_work: int = 400_000_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_rules", "max_alternatives", "max_repetition", "max_work"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be an int >= 1, got {value!r}")


DEFAULT_LIMITS = GrammarLimits()

# the server setting that raises each limit (the Python API names the GrammarLimits field)
_SETTING = {name: f"grammar_{name}" for name in GrammarLimits.__dataclass_fields__}


class GrammarTooLarge(ValueError):
    """A grammar (or the JSON schema it comes from) over one of `GrammarLimits`; `limit` names the field. `value`
    None: the sampler stopped at the limit (max_work) without counting further."""

    def __init__(self, what: str, value: Optional[float], limit: str, limits: GrammarLimits):
        self.limit = limit
        if value is None:
            shown = ""
        else:
            shown = " " + (f"{value:g}" if isinstance(value, float) else str(value) if value < 10**18 else "over 10^18")
        super().__init__(f"the grammar is too large: {what}{shown} is over the limit of {getattr(limits, limit)} "
                         f"(GrammarLimits.{limit}; on the server --{_SETTING[limit].replace('_', '-')})")


def work_exceeded(limits: GrammarLimits) -> GrammarTooLarge:
    """What llama.cpp's grammar sampler stopping at `limits.max_work` is said as."""
    return GrammarTooLarge("the work of one step of its sampler (too many parse stacks open at once)", None,
                           "max_work", limits)


# what can hold a parenthesis, a bar or a brace without being an operator: a literal, a character class, a comment
_GBNF_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*|::=|[()|]|\{[\d\s,]*\}?')
_COUNTS = re.compile(r"\d+")


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18  # Python refuses to read ints of over 4,300 digits


def _operators(gbnf: str) -> Iterator[str]:
    for m in _GBNF_TOKENS.finditer(gbnf):
        c = m.group()
        if c[0] not in "\"[#":
            yield c


def check_nesting(gbnf: str) -> None:
    """Raise ValueError when groups `( ... )` nest deeper than MAX_GRAMMAR_NESTING (outside literals, character
    classes and comments)."""
    depth = 0
    for c in _operators(gbnf):
        if c == "(":
            depth += 1
            if depth > MAX_GRAMMAR_NESTING:
                raise ValueError(f"the grammar nests groups deeper than {MAX_GRAMMAR_NESTING} levels")
        elif c == ")":
            depth = max(depth - 1, 0)


def check_grammar(gbnf: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raise ValueError (GrammarTooLarge for a limit) when GBNF text is over `limits` or nests too deeply; nothing
    is built. Whether it parses is llama.cpp's to say, when a sampler is made of it."""
    size = len(gbnf.encode("utf-8", errors="surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarTooLarge("its size in bytes,", size, "max_bytes", limits)
    check_nesting(gbnf)
    rules = alternatives = 0
    for c in _operators(gbnf):
        if c == "::=":
            rules += 1
        elif c == "|":
            alternatives += 1
        elif c[0] == "{":
            count = max((_count(n) for n in _COUNTS.findall(c)), default=0)
            if count > limits.max_repetition:
                raise GrammarTooLarge("a repetition count,", count, "max_repetition", limits)
    if rules > limits.max_rules:
        raise GrammarTooLarge("its number of rules,", rules, "max_rules", limits)
    if alternatives > limits.max_alternatives:
        raise GrammarTooLarge("its number of alternatives ('|'),", alternatives, "max_alternatives", limits)


_REPEAT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_PATTERN_COUNTS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_schema_repetitions(schema: Any, limits: GrammarLimits) -> None:
    """The converter writes a repeated item out once per repetition: a count over the limit is refused before it
    runs (a schema of a few bytes could otherwise ask for gigabytes)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key in _REPEAT_KEYWORDS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and value > limits.max_repetition:
                    raise GrammarTooLarge(f"the schema's {key},", value, "max_repetition", limits)
                if key == "pattern" and isinstance(value, str):
                    for m in _PATTERN_COUNTS.finditer(value):
                        count = max(_count(n) for n in m.groups() if n)
                        if count > limits.max_repetition:
                            raise GrammarTooLarge("a repetition count in a pattern,", count, "max_repetition", limits)
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


_GBNF_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_GBNF_LITERAL_SPECIAL = re.compile(r'[\r\n"\\]')


# a character inside a JSON string: no raw quote, backslash or control character (JSON forbids them), or an escape
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


class _SchemaConverter(_llama_grammar.SchemaConverter):
    """llama-cpp-python's converter, with what it writes kept to JSON (each found by tests/server/test_bounded_work.py's
    random schemas): its literals escaped in full (it left backslashes as they were, so the JSON escape of an enum
    value or a property name, \\u001f for a control character, became a GBNF escape that wrote the raw
    character), and a string's characters (`char`, and a pattern's `.`) without raw control characters, as
    llama.cpp's own converter has them."""

    def _format_literal(self, literal):
        return '"' + _GBNF_LITERAL_SPECIAL.sub(lambda m: _GBNF_LITERAL_ESCAPES[m.group()], literal) + '"'

    def _add_rule(self, name, rule):
        return super()._add_rule(name, _JSON_CHAR if name in ("char", "dot") else rule)


def _repetition(item_rule: str, min_items: int, max_items: Optional[int], separator_rule: Optional[str] = None,
                item_rule_is_literal: bool = False) -> str:
    """`item` between min_items and max_items times (None: no upper bound), `separator` between two, written as
    GBNF's `{m,n}`: llama.cpp's parser expands it without nesting, where the converter's own version nests one
    optional group per repetition (`maxLength: 300` passed the nesting limit llama.cpp's parser survives)."""
    if max_items is not None and max_items < min_items:
        raise ValueError(f"a schema asks for at least {min_items} and at most {max_items} items or characters")
    if max_items == 0:
        return ""

    def times(lo: int, hi: Optional[int]) -> str:
        return f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"

    if not separator_rule:
        return f"({item_rule}){times(min_items, max_items)}"
    more = max_items - 1 if max_items is not None else None
    tail = "" if more == 0 else f" ({separator_rule} {item_rule}){times(max(min_items - 1, 0), more)}"
    return f"({item_rule}{tail})" + ("" if min_items > 0 else "?")


# the converter's methods call the module's function by name (our own copy of the module, h2o_local._llama_grammar)
_llama_grammar._build_repetition = _repetition


def json_schema_grammar(schema: Mapping[str, Any], limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """GBNF that accepts exactly the JSON values `schema` describes. A schema the converter cannot read, or whose
    grammar is over `limits` (checked before the converter runs where the schema alone tells), raises ValueError."""
    return json_schema_rules({"": schema}, limits)[1]


def json_schema_rules(schemas: Mapping[str, Mapping[str, Any]],
                      limits: GrammarLimits = DEFAULT_LIMITS) -> Tuple[Dict[str, str], str]:
    """Several JSON schemas in one grammar: ({name: the rule that accepts what schemas[name] describes}, the rules'
    GBNF), for a grammar that writes its own `root` around them (the name "" is `root` itself). ValueError as
    `json_schema_grammar`."""
    for schema in schemas.values():
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
        _check_schema_repetitions(schema, limits)
    try:
        converter = _SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        refs = {name: converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), name or "stdin"), name)
                for name, schema in schemas.items()}
        gbnf = converter.format_grammar()
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError, AssertionError) as e:
        raise ValueError(f"the JSON schema could not be converted to a grammar: {e!r}") from None
    check_grammar(gbnf, limits)
    return refs, gbnf


def response_format_grammar(response_format: Optional[Mapping[str, Any]],
                            limits: GrammarLimits = DEFAULT_LIMITS) -> Optional[str]:
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
        return JSON_GRAMMAR if schema is None else json_schema_grammar(schema, limits)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON schema object)")
        return json_schema_grammar(spec["schema"], limits)
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
