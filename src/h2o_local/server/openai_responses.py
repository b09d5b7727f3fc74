"""OpenAI's Responses API, `POST /v1/responses`, on the same slots: a request is translated into the chat request
the server already takes (its `input` items as messages, `instructions` as the system message, function tools,
`text.format` as a response format) and runs as any other, bounded cache, saved conversations and limits included;
the answer comes back as a response object (reasoning, message and function-call items) or, with `stream`, as its
events (`response.created` ... `response.output_text.delta` ... `response.completed`).

Stateless, as Ollama's: nothing is stored (`store` is accepted and answered false), so `previous_response_id`,
`conversation` and `background` are a 400; a client sends the whole conversation as `input` items, its earlier
function calls and their outputs included. Only function tools exist here (hosted tools are a 400)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from .. import reasoning
from . import answers
from .protocol import APIError, ChatCompletionRequest
from .scheduler import Job
from .state import ServerState
from .translated import joined_text, string_field, validated

router = APIRouter()

# fields that describe a request to OpenAI's platform and ask nothing of the answer here
_IGNORED = ("store", "metadata", "include", "truncation", "user", "service_tier", "prompt_cache_key",
            "safety_identifier", "stream_options", "max_tool_calls", "prompt_cache_retention")
# fields that need state this server does not keep
_STATEFUL = ("previous_response_id", "conversation", "background", "prompt")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # this server's own fields (kv_cache, top_k, seed, ...) pass through

    model: Optional[str] = None
    input: Union[str, List[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    stream: bool = False
    tools: Optional[List[Any]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request,
                          state: ServerState = Depends(answers.server_state)):
    """A response to `input` (a text, or message and function-call items), whole or as events."""
    chat = _chat_request(state, body)
    job, plan, _, thinking = await answers.chat_job(state, chat, request)
    head = _head(state, body)
    if body.stream and not plan.parses:
        return answers.event_stream(state, _events(state, job, head, thinking))
    answer = await answers.chat_answer(state, job, request, plan, thinking, body.parallel_tool_calls)
    thought = [_reasoning_item(answer.reasoning)] if answer.reasoning is not None else []
    said = [_message_item(answer.content or "")] if answer.content or not (answer.calls or thought) else []
    items = thought + said + [_call_item(c) for c in answer.calls]
    whole = _done(head, items, answer.finish, job)
    if body.stream:  # with tools the answer is parsed whole, then sent as its events
        return answers.event_stream(state, _whole_events(head, whole))
    return whole


# ------------------------------------------------------------------------------------------ the request, translated
def _chat_request(state: ServerState, body: ResponsesRequest) -> ChatCompletionRequest:
    extra = dict(body.model_extra or {})
    for name in _STATEFUL:
        if extra.get(name) not in (None, False, ""):
            raise APIError(400, f"{name} needs responses stored by the server; this one stores none: send the whole "
                                "conversation as input items", param=name)
    if extra.get("top_logprobs") not in (None, 0):
        raise APIError(400, "top_logprobs is not supported on /v1/responses (the chat route gives logprobs)",
                       param="top_logprobs")
    out: Dict[str, Any] = {k: v for k, v in extra.items()
                           if k not in _IGNORED and k not in _STATEFUL and k != "top_logprobs"}
    out["messages"] = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + \
        _messages(body.input)
    out["stream"] = False
    if body.max_output_tokens is not None:
        out["max_tokens"] = body.max_output_tokens
    if body.tools:
        out["tools"] = [_chat_tool(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        out["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        out["response_format"] = _response_format(fmt)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        out["chat_template_kwargs"] = {**(out.get("chat_template_kwargs") or {}), **_effort(state, effort)}
    return validated(ChatCompletionRequest, out, {"max_tokens": "max_output_tokens", "response_format": "text.format",
                                                  "messages": "input"})


def _messages(items: Union[str, List[Any]]) -> List[Dict[str, Any]]:
    """`input` as chat messages: message items (text parts joined), function calls as an assistant's tool calls
    (several in a row: one message), their outputs as tool messages, reasoning items as the next answer's
    reasoning_content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[Dict[str, Any]] = []
    thought: Optional[str] = None
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object (a message or a function call item)", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param=f"{where}.role")
            message: Dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}
            if not (out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None and
                    thought is None):
                out.append({"role": "assistant", "content": "", "tool_calls": []})
                if thought is not None:
                    out[-1]["reasoning_content"], thought = thought, None
            out[-1]["tool_calls"].append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": string_field(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported (message, function_call, "
                                "function_call_output and reasoning items are)", param=f"{where}.type")
    return out


