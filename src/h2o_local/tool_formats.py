"""How a chat template writes a tool call: one small class per format, each reading calls out of an answer and
writing the grammar that forces one.

    <tool_call>{"name": ..., "arguments": {...}}</tool_call>          JsonBlocks  (Hermes, Qwen2.5, Qwen3, Granite 4)
    <tool_call><function=NAME><parameter=K>V</parameter></function>   FunctionTags (Qwen3-Coder, Qwen3.5, Nemotron 3)
    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>        ArgKeys     (GLM 4.5-4.7, Laguna, Ling)
    {"name": ..., "parameters": {...}} as the whole answer             BareJson    (Llama 3.1-3.3)
    [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]          MistralList (Mistral Nemo)
    [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}                             MistralArgs (Mistral Small 3.2, Devstral)
    to=functions.NAME<|channel|>commentary json<|message|>{...}        HarmonyCalls (gpt-oss)
    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>           GemmaCalls  (Gemma 4)
    <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}  KimiCalls   (Kimi K2)
    {"tool_call": {"name": ..., "arguments": {...}}} or {"response": ...}  GenericJson (any other template)

A template's format is found by rendering a probe call with it and reading it back (`chat_template.call_format`), never by
the template's name. In the two XML formats a value is written as it is when its parameter is a string, else as
JSON; reading follows the tool's schema the same way.
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from typing import Any, ClassVar, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from .grammar import json_schema_rules

# (start, end) of the call in the text, the tool's name, its arguments (an object, or JSON text as written)
Found = Tuple[int, int, str, Any]


def _lit(text: str) -> str:
    """A GBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """One way of writing calls. `marker`: text every template of the format holds (a cheap first filter)."""

    name: ClassVar[str]
    marker: ClassVar[str] = "<tool_call>"

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        raise NotImplementedError

    def fitted(self, written: str) -> "CallFormat":
        """This format as a template wrote a call in `written` (its wrapping tag, its line breaks), so that a forced
        call is written as the model saw calls in training."""
        return self

    @property
    def tags(self) -> Tuple[str, ...]:
        """The markup a call is read by: where a vocabulary has a control token for one, the answer must show its
        text (`Llama.preserved_tokens`)."""
        return ("<tool_call>", "</tool_call>")

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """GBNF (rule `root`) for one call of one of `tools`, as this format writes it."""
        raise NotImplementedError

    def new_id(self) -> str:
        """An id for a call read from an answer (OpenAI's shape)."""
        return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class JsonBlocks(CallFormat):
    name = "json"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        found = []
        for m in _finditer(self._BLOCK, text, "</tool_call>"):
            call = _json_call(m.group(1).strip())
            if call is not None:
                found.append((m.start(), m.end()) + call)
        names = {t["function"]["name"] for t in tools}
        if not found and names and text.strip():
            # where <tool_call> is a control token (Qwen2.5) its text is not in the answer: an answer that is only
            # calls of the tools given, one JSON object per line, is those calls
            lines = [m for m in re.finditer(r"[^\n]+", text) if m.group().strip()]
            bare = [_json_call(m.group()) for m in lines]
            if all(c is not None and c[0] in names for c in bare):
                return [(m.start(), m.end()) + c for m, c in zip(lines, bare)]  # type: ignore[operator]
        return found

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "arguments": _parameters(t)},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        refs, rules = json_schema_rules({"call": options[0] if len(options) == 1 else {"anyOf": options}})
        return f'root ::= "<tool_call>\\n" {refs["call"]} "\\n</tool_call>"\n{rules}'


