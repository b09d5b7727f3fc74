"""Chat templates: the prompt text a model expects for a list of OpenAI-style messages.

The GGUF's own Jinja template (`tokenizer.chat_template`) is rendered with jinja2 in a sandbox, as llama-cpp-python
and Hugging Face do; when jinja2 cannot render it, llama.cpp's built-in templates (which recognise the common
families from the template text) are the fallback. A template given by the user is either Jinja source or the name
of one of llama.cpp's built-in templates ("chatml", "llama3", "gemma", ...).
"""
from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import json
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from .tool_formats import FORMATS, CallFormat

Message = Dict[str, Any]


def normalize_messages(messages: Sequence[Message]) -> List[Message]:
    """OpenAI message forms as templates expect them: content as one string (a list of text parts is joined, None
    is empty), role a string, `name` and other fields kept. Raises ValueError / TypeError on a malformed message."""
    if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"message {i} needs a 'role' (a non-empty string)")
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):  # OpenAI omits it there
            raise ValueError(f"message {i} needs a 'content' (a string, a list of text parts, or None)")
        out.append({**m, "content": _content_text(m.get("content"), i)})
    return out


def content_pieces(text: str, contents: Sequence[str], plain: Sequence[str]) -> List[Tuple[str, bool]]:
    """`text` (a rendered chat) cut into (piece, parse special tokens?) pieces: the messages' `contents` are found
    in it in order, and those in `plain` (contents that spell special tokens) are pieces of their own, read as
    text; the rest is the template's markup. ValueError when a content in `plain` is not in the text as it was
    given (a template that rewrites its messages): its special tokens could then not be told from the markup's."""
    pieces: List[Tuple[str, bool]] = []
    cursor = markup_from = 0
    wanted = set(plain)
    for i, content in enumerate(contents):
        at = text.find(content, cursor) if content else -1
        if at < 0:
            if content in wanted:
                raise ValueError(f"message {i}'s content holds the text of a special token, and this chat template "
                                 f"does not write it out as given, so it cannot be kept as text: remove it (or ask "
                                 f"for special tokens in content)")
            continue
        if content in wanted:
            pieces += [(text[markup_from:at], True), (content, False)]
            markup_from = at + len(content)
        cursor = at + len(content)
    pieces.append((text[markup_from:], True))
    return [(piece, special) for piece, special in pieces if piece]


def markup_strings(messages: Sequence[Message], tools: Optional[Sequence[Any]] = None,
                   variables: Optional[Mapping[str, Any]] = None) -> Iterator[Tuple[str, str]]:
    """(where, text) for every string a template may write as markup from a request, besides the messages'
    contents: message fields (`name`, `tool_calls` with their arguments, `reasoning_content`, ...), the tools'
    names, descriptions and schemas, the template's variables; a string holding JSON (a call's arguments) also
    gives the strings inside it, since a template may write them parsed."""
    roots: List[Tuple[str, Any]] = [(f"messages[{i}]", {k: v for k, v in m.items() if k != "content"})
                                    if isinstance(m, dict) else (f"messages[{i}]", m) for i, m in enumerate(messages)]
    roots += [("tools", tools), ("chat_template_kwargs", variables)]
    stack = list(reversed(roots))
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            yield where, value
            if value.lstrip()[:1] in ("{", "["):
                try:
                    stack.append((where, json.loads(value)))
                except (ValueError, RecursionError):
                    pass
        elif isinstance(value, dict):
            stack += [(f"{where}.{k}", v) for k, v in reversed(value.items())]
            stack += [(f"{where} (a key)", k) for k in value if isinstance(k, str)]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value)))]


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"message {i}: a text content part needs 'text' (a string)")
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message {i}: only text content parts are supported, got {kind!r}")
        return "".join(texts)
    raise TypeError(f"message {i}: content must be a string, a list of text parts or None, "
                    f"got {type(content).__name__}")


# what a template is given by the renderer itself, which `variables` may not replace
RENDERER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                      "strftime_now", "range")


