"""Tool calls in OpenAI's shape, for chat templates that write them as Hermes / Qwen2.5 do:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after the tools are described in the prompt by the
template itself (rendered with `tools=`).

`tool_choice`: "none" (the tools are described, no call is parsed), "auto" (the model may call: its text is parsed
for calls), "required" or {"type": "function", "function": {"name": N}} (a call is forced by a grammar over the
tools' JSON schemas, through llama.cpp's grammar sampler). A template that has no such format is refused with a
ValueError (HTTP 400), never guessed.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .grammar import json_schema_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "Looks a probe up.",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string", "description": "What to look up."}},
                   "required": ["probe_arg"]}}}
_PROBE_ARGUMENTS = {"probe_arg": "probe value 5f3a"}


def supports_tools(template: Any) -> bool:
    """True when the chat template (a `ChatTemplate`) describes the tools it is given and writes an assistant's call
    as a `<tool_call>` block of JSON that `parse_calls` reads back (Hermes, Qwen2.5, Qwen3): a model trained on it
    writes its calls so. Found by rendering a probe call (once per template: `ChatTemplate.writes_tool_calls`), not
    by the template's name, so that a template that writes other markup inside `<tool_call>` (Qwen3-Coder's
    `<function=...>`) is refused rather than misread."""
    source = getattr(template, "source", None)
    if not source or CALL_OPEN not in source:
        return False
    ask = [{"role": "user", "content": "Look the probe up."}]
    called = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "probe_tool", "arguments": _PROBE_ARGUMENTS}}]}]
    try:
        described = template.render(ask, add_generation_prompt=True, tools=[_PROBE_TOOL])
        written = template.render(called, add_generation_prompt=False, tools=[_PROBE_TOOL])
    except (ValueError, TypeError):
        return False
    calls = parse_calls(written[len(described):] if written.startswith(described) else written)[1]
    return "Looks a probe up." in described and any(
        c["function"]["name"] == "probe_tool" and json.loads(c["function"]["arguments"]) == _PROBE_ARGUMENTS
        for c in calls)


def check_tools(tools: Any, tool_choice: Any) -> Tuple[List[Dict[str, Any]], Any]:
    """The tools as templates take them and the choice ("none", "auto", "required" or a tool's name as a dict);
    ValueError naming what is wrong."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "...}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if choice.get("type") != "function" or name not in names:
            raise ValueError(f"tool_choice names no tool given (tools: {', '.join(names)})")
    elif choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or {{'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {choice!r}")
    return [dict(t) for t in tools], choice


def call_grammar(tools: List[Dict[str, Any]], choice: Any) -> Optional[str]:
    """GBNF that forces one call (of the named tool, or of any): None for "auto" and "none"."""
    if choice in ("none", "auto"):
        return None
    wanted = choice["function"]["name"] if isinstance(choice, Mapping) else None
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools if wanted is None or t["function"]["name"] == wanted]
    body = json_schema_grammar(options[0] if len(options) == 1 else {"anyOf": options})
    body = re.sub(r"^root ::=", "tool-call-json ::=", body, count=1, flags=re.M)
    return f'root ::= "{CALL_OPEN}\\n" tool-call-json "\\n{CALL_CLOSE}"\n{body}'


def parse_calls(text: str, names: Optional[Sequence[str]] = None) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(the text outside the calls, or None when only calls were written; the calls in OpenAI's shape). A block
    that is not a JSON object with a "name" stays in the text. Where `<tool_call>` is a control token its text is
    not in the answer (Qwen2.5's vocabulary): then an answer that is only JSON objects {"name": one of `names`,
    "arguments": {...}}, one per line, is the calls."""
    calls, kept, last = [], [], 0
    for m in _CALL_RE.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    if not calls and names and text.strip():
        bare = [_call(line) for line in text.strip().splitlines() if line.strip()]
        if bare and all(c is not None and c["function"]["name"] in names for c in bare):
            return None, bare  # type: ignore[return-value]
    rest = "".join(kept).strip()
    return (rest or None) if calls else text, calls


def _call(source: str) -> Optional[Dict[str, Any]]:
    try:
        value = json.loads(source, strict=False)  # a control character inside a string is still a call
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def messages_for_template(messages: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """OpenAI messages as tool-aware templates read them: an assistant's calls with their arguments as objects
    (OpenAI sends JSON strings; the templates write them with `tojson`)."""
    out = []
    for m in messages:
        m = dict(m) if isinstance(m, Mapping) else m
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping):
                    fn = dict(c["function"])
                    if isinstance(fn.get("arguments"), str):
                        try:
                            fn["arguments"] = json.loads(fn["arguments"])
                        except ValueError:
                            pass
                    c = {**c, "function": fn}
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


class ToolPlan:
    """What one chat request does with tools: the tools the template renders, the grammar that forces a call,
    whether the answer is parsed for calls."""

    def __init__(self, tools: Optional[List[Dict[str, Any]]] = None, choice: Any = None):
        self.tools = tools
        self.choice = choice
        self.grammar = call_grammar(tools, choice) if tools is not None else None
        self.parses = tools is not None and choice != "none"

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> Any:
        return messages_for_template(messages) if self.tools is not None else messages

    def parse(self, text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        return parse_calls(text, [t["function"]["name"] for t in self.tools or []]) if self.parses else (text, [])


def plan(template: Any, tools: Any, tool_choice: Any) -> ToolPlan:
    """The ToolPlan of a request with this `ChatTemplate`; ValueError for tools a template cannot take or a choice
    without tools."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return ToolPlan()
    checked, choice = check_tools(tools, tool_choice)
    if choice != "none" and not template.writes_tool_calls:
        raise ValueError("this model's chat template has no tool-call format this library reads (<tool_call> "
                         "blocks of JSON, as Hermes, Qwen2.5 and Qwen3 write them): tools are not supported with it")
    return ToolPlan(checked, choice)