class _XmlFormat(CallFormat):
    """A format whose values are text: strings as they are, other types as JSON. `_CALL` matches a call (group 1
    its name, group 2 its parameters) and ends with `_CLOSE`, `_PARAM` matches one parameter (its key, its value)
    and ends with `_PARAM_CLOSE`."""

    _CALL: ClassVar["re.Pattern[str]"]
    _CLOSE: ClassVar[str]
    _PARAM: ClassVar["re.Pattern[str]"]
    _PARAM_CLOSE: ClassVar[str]

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        by_name = {t["function"]["name"]: t for t in tools}
        found = []
        for m in _finditer(self._CALL, text, self._CLOSE):
            if not self._whole(m):
                continue
            name = m.group(1).strip()
            pairs = [(p.group(1).strip(), p.group(2)) for p in _finditer(self._PARAM, m.group(2), self._PARAM_CLOSE)]
            found.append((m.start(), m.end(), name, self._arguments(by_name.get(name), pairs)))
        return found

    def _whole(self, call: "re.Match[str]") -> bool:
        """Whether a matched call is one (a format whose pattern lets through more than its calls says no)."""
        return True

    def _arguments(self, tool: Optional[Mapping[str, Any]], pairs: List[Tuple[str, str]]) -> Dict[str, Any]:
        props = (_parameters(tool).get("properties") or {}) if tool is not None else {}
        out: Dict[str, Any] = {}
        for key, value in pairs:
            schema = props.get(key)
            if isinstance(schema, Mapping) and schema.get("type") == "string":
                out[key] = value
            else:
                try:
                    out[key] = _json(value)
                except ValueError:
                    out[key] = value
        return out

    def _value_rules(self, tools: Sequence[Mapping[str, Any]]) -> Tuple[List[List[Tuple[str, str, bool]]], str]:
        """Per tool, its parameters as (name, value rule, required), and the rules they use: a string parameter's
        value is text (its enum's values, its length within minLength / maxLength; a pattern is not enforced),
        another's the JSON its schema allows."""
        schemas: Dict[str, Any] = {}
        params: List[List[Tuple[str, str, bool]]] = []
        for i, t in enumerate(tools):
            p = _parameters(t)
            required = set(p.get("required") or ())
            mine = []
            for j, (key, schema) in enumerate((p.get("properties") or {}).items()):
                schema = schema if isinstance(schema, Mapping) else {}
                if schema.get("type") == "string":
                    rule = _text_rule(schema)
                else:
                    schemas[f"t{i}-p{j}"] = schema
                    rule = f"@t{i}-p{j}"
                mine.append((key, rule, key in required))
            params.append(mine)
        refs, rules = json_schema_rules(schemas) if schemas else ({}, "")
        params = [[(k, refs[r[1:]] if r.startswith("@") else r, req) for k, r, req in mine] for mine in params]
        # a value's character: anything up to the closing tag (a value cannot hold "</")
        return params, 'xml-char ::= [^<] | "<" [^/]\n' + rules


def _text_rule(schema: Mapping[str, Any]) -> str:
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "(" + " | ".join(_lit(v) for v in values) + ")"
    if isinstance(schema.get("const"), str):
        return _lit(schema["const"])
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    low = low if type(low) is int and low > 0 else 0
    if type(high) is int and high >= low:
        return f"xml-char{{{low},{high}}}"
    return f"xml-char{{{low},}}" if low else "xml-char*"


@dataclasses.dataclass(frozen=True)
class FunctionTags(_XmlFormat):
    open: str = "<tool_call>"  # the wrapping tag ("<seed:tool_call>" for Seed-OSS; "" for none)
    lines: bool = True          # each tag and value on a line of its own (Qwen), or not (Seed-OSS)
    name = "function-tags"
    marker = "<function="
    _CALL = re.compile(r"(?:<[\w:]{0,64}tool_call>\s{0,64})?<function=([^>\n]{1,256})>(.*?)</function>"
                       r"(?:\s{0,64}</[\w:]{0,64}tool_call>)?", re.S)
    _CLOSE = "</function>"
    _PARAM = re.compile(r"<parameter=([^>\n]{1,256})>\n?(.*?)\n?</parameter>", re.S)
    _PARAM_CLOSE = "</parameter>"

    @property
    def tags(self) -> Tuple[str, ...]:
        wrapper = (self.open, "</" + self.open[1:]) if self.open else ()
        return wrapper + ("<function=", "</function>", "<parameter=", "</parameter>")

    def fitted(self, written: str) -> "FunctionTags":
        m = re.search(r"(<[\w:]*tool_call>)?\s*<function=", written)
        return dataclasses.replace(self, open=(m.group(1) or "") if m else self.open,
                                   lines=bool(re.search(r"<parameter=[^>\n]+>\n", written)))

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        nl = "\\n" if self.lines else ""
        params, rules = self._value_rules(tools)
        calls = []
        for t, mine in zip(tools, params):
            parts = [f'"<function=" {_lit(t["function"]["name"])} ">\\n"']
            for key, rule, required in mine:
                param = f'"<parameter=" {_lit(key)} ">{nl}" {rule} "{nl}</parameter>\\n"'
                parts.append(param if required else f"({param})?")
            parts.append('"</function>"')
            calls.append(" ".join(parts))
        body = "(" + " | ".join(calls) + ")"
        if self.open:
            body = f'{_lit(self.open + chr(10))} {body} {_lit(chr(10) + "</" + self.open[1:])}'
        return f"root ::= {body}\n{rules}"


