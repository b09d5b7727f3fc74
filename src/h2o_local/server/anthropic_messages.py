"""Anthropic's Messages API, `POST /v1/messages` and `/v1/messages/count_tokens`, on the same slots (as llama-server
and Ollama serve it, for Claude Code and the Anthropic SDK): a request is translated into the chat request the server
already takes (`system`, the messages' text, `tool_use` and `tool_result` blocks, tools with their `input_schema`,
`tool_choice`, `thinking`) and runs as any other, bounded cache and limits included; the answer comes back as a
message of `thinking`, `text` and `tool_use` blocks or, with `stream`, as its events (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`). Errors are Anthropic's
{"type": "error", "error": {"type": ..., "message": ...}}; the key may come as `x-api-key` (app.BearerAuth)."""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .. import reasoning
from . import answers
from .protocol import APIError, ChatCompletionRequest
from .scheduler import Job
from .state import ServerState
from .translated import joined_text, string_field, validated

router = APIRouter()

# Anthropic's fields that ask nothing of the answer here (its platform's features)
_IGNORED = ("metadata", "service_tier", "container", "mcp_servers", "context_management", "anthropic_version")
# the kinds of its errors, by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # this server's own fields (kv_cache, seed, ...) pass through

    model: Optional[str] = None
    max_tokens: int = Field(ge=1)
    messages: List[Any] = Field(min_length=1)
    system: Union[str, List[Any], None] = None
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    messages: List[Any] = Field(min_length=1)
    system: Union[str, List[Any], None] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None


@router.post("/v1/messages")
async def create_message(request: Request, state: ServerState = Depends(answers.server_state)):
    """A message in answer to `messages`, whole or as events."""
    try:
        body = await _parse(request, MessagesRequest)
        chat = _chat_request(state, body)
        job, plan, _, thinking = await answers.chat_job(state, chat, request)
        head = {"id": f"msg_{uuid.uuid4().hex}", "model": body.model or state.model_id}
        if body.stream and not plan.parses:
            return answers.event_stream(state, _events(state, job, head, thinking))
        answer = await answers.chat_answer(state, job, request, plan, thinking, chat.parallel_tool_calls)
        thought, text, calls = answer.reasoning, answer.content, answer.calls
        blocks = ([{"type": "thinking", "thinking": thought, "signature": ""}] if thought is not None else []) + \
            ([{"type": "text", "text": text or ""}] if text or not (calls or thought is not None) else []) + \
            [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
              "input": json.loads(c["function"]["arguments"])} for c in calls]
        whole = _message(job, head, blocks, "tool_use" if calls else _stop_reason(job, answer.finish))
        if body.stream:  # with tools the answer is parsed whole, then sent as its events
            return answers.event_stream(state, _whole_events(whole))
        return whole
    except APIError as e:
        return _error(e)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, state: ServerState = Depends(answers.server_state)):
    """The prompt's tokens as `/v1/messages` would read it (its template, system prompt and tools)."""
    try:
        body = await _parse(request, CountTokensRequest)
        chat = _chat_request(state, validated(MessagesRequest, {**body.model_dump(exclude_none=True),
                                                                 **(body.model_extra or {}), "max_tokens": 1}))
        _, tokens, _ = await answers.chat_prompt(state, chat)
        return {"input_tokens": len(tokens)}
    except APIError as e:
        return _error(e)


async def _parse(request: Request, model: type) -> Any:
    return validated(model, await answers.json_body(request))


def _error(e: APIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(e.status, "api_error")
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=headers)