def check_variables(variables: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """`chat_template_kwargs` as a template takes them: a mapping of names to JSON values, none of the renderer's
    own (RENDERER_VARIABLES); ValueError / TypeError otherwise."""
    if variables is None:
        return None
    if not isinstance(variables, Mapping):
        raise TypeError(f"chat_template_kwargs must be an object of names to values, got {type(variables).__name__}")
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a name a template can read")
        if name in RENDERER_VARIABLES:
            raise ValueError(f"chat_template_kwargs: {name!r} is given to the template by the renderer itself")
    try:
        return copy.deepcopy(dict(variables))
    except RecursionError:
        raise ValueError("chat_template_kwargs are nested too deeply") from None


def probe_call(arguments: Any, call_id: str = "call00001") -> Message:
    """An assistant message with one call of "probe_tool": what the probes of a template's ways render."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "probe_tool", "arguments": arguments}}]}


_SYSTEM_PROBE = "<system prompt 5f3a>"
PROBE_TIME_LIMIT_S = 5.0  # the most one probe of what a template takes may render for
_ARGUMENT_PROBE = "argument 5f3a"


def _arguments_as(msgs: List[Message], objects: bool) -> None:
    """The arguments of the messages' tool calls as objects (JSON text that does not parse stays text), or as JSON
    text; in place."""
    for m in msgs:
        calls = m.get("tool_calls")
        for c in calls if isinstance(calls, list) else ():
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or "arguments" not in fn:
                continue
            if objects and isinstance(fn["arguments"], str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            elif not objects and not isinstance(fn["arguments"], str):
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)


def _system_merged(msgs: List[Message]) -> List[Message]:
    """The leading system messages written at the start of the next message's content, one per line."""
    n = 0
    while n < len(msgs) and msgs[n]["role"] == "system":
        n += 1
    if n == 0:
        return msgs
    system = "\n".join(m["content"] for m in msgs[:n])
    if n == len(msgs):
        return [{"role": "user", "content": system}]
    first = msgs[n]
    return [{**first, "content": system + "\n" + first["content"] if first["content"] else system}] + msgs[n + 1:]


def _ids_of_nine(msgs: List[Message]) -> None:
    """Tool-call ids of 9 letters and digits (an id that is one stays), in calls and results alike; in place."""
    def nine(call_id: Any) -> Any:
        if not isinstance(call_id, str) or re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]
    for m in msgs:
        for c in m.get("tool_calls") or ():
            if isinstance(c, dict) and "id" in c:
                c["id"] = nine(c["id"])
        if "tool_call_id" in m:
            m["tool_call_id"] = nine(m["tool_call_id"])


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[Tuple[str, str]] = None, sort_keys: bool = False) -> str:
    # Hugging Face's tojson: JSON as json.dumps writes it (jinja2's own escapes <, >, & and ' for HTML, which a
    # prompt must not see), with the keywords templates pass (ensure_ascii=False, indent, separators); what a filter
    # such as map() yields is written as the list it stands for
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_json_list)


def _json_list(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: Hugging Face's marker of the assistant's text (for training
    masks); rendering writes its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(jinja2.sandbox.SandboxedEnvironment):
    """The sandbox templates render in: Hugging Face's (loop controls, `generation`, its tojson) where templates may
    build their own lists and dicts (`ns.calls.append(...)`, as llama.cpp's Jinja engine lets them), and every call
    checks the render's time limit, so that no loop (a list that grows while it is walked) outlives it."""

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader(),
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, range=_timed_range)
        self.filters.update(tojson=_tojson, from_json=json.loads)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)