@dataclasses.dataclass(frozen=True)
class ArgKeys(_XmlFormat):
    lines: bool = True  # a line break after the name and each tag (GLM 4.5 / 4.6), or none (GLM 4.7)
    name = "arg-keys"
    marker = "<arg_key>"
    # a call's name, then its pairs up to the closing tag (`_whole` checks that nothing else is there)
    _CALL = re.compile(r"<tool_call>\s{0,64}([^<\n]{1,256}?)\s{0,64}((?:<arg_key>.*?)?)</tool_call>", re.S)
    _CLOSE = "</tool_call>"
    _PARAM = re.compile(r"<arg_key>(.{0,256}?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)
    _PARAM_CLOSE = "</arg_value>"

    def _whole(self, call: "re.Match[str]") -> bool:
        """Whether a call's body is key-value pairs and nothing else."""
        body, at = call.group(2), 0
        for p in _finditer(self._PARAM, body, self._PARAM_CLOSE):
            if p.start() != at:
                return False
            at = p.end()
        return at == len(body)

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def fitted(self, written: str) -> "ArgKeys":
        return dataclasses.replace(self, lines="</arg_key>\n" in written)

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        nl = ' "\\n"? ' if self.lines else " "  # Ling breaks some lines and not others
        params, rules = self._value_rules(tools)
        calls = []
        for t, mine in zip(tools, params):
            parts = [_lit(t["function"]["name"]) + nl]
            for key, rule, required in mine:
                param = f'"<arg_key>" {_lit(key)} "</arg_key>"{nl}"<arg_value>" {rule} "</arg_value>"{nl}'
                parts.append(f"({param})" if required else f"({param})?")
            calls.append(" ".join(parts))
        return 'root ::= "<tool_call>" (' + " | ".join(calls) + ') "</tool_call>"\n' + rules


@dataclasses.dataclass(frozen=True)
class BareJson(CallFormat):
    """Llama 3.1-3.3's: the whole answer is one JSON object {"name": ..., "parameters": {...}} (after
    `<|python_tag|>`, where the model writes it), of one of the tools given."""

    name = "bare-json"
    marker = '"parameters"'
    _END = re.compile(r"(?:\s*<\|\w+\|>)*\s*$")  # the end-of-turn token a rendered call ends with

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("<|python_tag|>",)

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        names = {t["function"]["name"] for t in tools}
        start = len(text) - len(text.lstrip())
        if text.startswith("<|python_tag|>", start):
            start += len("<|python_tag|>")
        body = text[start:].lstrip()
        start = len(text) - len(body)
        try:
            value, end = _json_at(body, 0)
        except ValueError:
            return []
        if not self._END.fullmatch(body, end) or not isinstance(value, dict) or value.get("name") not in names:
            return []
        arguments = value.get("parameters", value.get("arguments", {}))
        return [(0, start + end, value["name"], arguments)]

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "parameters": _parameters(t)},
                    "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        return json_schema_rules({"": options[0] if len(options) == 1 else {"anyOf": options}})[1]