# ------------------------------------------------------------------------------------------ the request, translated
def _chat_request(state: ServerState, body: MessagesRequest) -> ChatCompletionRequest:
    out: Dict[str, Any] = {k: v for k, v in (body.model_extra or {}).items() if k not in _IGNORED}
    system = _text(body.system, "system") if body.system is not None else ""
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + _messages(body.messages)
    # a final assistant message is a prefill: Anthropic's API continues it
    out["continue_final_message"] = bool(out["messages"]) and out["messages"][-1].get("role") == "assistant"
    out["max_tokens"] = body.max_tokens
    out["stream"] = False
    if body.stop_sequences:
        out["stop"] = body.stop_sequences
    if body.tools:
        out["tools"] = [_chat_tool(i, t) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        out["tool_choice"], parallel = _chat_tool_choice(body.tool_choice)
        if parallel is False:
            out["parallel_tool_calls"] = False
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise APIError(400, f"thinking.type must be enabled or disabled, got {kind!r}", param="thinking.type")
        out["chat_template_kwargs"] = {**(out.get("chat_template_kwargs") or {}),
                                       "enable_thinking": kind != "disabled"}
    return validated(ChatCompletionRequest, out)


def _messages(messages: List[Any]) -> List[Dict[str, Any]]:
    """Anthropic's messages as chat messages: a user's `tool_result` blocks as tool messages (before its text), an
    assistant's `thinking` as reasoning_content and its `tool_use` blocks as tool calls."""
    out: List[Dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}", param=where)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                           param=f"{where}.content")
        texts: List[str] = []
        thought: List[str] = []
        calls: List[Dict[str, Any]] = []
        results: List[Dict[str, Any]] = []
        for j, block in enumerate(blocks):
            here = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and m["role"] == "user":
                results.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", here),
                                "content": _text(block.get("content", ""), f"{here}.content")})
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("input", {}), dict):
                    raise APIError(400, f"{here}.input must be an object", param=f"{here}.input")
                calls.append({"id": string_field(block, "id", here), "type": "function",
                              "function": {"name": string_field(block, "name", here),
                                           "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "thinking" and m["role"] == "assistant":
                thought.append(block.get("thinking") if isinstance(block.get("thinking"), str) else "")
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue
            elif kind in ("image", "document", "search_result"):
                raise APIError(400, f"{here}: {kind} blocks are not supported: this server runs a text model",
                               param=here)
            else:
                raise APIError(400, f"{here}: a {m['role']} message's block cannot be {kind!r}", param=here)
        out += results  # a tool's results answer the calls before them: ahead of the user's own words
        if m["role"] == "user" and (texts or not results):
            out.append({"role": "user", "content": "".join(texts)})
        elif m["role"] == "assistant":
            message: Dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thought:
                message["reasoning_content"] = "".join(thought)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _text(content: Any, where: str) -> str:
    """A system prompt's or a tool result's content: text, or its text blocks joined."""
    return joined_text(content, where, ("text",), ("image", "document"))


def _chat_tool(i: int, tool: Any) -> Dict[str, Any]:
    """A custom tool (name, description, input_schema) as the chat request's function tool."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"tools.{i}: only custom tools ({{'name': ..., 'input_schema': {{...}}}}) are supported "
                            f"here, got {kind!r}", param=f"tools.{i}")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Dict[str, Any]):
    """(the chat's tool_choice, parallel_tool_calls) of Anthropic's {type: auto | any | tool | none}."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


# ------------------------------------------------------------------------------------------ the answer
def _stop_reason(job: Job, finish: Optional[str]) -> str:
    if job.progress.stopping_word:
        return "stop_sequence"
    return "max_tokens" if finish == "length" else "end_turn"


def _message(job: Job, head: Dict[str, Any], blocks: List[Dict[str, Any]],
             stop_reason: Optional[str]) -> Dict[str, Any]:
    use = answers.job_usage(job)
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    usage = {"input_tokens": use["prompt_tokens"] - cached, "output_tokens": use["completion_tokens"],
             "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    return {"id": head["id"], "type": "message", "role": "assistant", "model": head["model"], "content": blocks,
            "stop_reason": stop_reason, "stop_sequence": job.progress.stopping_word or None, "usage": usage}


def _event(kind: str, **fields: Any) -> Dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


def _start(whole: Dict[str, Any]) -> Dict[str, str]:
    started = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {**whole["usage"], "output_tokens": 0}}
    return _event("message_start", message=started)


def _end(whole: Dict[str, Any]) -> List[Dict[str, str]]:
    delta = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    return [_event("message_delta", delta=delta, usage={"output_tokens": whole["usage"]["output_tokens"]}),
            _event("message_stop")]


_EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTA = {"text": "text_delta", "thinking": "thinking_delta"}


def _block_events(index: int, block: Dict[str, Any]) -> List[Dict[str, str]]:
    """One content block sent whole: its start, its content in one delta, its stop."""
    kind = block["type"]
    if kind == "tool_use":
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    else:
        start, delta = _EMPTY[kind], {"type": _DELTA[kind], kind: block[kind]}
    return [_event("content_block_start", index=index, content_block=start),
            _event("content_block_delta", index=index, delta=delta),
            _event("content_block_stop", index=index)]


async def _whole_events(whole: Dict[str, Any]) -> AsyncIterator[Dict[str, str]]:
    yield _start(whole)
    for index, block in enumerate(whole["content"]):
        for event in _block_events(index, block):
            yield event
    for event in _end(whole):
        yield event


async def _events(state: ServerState, job: Job, head: Dict[str, Any],
                  thinking: Optional[reasoning.Thinking]) -> AsyncIterator[Dict[str, str]]:
    """A streamed answer's events: its thinking block, then its text block, delta by delta."""
    yield _start(_message(job, head, [], None))
    open_kind: Optional[str] = None
    index = -1
    try:
        async for step, thought, answer in answers.split_steps(state, job, thinking):
            e = step.event
            for kind, text in (("thinking", thought), ("text", answer)):
                if not text:
                    continue
                if kind != open_kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", index=index)
                    open_kind, index = kind, index + 1
                    yield _event("content_block_start", index=index, content_block=_EMPTY[kind])
                yield _event("content_block_delta", index=index, delta={"type": _DELTA[kind], kind: text})
            if e.token is None:
                if open_kind is None:  # an empty answer is an empty text block
                    index += 1
                    yield _event("content_block_start", index=index, content_block=_EMPTY["text"])
                yield _event("content_block_stop", index=index)
                for event in _end(_message(job, head, [], _stop_reason(job, e.finish_reason))):
                    yield event
    except Exception as error:  # noqa: BLE001 - a started stream ends with an error event, as Anthropic's
        e_ = answers.as_api_error(error)
        yield _event("error", error={"type": _ERROR_TYPES.get(e_.status, "api_error"), "message": e_.message})