def _text(content: Any, where: str) -> str:
    """A message's content: text, or its text parts joined (images and files refused: the models here read text)."""
    return joined_text(content, where, ("input_text", "output_text", "text"),
                       ("input_image", "input_file", "input_audio"))


def _chat_tool(i: int, tool: Any) -> Dict[str, Any]:
    """A Responses function tool (name and parameters at the top) as the chat request's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools.{i}: only function tools are supported here, got {kind!r}", param=f"tools.{i}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Union[str, Dict[str, Any]]) -> Union[str, Dict[str, Any]]:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, "tool_choice: only none, auto, required or {'type': 'function', 'name': ...} are "
                                "supported here", param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(fmt: Any) -> Dict[str, Any]:
    """`text.format` as the chat request's response_format."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                            "'json_schema', 'name': ..., 'schema': {...}}", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _effort(state: ServerState, effort: Any) -> Dict[str, Any]:
    """`reasoning.effort` as the template reads it: gpt-oss's reasoning effort, else thinking off for none /
    minimal (Qwen3's enable_thinking)."""
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise APIError(400, f"reasoning.effort must be none, minimal, low, medium or high, got {effort!r}",
                       param="reasoning.effort")
    if reasoning.harmony(state.template_source):
        return {"reasoning_effort": {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)}
    return {"enable_thinking": False} if effort in ("none", "minimal") else {}


# ------------------------------------------------------------------------------------------ the response
def _head(state: ServerState, body: ResponsesRequest) -> Dict[str, Any]:
    """The response object's fields that do not depend on the answer (as OpenAI's echo the request)."""
    tools = list(body.tools or [])
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": body.model or state.model_id, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": (body.model_extra or {}).get("temperature"), "top_p": (body.model_extra or {}).get("top_p"),
            "tools": tools, "tool_choice": body.tool_choice or "auto",
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "previous_response_id": None, "store": False, "background": False, "truncation": "disabled",
            "metadata": (body.model_extra or {}).get("metadata") or {}, "error": None, "incomplete_details": None,
            "usage": None, "user": None}


def _done(head: Dict[str, Any], items: List[Dict[str, Any]], finish: Optional[str], job: Job) -> Dict[str, Any]:
    use = answers.job_usage(job)
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out = {**head, "status": "incomplete" if finish == "length" else "completed", "output": items,
           "usage": {"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
                     "total_tokens": use["total_tokens"],
                     "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens_details": {"reasoning_tokens": 0}}}
    if finish == "length":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    if "kv_cache" in use:
        out["usage"]["kv_cache"] = use["kv_cache"]  # an extension field, as the chat route's
    return out


def _reasoning_item(text: str) -> Dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str, status: str = "completed") -> Dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> Dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: Dict[str, Any]) -> Dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