class _Mistral(CallFormat):
    """Mistral's formats, after a `[TOOL_CALLS]` control token; their templates take only ids of 9 letters and
    digits."""

    marker = "[TOOL_CALLS]"

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def new_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclasses.dataclass(frozen=True)
class MistralList(_Mistral):
    """Mistral Nemo's: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`."""

    name = "mistral-list"

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        names = {t["function"]["name"] for t in tools}
        found = []
        for m in re.finditer(r"\[TOOL_CALLS\]\s*", text):
            try:
                value, end = _json_at(text, m.end())
            except ValueError:
                continue
            items = value if isinstance(value, list) else [value]
            calls = [c for c in items if isinstance(c, dict) and c.get("name") in names]
            if calls and len(calls) == len(items):
                found += [(m.start(), end, c["name"], c.get("arguments", {})) for c in calls[:1]]
                found += [(end, end, c["name"], c.get("arguments", {})) for c in calls[1:]]
        return found

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "arguments": _parameters(t),
                                                     "id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}},
                    "required": ["name", "arguments", "id"], "additionalProperties": False} for t in tools]
        one = options[0] if len(options) == 1 else {"anyOf": options}
        refs, rules = json_schema_rules({"calls": {"type": "array", "items": one, "minItems": 1, "maxItems": 1}})
        return f'root ::= "[TOOL_CALLS]" {refs["calls"]}\n{rules}'


@dataclasses.dataclass(frozen=True)
class MistralArgs(_Mistral):
    """Mistral Small 3.2's, Devstral's and Ministral 3's: `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` (the id where the
    template writes one), one after another for several calls."""

    call_id: bool = False
    name = "mistral-args"
    marker = "[ARGS]"
    _CALL = re.compile(r"\[TOOL_CALLS\]\s*([^\[\s{]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9_-]*\s*)?\[ARGS\]\s*")

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        return _json_after(self._CALL, text)

    def fitted(self, written: str) -> "MistralArgs":
        return dataclasses.replace(self, call_id="[CALL_ID]" in written)

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        refs, rules = json_schema_rules({f"args-{i}": _parameters(t) for i, t in enumerate(tools)})
        call_id = ' "[CALL_ID]" [a-zA-Z0-9]{9}' if self.call_id else ""
        calls = [f'{_lit(t["function"]["name"])}{call_id} "[ARGS]" {refs[f"args-{i}"]}' for i, t in enumerate(tools)]
        return 'root ::= "[TOOL_CALLS]" (' + " | ".join(calls) + ")\n" + rules


@dataclasses.dataclass(frozen=True)
class HarmonyCalls(CallFormat):
    """gpt-oss's (OpenAI's Harmony format): a message to `functions.NAME` on the commentary channel, its body the
    arguments' JSON: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`.
    `head` is the markup before the JSON as the template writes it (NAME standing for the tool's name)."""

    head: str = "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>"
    name = "harmony"
    marker = "<|channel|>"
    # a header is found from its recipient, and its text between marks is short (as reasoning.HarmonySplitter's
    # LONGEST_HEADER): a long answer is read in linear time
    _TO = re.compile(r"to=functions\.([^\s<]+)")
    _TO_MESSAGE = re.compile(r"[^<]{0,256}(?:<\|channel\|>[^<]{0,256})?(?:<\|constrain\|>[^<]{0,256})?<\|message\|>")

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>")

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        found = []
        for start, body, name in self._headers(text):
            try:
                arguments, end = _json_at(text, body)  # <|call|> after the JSON ends the answer (EOG)
            except ValueError:
                continue
            found.append((start, end, name, arguments))
        return found

    def fitted(self, written: str) -> "HarmonyCalls":
        for start, body, _ in self._headers(written):
            return dataclasses.replace(self, head=written[start:body].replace("probe_tool", "NAME"))
        return self

    def _headers(self, text: str) -> Iterator[Tuple[int, int, str]]:
        """(where a header to a function starts, where its message's body starts, the function's name)."""
        for m in self._TO.finditer(text):
            after = self._TO_MESSAGE.match(text, m.end())
            if after is None:
                continue
            lt = text.rfind("<", max(0, m.start() - 256), m.start())  # the mark the header's text follows
            if lt < 0:
                start = max(0, m.start() - 256)
            elif text.startswith(("<|channel|>", "<|start|>"), lt):
                start = lt
            else:  # after another mark (<|end|>): from its end
                start = text.rfind(">", lt, m.start()) + 1 or lt + 1
            if text.startswith("<|channel|>", start) and text.endswith("<|start|>assistant", 0, start):
                start -= len("<|start|>assistant")
            yield start, after.end(), m.group(1)

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        refs, rules = json_schema_rules({f"args-{i}": _parameters(t) for i, t in enumerate(tools)})
        before, after = self.head.split("NAME", 1)
        calls = [f'{_lit(before + t["function"]["name"] + after)} {refs[f"args-{i}"]}' for i, t in enumerate(tools)]
        return "root ::= " + " | ".join(calls) + "\n" + rules