class ChatTemplate:
    """One model's chat template.

    source: Jinja source, the name of a llama.cpp built-in template, or None (the model has none).
    builtin: renders with llama.cpp's built-in templates: builtin(pairs, add_generation_prompt, name_or_source).
    given_by_user: Jinja the user wrote is used as written: when jinja2 cannot parse or render it, that is a
        ValueError, not a built-in guessed from its text (the fallback is for the GGUF's own template).
    """

    def __init__(self, source: Optional[str], *, bos_token: str = "", eos_token: str = "",
                 builtin: Optional[Callable[[List[tuple], bool, str], str]] = None, given_by_user: bool = False):
        self.source = source
        self.given_by_user = given_by_user
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._builtin = builtin
        self._jinja: Optional[jinja2.Template] = None
        self.jinja_error: Optional[str] = None  # why the Jinja template cannot be used (then the built-in is)
        if source is not None and _looks_like_jinja(source):
            try:
                self._jinja = _Sandbox().from_string(source)
            except jinja2.TemplateError as e:
                self.jinja_error = f"{type(e).__name__}: {e}"

    @property
    def is_jinja(self) -> bool:
        return self._jinja is not None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               time_limit_s: Optional[float] = None, tools: Optional[List[Dict[str, Any]]] = None,
               variables: Optional[Mapping[str, Any]] = None) -> str:
        """The prompt text for `messages` (normalised first), ending with the assistant's turn opened when
        `add_generation_prompt`. `variables`: more the template reads (llama-server's and vLLM's
        `chat_template_kwargs`, as `{"enable_thinking": False}` for Qwen3; `check_variables`). Raises ValueError
        when there is no template, or neither renderer accepts it, or (with `time_limit_s`) when the template's
        loops run past that many seconds."""
        try:
            return self._render_copies(messages, add_generation_prompt, time_limit_s, tools, variables)
        except RecursionError:
            raise ValueError("the messages, tools or chat_template_kwargs are nested too deeply") from None

    def _render_copies(self, messages: Sequence[Message], add_generation_prompt: bool, time_limit_s: Optional[float],
                       tools: Optional[List[Dict[str, Any]]], variables: Optional[Mapping[str, Any]]) -> str:
        # llama.cpp's default: today's date where a template reads date_string (Llama 3.x; a request may set it)
        variables = {"date_string": datetime.date.today().strftime("%d %b %Y"), **(check_variables(variables) or {})}
        msgs = copy.deepcopy(normalize_messages(messages))  # a template may change what it is given
        if self.source is not None and "developer" not in self.source:
            msgs = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
        _deadline.at = None if time_limit_s is None else time.monotonic() + time_limit_s
        try:
            if self._jinja is not None and any(m.get("tool_calls") for m in msgs):
                _arguments_as(msgs, objects=self.takes_object_arguments)
            if self._jinja is not None and any(m.get("tool_calls") or m.get("tool_call_id") for m in msgs) and \
                    self.takes_nine_character_ids:
                _ids_of_nine(msgs)
            if self._jinja is not None and not self.supports_system_role:
                msgs = _system_merged(msgs)
            return self._render(msgs, add_generation_prompt, copy.deepcopy(tools), variables)
        except TimeoutError as e:  # a probe of what the template takes ran past the render's limit
            raise ValueError(str(e)) from None
        finally:
            _deadline.at = None

    @functools.cached_property
    def tool_format(self) -> Any:
        """The `tool_formats.CallFormat` this template writes calls in, None where tools cannot be used with it
        (`call_format`, probed once)."""
        return call_format(self)

    @functools.cached_property
    def default_system(self) -> str:
        """What this template writes before a conversation's first message when it has no system message, where
        that is a system turn of its own (SmolLM2's "You are a helpful AI assistant named SmolLM...", Qwen2.5's
        "You are Qwen..."), followed by the first message's opening; "" where it writes none. Probed once: the
        messages' own turns are what keep="system" protects, and this default is one of them."""
        if self._jinja is None:
            return ""
        user, system = "\ue000user\ue000", "\ue000system\ue000"  # private-use text no template writes itself
        alone = self._probe([{"role": "user", "content": user}], False)
        both = self._probe([{"role": "system", "content": system}, {"role": "user", "content": user}], False)
        if alone is None or both is None or user not in alone or system not in both:
            return ""
        before = alone[:alone.find(user)]                 # the default turn (if any) and the user turn's opening
        opening = both[:both.find(system)]                # a system turn's opening
        between = both[both.find(system) + len(system):both.find(user)]  # its close, the user turn's opening
        if not opening or not between or len(before) <= len(opening) + len(between) or \
                not before.startswith(opening) or not before.endswith(between):
            return ""
        return before

    @functools.cached_property
    def takes_object_arguments(self) -> bool:
        """Whether the Jinja template writes a call's arguments from an object (`tojson`, `| items`: most do, as
        Hugging Face's convention has them) rather than as the JSON text OpenAI sends; probed once, as llama.cpp
        does. Calls are given to the template in the form it takes, whichever form the messages hold."""
        text = self._probe([{"role": "user", "content": "Hello"}, probe_call({"probe_arg": _ARGUMENT_PROBE})], False)
        return text is not None and _ARGUMENT_PROBE in text and "{'probe_arg'" not in text

    @functools.cached_property
    def takes_nine_character_ids(self) -> bool:
        """Whether the template takes only tool-call ids of 9 letters and digits (Mistral's refuse others); probed
        once. Ids are then written so: each id another maker wrote ("call_...") as 9 characters of its hash, the
        same for a call and its result."""
        def conversation(call_id: str) -> List[Message]:
            return [{"role": "user", "content": "Hello"}, probe_call({"a": "b"}, call_id),
                    {"role": "tool", "tool_call_id": call_id, "content": "done"}]
        for call_id, takes in (("call_0123456789abcdef", False), ("a1b2c3d4e", True)):
            if self._probe(conversation(call_id)) is not None:
                return takes
        return False

    @functools.cached_property
    def supports_system_role(self) -> bool:
        """Whether the Jinja template writes a system message: Gemma's refuse one, and some drop it. Probed once, as
        llama.cpp does; where it does not, leading system messages are written at the start of the next message
        (llama.cpp's and Ollama's rule), a system message alone as the user's."""
        text = self._probe([{"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "Hello"}])
        return text is not None and _SYSTEM_PROBE in text

    def _probe(self, messages: List[Message], add_generation_prompt: bool = True) -> Optional[str]:
        """What the Jinja template makes of a few fixed messages, or None where it refuses them (or takes more than
        PROBE_TIME_LIMIT_S: a template that slow is not probed further). The render's own time limit, if any, stays."""
        outer = getattr(_deadline, "at", None)
        _deadline.at = min(time.monotonic() + PROBE_TIME_LIMIT_S, outer if outer is not None else float("inf"))
        try:
            return self._jinja.render(messages=messages, add_generation_prompt=add_generation_prompt,  # type: ignore
                                      bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception:
            return None
        finally:
            _deadline.at = outer
            if outer is not None and time.monotonic() > outer:
                raise TimeoutError("the chat template ran past its time limit")

    def _render(self, msgs: List[Message], add_generation_prompt: bool,
                tools: Optional[List[Dict[str, Any]]] = None, variables: Optional[Dict[str, Any]] = None) -> str:
        if self.source is None:
            raise ValueError("this model has no chat template: give one (chat_template='chatml', a built-in name, "
                             "or Jinja source) or use create_completion with your own prompt")
        if self._jinja is not None:
            try:
                extra = dict(variables or {}) if tools is None else {**(variables or {}), "tools": tools}
                return self._jinja.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                          bos_token=self.bos_token, eos_token=self.eos_token, **extra)
            except jinja2.TemplateError as e:
                if _is_raised_by_template(e):
                    raise ValueError(f"the chat template refused these messages: {e}") from None
                self.jinja_error = f"{type(e).__name__}: {e}"
            except TimeoutError as e:
                raise ValueError(str(e)) from None
            except Exception as e:  # a template's own bug (a filter on None, say): the built-in may still know it
                self.jinja_error = f"{type(e).__name__}: {e}"
        if self.given_by_user and self.jinja_error is not None:
            raise ValueError(f"the chat template given does not render ({self.jinja_error})")
        if self._builtin is None or tools is not None:
            raise ValueError(f"cannot render the chat template ({self.jinja_error})")
        pairs = [(m["role"], m["content"]) for m in msgs]
        try:
            return self._builtin(pairs, add_generation_prompt, self.source)
        except ValueError as e:
            reason = f" (Jinja: {self.jinja_error})" if self.jinja_error else ""
            raise ValueError(f"cannot render the chat template: {e}{reason}") from None


_deadline = threading.local()  # when the render in this thread must stop (None: never)


class _TimedRange(list):
    """The sandbox's range (at most MAX_RANGE items) as a list (`range(n) | length`, `tojson`), whose walk stops a
    render that runs past its time limit."""

    def __iter__(self) -> Iterator[int]:
        for i in super().__iter__():
            _check_deadline()
            yield i


def _timed_range(*args: int) -> _TimedRange:
    return _TimedRange(jinja2.sandbox.safe_range(*args))


def _check_deadline() -> None:
    at = getattr(_deadline, "at", None)
    if at is not None and time.monotonic() > at:
        raise TimeoutError("the chat template ran past its time limit")


def _looks_like_jinja(source: str) -> bool:
    return "{%" in source or "{{" in source


def _is_raised_by_template(e: Exception) -> bool:
    # raise_exception(...) in a template is its way of rejecting input (say, roles that do not alternate)
    return type(e) is jinja2.exceptions.TemplateError


PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool", "description": "Looks a probe up.",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string", "description": "What to look up."},
                                                    "probe_count": {"type": "integer"}},
                   "required": ["probe_arg"]}}}