# ------------------------------------------------------------------------------------------ events
class _Events:
    """A response's events in order, numbered (`sequence_number`), as server-sent events named by their type."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> Dict[str, str]:
        event = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return {"event": kind, "data": json.dumps(event)}


def _opening(say: _Events, head: Dict[str, Any]) -> List[Dict[str, str]]:
    started = {**head, "status": "in_progress", "output": []}
    return [say("response.created", response=started), say("response.in_progress", response=started)]


def _item_events(say: _Events, index: int, item: Dict[str, Any]) -> List[Dict[str, str]]:
    """The events of one output item sent whole: added, its text (or arguments) in one delta, done."""
    kind = item["type"]
    if kind == "message":
        text = item["content"][0]["text"]
        return [say("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                             "content": []}),
                say("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                    part=_text_part("")),
                say("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                    delta=text, logprobs=[]),
                say("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                    logprobs=[]),
                say("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                    part=_text_part(text)),
                say("response.output_item.done", output_index=index, item=item)]
    if kind == "reasoning":
        text = item["content"][0]["text"]
        return [say("response.output_item.added", output_index=index, item={**item, "content": [],
                                                                             "status": "in_progress"}),
                say("response.reasoning_text.delta", item_id=item["id"], output_index=index, content_index=0,
                    delta=text),
                say("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=text),
                say("response.output_item.done", output_index=index, item=item)]
    return [say("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                         "status": "in_progress"}),
            say("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                delta=item["arguments"]),
            say("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                name=item["name"], arguments=item["arguments"]),
            say("response.output_item.done", output_index=index, item=item)]


def _closing(say: _Events, whole: Dict[str, Any]) -> Dict[str, str]:
    return say("response.incomplete" if whole["status"] == "incomplete" else "response.completed", response=whole)


async def _whole_events(head: Dict[str, Any], whole: Dict[str, Any]) -> AsyncIterator[Dict[str, str]]:
    say = _Events()
    for event in _opening(say, head):
        yield event
    for index, item in enumerate(whole["output"]):
        for event in _item_events(say, index, item):
            yield event
    yield _closing(say, whole)


class _Open:
    """The item being streamed (reasoning or message) and its text so far."""

    def __init__(self, item: Dict[str, Any], index: int):
        self.item, self.index, self.text = item, index, ""


async def _events(state: ServerState, job: Job, head: Dict[str, Any],
                  thinking: Optional[reasoning.Thinking]) -> AsyncIterator[Dict[str, str]]:
    """A streamed answer's events: its reasoning item, then its message item, their text delta by delta."""
    say = _Events()
    items: List[Dict[str, Any]] = []
    current: Optional[_Open] = None
    for event in _opening(say, head):
        yield event
    try:
        async for step, thought, answer in answers.split_steps(state, job, thinking):
            e = step.event
            for kind, text in (("reasoning", thought), ("message", answer)):
                if not text:
                    continue
                if current is None or current.item["type"] != kind:
                    if current is not None:
                        for event in _close(say, current, items):
                            yield event
                    current, opened = _open(say, kind, len(items))
                    for event in opened:
                        yield event
                current.text += text
                yield say("response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                          item_id=current.item["id"], output_index=current.index, content_index=0, delta=text,
                          **({} if kind == "reasoning" else {"logprobs": []}))
            if e.token is None:
                if current is None:  # an empty answer is an empty message
                    current, opened = _open(say, "message", 0)
                    for event in opened:
                        yield event
                for event in _close(say, current, items):
                    yield event
                yield _closing(say, _done(head, items, e.finish_reason, job))
    except Exception as error:  # noqa: BLE001 - a started stream ends with an error event, as OpenAI's
        body = answers.as_api_error(error).body()["error"]
        yield say("error", code=body.get("code"), message=body.get("message"), param=body.get("param"))


def _open(say: _Events, kind: str, index: int) -> Tuple[_Open, List[Dict[str, str]]]:
    if kind == "reasoning":
        item = {**_reasoning_item(""), "content": [], "status": "in_progress"}
        return _Open(item, index), [say("response.output_item.added", output_index=index, item=item)]
    item = _message_item("", status="in_progress")
    return _Open(item, index), [say("response.output_item.added", output_index=index, item=item),
                                say("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=_text_part(""))]


def _close(say: _Events, current: _Open, items: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    item_id, index, text = current.item["id"], current.index, current.text
    if current.item["type"] == "reasoning":
        done = {**current.item, "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
        events = [say("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text)]
    else:
        done = {**current.item, "content": [_text_part(text)], "status": "completed"}
        events = [say("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                      logprobs=[]),
                  say("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                      part=_text_part(text))]
    items.append(done)
    return events + [say("response.output_item.done", output_index=index, item=done)]
