"""Tool calls in OpenAI's shape, for chat templates that describe the tools given to them (rendered with `tools=`)
and write calls in a format `h2o_local.tool_formats` reads: `<tool_call>` blocks of JSON (Hermes, Qwen2.5, Qwen3),
of `<function=...>` tags (Qwen3-Coder, Qwen3.5) or of `<arg_key>` pairs (GLM), a bare JSON answer (Llama 3.1),
after Mistral's `[TOOL_CALLS]`, gpt-oss's messages to `functions.NAME`, or Gemma 4's `<|tool_call>call:NAME{...}`.

`tool_choice`: "none" (the tools are described, no call is parsed), "auto" (the model may call: its text is parsed
for calls), "required" or {"type": "function", "function": {"name": N}} (a call is forced by a grammar over the
tools' JSON schemas, through llama.cpp's grammar sampler). A template that has no such format gets llama-server's
generic fallback (`tool_formats.GenericJson`): the tools described in the system message and every answer one JSON
object, a call or a response.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .tool_formats import CallFormat, GenericJson, JsonBlocks

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


def call_grammar(tools: List[Dict[str, Any]], choice: Any, fmt: CallFormat = JsonBlocks()) -> Optional[str]:
    """GBNF that forces one call (of the named tool, or of any) as `fmt` writes it: None for "auto" and "none"."""
    if choice in ("none", "auto"):
        return None
    wanted = choice["function"]["name"] if isinstance(choice, Mapping) else None
    return fmt.grammar([t for t in tools if wanted is None or t["function"]["name"] == wanted])


def parse_calls(text: str, tools: Sequence[Union[str, Mapping[str, Any]]] = (),
                fmt: CallFormat = JsonBlocks()) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(the text outside the calls, or None when only calls were written; the calls in OpenAI's shape, arguments
    as JSON text). `tools`: the tools given (or their names), whose schemas type the values of the XML formats. A
    block that is not a call stays in the text. Where `<tool_call>` is a control token its text is not in the answer
    (Qwen2.5's vocabulary): then an answer that is only JSON calls of the tools given, one per line, is the calls."""
    given = [{"function": {"name": t}} if isinstance(t, str) else t for t in tools]
    calls, kept, last = [], [], 0
    for start, end, name, arguments in sorted(fmt.find(text, given), key=lambda f: f[0]):
        if start < last or not _an_object(arguments):
            continue  # overlapping, or arguments that are not an object (JSON text of one): not a call
        calls.append({"id": fmt.new_id(), "type": "function",
                      "function": {"name": name,
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    rest = "".join(kept).strip()
    return (rest or None) if calls else text, calls


def _an_object(arguments: Any) -> bool:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return False
    return isinstance(arguments, dict)


class ToolPlan:
    """What one chat request does with tools: the tools the template renders, the grammar that forces a call,
    whether the answer is parsed for calls."""

    def __init__(self, tools: Optional[List[Dict[str, Any]]] = None, choice: Any = None,
                 fmt: CallFormat = JsonBlocks()):
        self.tools = tools
        self.choice = choice
        self.format = fmt
        self.parses = tools is not None and choice != "none"
        # the tools the template is given (the generic fallback describes them in the messages instead)
        self.template_tools = None if isinstance(fmt, GenericJson) else tools
        if isinstance(fmt, GenericJson) and self.parses:  # every answer is JSON: a call, or (auto) a response
            wanted = [t for t in tools if not isinstance(choice, Mapping) or
                      t["function"]["name"] == choice["function"]["name"]]
            self.grammar: Optional[str] = fmt.grammar(wanted, answer_too=choice == "auto")
        else:
            self.grammar = call_grammar(tools, choice, fmt) if tools is not None else None

    def messages(self, messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The messages the template renders: as given, or for the generic fallback with the tools described in
        the system message (the template itself describes none)."""
        if isinstance(self.format, GenericJson) and self.parses:
            return self.format.describe(messages, self.tools or [])
        return messages

    def parse(self, text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        if not self.parses:
            return text, []
        content, calls = parse_calls(text, self.tools or [], self.format)
        if isinstance(self.format, GenericJson) and not calls:
            reply = self.format.response(text)
            return (text if reply is None else reply), []
        return content, calls


def plan(template: Any, tools: Any, tool_choice: Any) -> ToolPlan:
    """The ToolPlan of a request with this `ChatTemplate`; ValueError for tools a template cannot take or a choice
    without tools."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return ToolPlan()
    checked, choice = check_tools(tools, tool_choice)
    fmt = template.tool_format
    return ToolPlan(checked, choice, fmt or GenericJson())