PROBE_ARGUMENTS = {"probe_arg": "probe value 5f3a", "probe_count": 3}


def call_format(template: Any) -> Optional[CallFormat]:
    """The format in which the chat template (a `ChatTemplate`) writes an assistant's call, when it also describes
    the tools it is given: a model trained on it writes its calls so. Found by rendering a probe call (once per
    template: `ChatTemplate.tool_format`) and reading it back with each format, not by the template's name; None
    when no format reads it (Kimi's, DeepSeek's, ...)."""
    source = getattr(template, "source", None)
    candidates = [f for f in FORMATS if source and f.marker in source]
    if not candidates:
        return None
    ask = [{"role": "user", "content": "Look the probe up."}]
    called = ask + [probe_call(PROBE_ARGUMENTS)]
    try:
        described = template.render(ask, True, PROBE_TIME_LIMIT_S, tools=[PROBE_TOOL])
        written = template.render(called, False, PROBE_TIME_LIMIT_S, tools=[PROBE_TOOL])
    except (ValueError, TypeError):
        return None
    if "Looks a probe up." not in described:
        return None
    answer = written[len(described):] if written.startswith(described) else written
    for fmt in candidates:
        for start, end, name, arguments in fmt.find(answer, [PROBE_TOOL]):
            if name == "probe_tool" and arguments == PROBE_ARGUMENTS:
                return fmt.fitted(answer[start:end])
    return None