@dataclasses.dataclass(frozen=True)
class GemmaCalls(CallFormat):
    """Gemma 4's: `<|tool_call>call:NAME{...}<tool_call|>`, the arguments in its own notation (`gemma_value`): keys
    bare and sorted, strings between `<|"|>` marks, numbers, true / false, None, [...] and {...}."""

    name = "gemma"
    marker = "<|tool_call>"
    _HEAD = re.compile(r"<\|tool_call>\s*call:([^{\s<]+)(?=\{)")

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("<|tool_call>", "<tool_call|>", GEMMA_QUOTE)

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        found = []
        for m in self._HEAD.finditer(text):
            try:
                arguments, end = _GemmaReader(text, m.end()).value()
            except (ValueError, RecursionError):  # not a call; nesting no call has
                continue
            if not isinstance(arguments, dict):
                continue
            end = _SPACES.match(text, end).end()
            if text.startswith("<tool_call|>", end):
                end += len("<tool_call|>")
            found.append((m.start(), end, m.group(1), arguments))
        return found

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        rules = _GemmaRules()
        calls = [f'{_lit(t["function"]["name"])} {rules.visit(_parameters(t), f"args-{i}")}'
                 for i, t in enumerate(tools)]
        return 'root ::= "<|tool_call>call:" (' + " | ".join(calls) + ') "<tool_call|>"\n' + rules.gbnf()


@dataclasses.dataclass(frozen=True)
class KimiCalls(CallFormat):
    """Kimi K2's: `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>` (INDEX counts the conversation's calls), then
    `<|tool_calls_section_end|>`."""

    name = "kimi"
    marker = "<|tool_call_argument_begin|>"
    _HEAD = re.compile(r"(?:<\|tool_calls_section_begin\|>\s{0,64})?<\|tool_call_begin\|>\s{0,64}(?:functions\.)?"
                       r"([^\s:<]{1,256})(?::\d{1,9})?\s{0,64}<\|tool_call_argument_begin\|>")
    _TAIL = re.compile(r"\s{0,64}<\|tool_call_end\|>(?:\s{0,64}<\|tool_calls_section_end\|>)?")

    @property
    def tags(self) -> Tuple[str, ...]:
        return ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        found = []
        for start, end, name, arguments in _json_after(self._HEAD, text):
            tail = self._TAIL.match(text, end)
            found.append((start, tail.end() if tail else end, name, arguments))
        return found

    def grammar(self, tools: Sequence[Mapping[str, Any]]) -> str:
        refs, rules = json_schema_rules({f"args-{i}": _parameters(t) for i, t in enumerate(tools)})
        calls = [f'"functions." {_lit(t["function"]["name"])} ":" [0-9]{{1,4}} "<|tool_call_argument_begin|>" '
                 f'{refs[f"args-{i}"]}' for i, t in enumerate(tools)]
        return ('root ::= "<|tool_calls_section_begin|><|tool_call_begin|>" (' + " | ".join(calls) +
                ') "<|tool_call_end|><|tool_calls_section_end|>"\n' + rules)


GEMMA_QUOTE = '<|"|>'  # Gemma 4's string mark (a control token)


class _GemmaReader:
    """Gemma 4's notation of a value, read from `text` at `at` (`value()`: the value and where it ends)."""

    _ATOM = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|None|null")

    def __init__(self, text: str, at: int):
        self.text, self.at = text, at

    def value(self) -> Tuple[Any, int]:
        text = self.text
        if text.startswith(GEMMA_QUOTE, self.at):
            end = text.find(GEMMA_QUOTE, self.at + len(GEMMA_QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            value, self.at = text[self.at + len(GEMMA_QUOTE):end], end + len(GEMMA_QUOTE)
            return value, self.at
        if text.startswith("{", self.at):
            return self._items("}", keyed=True), self.at
        if text.startswith("[", self.at):
            return self._items("]", keyed=False), self.at
        m = self._ATOM.match(text, self.at)
        if m is None:
            raise ValueError(f"no value at {self.at}")
        self.at = m.end()
        atom = m.group()
        return {"true": True, "false": False, "None": None, "null": None}.get(atom, None) if atom.isalpha() else \
            (float(atom) if any(c in atom for c in ".eE") else int(atom)), self.at

    def _items(self, close: str, keyed: bool) -> Any:
        self.at += 1
        out: Any = {} if keyed else []
        while True:
            if self.text.startswith(close, self.at):
                self.at += 1
                return out
            if out:
                if not self.text.startswith(",", self.at):
                    raise ValueError(f"no comma at {self.at}")
                self.at += 1
            if keyed:
                if self.text.startswith(GEMMA_QUOTE, self.at):
                    key, _ = self.value()
                else:
                    colon = self.text.find(":", self.at)
                    key = self.text[self.at:colon] if colon > self.at else ""
                    if not key or any(c in key for c in "{}[],<"):
                        raise ValueError(f"no key at {self.at}")
                    self.at = colon
                if not self.text.startswith(":", self.at):
                    raise ValueError(f"no colon at {self.at}")
                self.at += 1
                out[key] = self.value()[0]
            else:
                out.append(self.value()[0])


class _GemmaRules:
    """GBNF for values in Gemma 4's notation that a JSON schema allows: strings (enum, const), integers, numbers,
    booleans, null, arrays of typed items, objects of typed properties in the template's (sorted) order with the
    required ones present; anything else a value of any shape."""

    def __init__(self) -> None:
        self.rules: Dict[str, str] = {
            "g-char": '[^<] | "<" [^|]',  # a string's character: `<|` starts a control token
            "g-string": f'{_lit(GEMMA_QUOTE)} g-char* {_lit(GEMMA_QUOTE)}',
            "g-int": '"-"? ([0] | [1-9] [0-9]{0,15})',  # as llama.cpp's JSON schemas bound them
            "g-number": 'g-int ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?',
            "g-key": '[^:{}\\[\\],<]+ | g-string',  # nested keys are written bare
            "g-value": 'g-string | g-number | "true" | "false" | "None" | "[" (g-value ("," g-value)*)? "]" | '
                       '"{" (g-key ":" g-value ("," g-key ":" g-value)*)? "}"',
        }

    def gbnf(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items()) + "\n"

    def visit(self, schema: Any, name: str) -> str:
        """The rule (its name) for values `schema` allows."""
        schema = schema if isinstance(schema, Mapping) else {}
        kind = schema.get("type")
        if isinstance(schema.get("anyOf") or schema.get("oneOf"), list):
            body = " | ".join(self.visit(s, f"{name}-{i}") for i, s in enumerate(schema.get("anyOf") or schema["oneOf"]))
        elif isinstance(kind, list):
            body = " | ".join(self.visit({**schema, "type": k}, f"{name}-{k}") for k in kind)
        elif "const" in schema or isinstance(schema.get("enum"), list):
            values = [schema["const"]] if "const" in schema else schema["enum"]
            body = " | ".join(_lit(_gemma_text(v)) for v in values) or "g-value"
        elif kind == "string":
            body = _gemma_string(schema)
        elif kind == "integer":
            body = "g-int"
        elif kind == "number":
            body = "g-number"
        elif kind == "boolean":
            body = '"true" | "false"'
        elif kind == "null":
            body = '"None"'
        elif kind == "array":
            item = self.visit(schema.get("items"), f"{name}-item") if isinstance(schema.get("items"), Mapping) \
                else "g-value"
            body = f'"[" {_gemma_items(schema, item)} "]"'
        elif kind == "object" and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
            body = self._object(schema, name)
        else:
            body = "g-value"
        self.rules[name] = body
        return name

    def _object(self, schema: Mapping[str, Any], name: str) -> str:
        """Properties in the order the template writes them (jinja's dictsort: by lowercased key), each optional
        one optional: rule `{name}-first-K` writes properties K.. with none before, `{name}-more-K` after one."""
        required = set(schema.get("required") or ())
        keys = sorted(schema["properties"], key=str.lower)
        for k in range(len(keys), -1, -1):
            if k == len(keys):
                self.rules[f"{name}-first-{k}"] = self.rules[f"{name}-more-{k}"] = '""'
                continue
            key = keys[k]
            value = self.visit(schema["properties"][key], f"{name}-p{k}")
            pair = f'{_lit(key + ":")} {value}'
            skip = key not in required
            self.rules[f"{name}-first-{k}"] = f"{pair} {name}-more-{k + 1}" + (f" | {name}-first-{k + 1}" if skip else "")
            self.rules[f"{name}-more-{k}"] = f'"," {pair} {name}-more-{k + 1}' + (f" | {name}-more-{k + 1}" if skip else "")
        return f'"{{" {name}-first-0 "}}"'


def _gemma_string(schema: Mapping[str, Any]) -> str:
    """A string within the schema's minLength / maxLength (a pattern is not enforced)."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    low = low if type(low) is int and low > 0 else 0
    count = f"{{{low},{high}}}" if type(high) is int and high >= low else f"{{{low},}}" if low else "*"
    return f"{_lit(GEMMA_QUOTE)} g-char{count} {_lit(GEMMA_QUOTE)}"


def _gemma_items(schema: Mapping[str, Any], item: str) -> str:
    """An array's items within its minItems / maxItems."""
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    low = low if type(low) is int and low > 0 else 0
    if high == 0 and type(high) is int:
        return '""'
    high = high if type(high) is int and high >= max(low, 1) else None
    more = f'("," {item})'
    rest = f"{{{max(low - 1, 0)},{high - 1}}}" if high is not None else f"{{{low - 1},}}" if low > 1 else "*"
    return f"{item} {more}{rest}" if low else f"({item} {more}{rest})?"


def _gemma_text(value: Any) -> str:
    """A constant as Gemma 4's template writes it."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    return "None" if value is None else str(value)


class GenericJson(CallFormat):
    """llama-server's generic fallback, for a template with no call format of its own (SmolLM2's, Phi's): the tools
    are described in the system message (`describe`), and a grammar makes every answer one JSON object, either
    {"tool_call": {"name": ..., "arguments": {...}}} (or "tool_calls": [...]) or {"response": "text"}."""

    name = "generic"
    marker = ""  # never probed: chosen where no other format reads a template's calls
    INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                   "reply to the user's request")

    @property
    def tags(self) -> Tuple[str, ...]:
        return ()

    def find(self, text: str, tools: Sequence[Mapping[str, Any]]) -> List[Found]:
        value = self._answer(text)
        calls = value.get("tool_calls", [value["tool_call"]] if "tool_call" in value else [])
        names = {t["function"]["name"] for t in tools}
        if not isinstance(calls, list) or not all(isinstance(c, dict) and c.get("name") in names for c in calls):
            return []
        return [(0, len(text), c["name"], c.get("arguments", {})) for c in calls]

    def response(self, text: str) -> Optional[str]:
        """The text of a {"response": ...} answer (None for anything else)."""
        reply = self._answer(text).get("response")
        return reply if isinstance(reply, str) else None if reply is None else json.dumps(reply)

    @staticmethod
    def _answer(text: str) -> Dict[str, Any]:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return {}
        return value if isinstance(value, dict) else {}

    def grammar(self, tools: Sequence[Mapping[str, Any]], answer_too: bool = False) -> str:
        options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                     "arguments": _parameters(t)},
                    "required": ["name", "arguments"]} for t in tools]
        call = {"type": "object", "properties": {"tool_call": options[0] if len(options) == 1 else {"anyOf": options}},
                "required": ["tool_call"]}
        schema = {"anyOf": [call, {"type": "object", "properties": {"response": {"type": "string"}},
                                   "required": ["response"]}]} if answer_too else call
        return json_schema_rules({"": schema})[1]

    def describe(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """The messages as a template without tools takes them: the tools and the instruction at the end of the
        system message (one is added first where there is none), and each earlier call and reply as the JSON the
        model is asked to write (llama.cpp's polyfill)."""
        note = (f"You can call any of the following tools to satisfy the user's requests: "
                f"{json.dumps(list(tools), indent=2)}\n\n{self.INSTRUCTION}")
        out: List[Dict[str, Any]] = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if m.get("role") == "assistant" and calls:
                written = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                           for c in calls if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)]
                m["content"] = json.dumps({"tool_call": written[0]} if len(written) == 1 else {"tool_calls": written})
            elif m.get("role") == "assistant" and isinstance(m.get("content"), str):  # as the model wrote its reply
                m["content"] = json.dumps({"response": m["content"]})
            out.append(m)
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
        return out


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object where they are JSON text of one (as OpenAI's clients send them)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments if arguments is not None else {}


FORMATS: Tuple[CallFormat, ...] = (JsonBlocks(), FunctionTags(), ArgKeys(), BareJson(), MistralList(), MistralArgs(),
                                   HarmonyCalls(), GemmaCalls(), KimiCalls())


def _json_after(head: "re.Pattern[str]", text: str) -> List[Found]:
    """Calls written as markup that `head` matches (group 1 the tool's name), then the arguments' JSON."""
    found = []
    for m in head.finditer(text):
        try:
            arguments, end = _json_at(text, m.end())
        except ValueError:
            continue
        found.append((m.start(), end, m.group(1), arguments))
    return found


def _finditer(pattern: "re.Pattern[str]", text: str, close: str) -> Iterator["re.Match[str]"]:
    """`pattern.finditer(text)` for a pattern with a lazy `.*?` up to `close` (then at most `_SUFFIX` more characters):
    searched only up to the last `close`, where every attempt that reaches its lazy part succeeds, so that a long
    answer is read in linear time (an opening tag with no closing tag after it would be scanned to the end once per
    opening tag)."""
    last = text.rfind(close)
    return iter(()) if last < 0 else pattern.finditer(text, 0, last + len(close) + _SUFFIX)


_SPACES = re.compile(r"\s*")
_SUFFIX = 160  # what a call pattern may match after its closing tag (FunctionTags' wrapping tag, ArgKeys' spaces)


_JSON_WINDOW = 4096  # characters first read for a JSON value (a longer one is read again in a window 4x as long)


def _json_at(text: str, at: int) -> Tuple[Any, int]:
    """The JSON value at `at` in `text` and where it ends (a control character inside a string is still read);
    ValueError where there is none, or where it nests deeper than Python's recursion allows (no call does).

    Read in a window from `at` that grows while the value may go on past it: Python's parser counts the lines of
    everything before a failure to report it, so that failing at each of many openings in a long answer took
    quadratic time (15,000 openings in 195,000 characters: 0.5 s, nearly all of it counting)."""
    decoder = json.JSONDecoder(strict=False)
    size = _JSON_WINDOW
    while True:
        whole = at + size >= len(text)
        window = text[at:] if whole else text[at:at + size]
        try:
            value, end = decoder.raw_decode(window)
        except json.JSONDecodeError as e:
            # a failure at the window's end, or in a string that the window cut, may be the window's, not the text's
            if whole or not (e.pos >= len(window) - 8 or e.msg.startswith("Unterminated string")):
                raise ValueError(f"{e.msg} (character {at + e.pos})") from None
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        else:
            if whole or end < len(window):  # a value that reaches the window's end (a number) may go on
                return value, at + end
        size *= 4


def _json(text: str) -> Any:
    value, end = _json_at(text, len(text) - len(text.lstrip()))
    if text[end:].strip():
        raise ValueError("text after the JSON value")
    return value


def _json_call(source: str) -> Optional[Tuple[str, Any]]:
    try:
        value = _json(source)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", {})
