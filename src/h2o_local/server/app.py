"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions, /health.

Every request becomes a `Job` for the `Scheduler`, which decodes all running requests together. Errors are
OpenAI-shaped JSON ({"error": {"message", "type", "param", "code"}}) with 4xx codes: 400 for a request that is
malformed or does not fit, 413 for an oversized body, 429 when every slot is busy and the waiting line is full.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import generation
from ..llama import Llama
from ..sampling import CHAT, COMPLETION, SamplingParams
from .scheduler import Busy, Cancelled, Job, Scheduler


# the roles OpenAI's chat API knows
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


# OpenAI request fields this server does not implement, with the values that ask for nothing (accepted, since
# many clients send them with their defaults); any other value is a 400 naming the field
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "repetition_penalty": (None, 1, 1.0), "repeat_penalty": (None, 1, 1.0),
               "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1),
               "grammar": (None, ""), "parallel_tool_calls": (None,)}


# stop strings are searched in the text after every token: bounded, as OpenAI bounds them (it takes 4; clients that
# send a few more to llama-server keep working here)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept to be checked against UNSUPPORTED

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    n: int = Field(default=1, ge=1, le=1)


    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(len(x) > MAX_STOP_CHARS for x in strings):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stop

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not any(value == ok and type(value) is type(ok) or (value is ok)
                                               for ok in UNSUPPORTED[name]):
                raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name,
                               code="unsupported_parameter")


class CompletionRequest(_Request):
    prompt: Union[str, List[str], List[StrictInt]]  # a JSON true is not token 1
    echo: bool = False


class ChatCompletionRequest(_Request):
    messages: List[Dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[Dict[str, str]] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status,
                        headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_body_bytes`, whether it says its length (Content-Length)
    or streams it in chunks without one (counted as it arrives; the body is read before any answer starts)."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        message = f"the request body is larger than {limit} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _error(413, message, code="body_too_large")(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(413, message)  # answered by the app's error handler
            return event

        await self.app(scope, counted_receive, send)


def create_app(llm: Llama, *, model_id: Optional[str] = None, max_waiting: int = 16,
               session_bytes: int = 256 * 2**20, max_body_bytes: int = 8 * 2**20,
               max_prompt_tokens: Optional[int] = None, template_timeout_s: float = 10.0) -> FastAPI:
    """The app serving `llm` (which it owns: one request thread decodes for all). `model_id` is the name
    /v1/models shows (default: the file name). `max_prompt_tokens`: longer prompts are a 400 (default: the model's
    trained context, or a slot's cells if more). `template_timeout_s`: the longest a chat template may take to
    render a request's messages (rendered off the event loop) before the request is a 400."""
    import os

    model_id = model_id or os.path.basename(llm.model_path)
    default_keep = llm.keep if isinstance(llm.keep, int) else 0  # the protected prefix of a completion
    if max_prompt_tokens is None:
        max_prompt_tokens = max(llm.n_ctx_train(), llm._engine.stream_capacity)
    templates = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="h2o-local-template")
    scheduler = Scheduler(llm, max_waiting=max_waiting, session_bytes=session_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        scheduler.close()
        templates.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="h2o_local", description="OpenAI-compatible API with a bounded (H2O) KV cache",
                  lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.llm = llm

    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return _error(400, f"the body is not valid JSON ({detail} at character {first['loc'][-1]})".replace(" ()", ""))
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), kind="invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.code, headers)

    @app.get("/health")
    async def health() -> Dict[str, Any]:
        return {"status": "ok", **scheduler.stats()}

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "h2o_local", "policy": llm.policy.label}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.refuse_unsupported()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (n=1)", param="prompt")
            prompt = prompt[0]
        try:
            if isinstance(prompt, str):  # special tokens parsed, as llama-cpp-python and llama-server do
                tokens, text = llm.tokenize(prompt, add_bos=llm.info.add_bos, special=True), prompt
            else:
                tokens, text = [int(t) for t in prompt], None
                if any(not 0 <= t < llm.n_vocab() for t in tokens):
                    raise ValueError(f"token ids must be in [0, {llm.n_vocab()})")
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="prompt") from None
        params = _sampling(COMPLETION, body, body.max_tokens)
        job = await _submit(Job(tokens, params, n_keep=default_keep), request)
        meta = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model_id}
        if body.echo and text is None:  # token ids: their text, as llama-cpp-python echoes it
            text = llm.detokenize(tokens).decode("utf-8", errors="replace")
        echo = text if body.echo else ""
        if body.stream:
            return EventSourceResponse(_completion_stream(job, meta, echo, _include_usage(body)), ping=15)
        pieces, n, finish = await _collect(job, request)
        return {**meta, "choices": [{"text": echo + "".join(pieces), "index": 0, "logprobs": None,
                                     "finish_reason": finish}], "usage": _usage(job, n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.refuse_unsupported()
        for i, m in enumerate(body.messages):
            if m.get("role") not in ROLES:
                raise APIError(400, f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got "
                                    f"{m.get('role')!r}", param=f"messages.{i}.role")
        try:  # a template can be slow on some messages: never on the event loop, and never for long
            rendering = asyncio.get_running_loop().run_in_executor(templates, llm.chat_tokens, body.messages,
                                                                   template_timeout_s)
            tokens, n_keep = await asyncio.wait_for(rendering, template_timeout_s + 1)
        except asyncio.TimeoutError:
            raise APIError(400, f"the chat template took more than {template_timeout_s:g} s to render these "
                                f"messages", param="messages") from None
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling(CHAT, body, limit)
        job = await _submit(Job(tokens, params, n_keep=default_keep if n_keep is None else n_keep), request)
        meta = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model_id}
        if body.stream:
            return EventSourceResponse(_chat_stream(job, meta, _include_usage(body)), ping=15)
        pieces, n, finish = await _collect(job, request)
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
                             "logprobs": None, "finish_reason": finish}], "usage": _usage(job, n)}

    def _sampling(defaults: SamplingParams, body: _Request, max_tokens: Optional[int]) -> SamplingParams:
        changes = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")
                   if getattr(body, k) is not None}
        if body.stop is not None:
            changes["stop"] = body.stop
        if max_tokens is not None:
            changes["max_tokens"] = max_tokens
        elif defaults.max_tokens is None and not llm.policy.bounded:
            changes["max_tokens"] = None  # the full cache stops at the end of the context
        try:
            return defaults.replace(**changes)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e)) from None

    async def _submit(job: Job, request: Request) -> Job:
        if len(job.prompt_tokens) > max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(job.prompt_tokens)} tokens; this server takes at most "
                                f"{max_prompt_tokens}", param="messages", code="context_length_exceeded")
        if not llm.policy.bounded and len(job.prompt_tokens) >= llm._engine.stream_capacity:
            raise APIError(400, f"the prompt ({len(job.prompt_tokens)} tokens) does not fit in the context "
                                f"({llm._engine.stream_capacity} tokens per slot)", param="messages",
                           code="context_length_exceeded")
        job.loop = asyncio.get_running_loop()
        job.queue = asyncio.Queue()
        try:
            scheduler.submit(job)
        except Busy as e:
            raise APIError(429, str(e), kind="rate_limit_error", code="slots_busy") from None
        watcher = asyncio.ensure_future(_disconnected(request, job))  # a client may leave while it waits
        try:
            first = await job.queue.get()  # the prompt is in (or it failed): only now does the response start
        finally:
            watcher.cancel()
        if isinstance(first, Cancelled):
            raise APIError(499, "the client closed the request", code="client_closed")
        if isinstance(first, BaseException):
            raise APIError(400, str(first)) if isinstance(first, ValueError) else APIError(500, str(first), "server_error")
        job.reused_tokens = first[1]
        return job

    async def _events(job: Job) -> AsyncIterator[generation.Event]:
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, Cancelled):
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.token is None:
                    return
        finally:
            scheduler.cancel(job)  # a client that went away frees its slot at the next step

    async def _collect(job: Job, request: Request):
        pieces, n, finish = [], 0, None
        events = _events(job)
        watcher = asyncio.ensure_future(_disconnected(request, job))
        try:
            async for e in events:
                pieces.append(e.text)
                n += e.token is not None
                finish = e.finish_reason
        except RuntimeError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            watcher.cancel()
            await events.aclose()
        return pieces, n, finish

    async def _disconnected(request: Request, job: Job) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        scheduler.cancel(job)

    async def _completion_stream(job: Job, meta: Dict[str, Any], echo: str, usage: bool):
        n = 0
        if echo:
            yield json.dumps({**meta, "choices": [{"text": echo, "index": 0, "logprobs": None, "finish_reason": None}]})
        async for e in _events(job):
            n += e.token is not None
            yield json.dumps({**meta, "choices": [{"text": e.text, "index": 0, "logprobs": None,
                                                   "finish_reason": e.finish_reason}]})
        if usage:
            yield json.dumps({**meta, "choices": [], "usage": _usage(job, n)})
        yield "[DONE]"

    async def _chat_stream(job: Job, meta: Dict[str, Any], usage: bool):
        base = {**meta, "object": "chat.completion.chunk"}
        yield json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
        n = 0
        async for e in _events(job):
            n += e.token is not None
            if e.text:
                yield json.dumps({**base, "choices": [{"index": 0, "delta": {"content": e.text}, "logprobs": None,
                                                       "finish_reason": None}]})
            if e.token is None:
                yield json.dumps({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                       "finish_reason": e.finish_reason}]})
        if usage:
            yield json.dumps({**base, "choices": [], "usage": _usage(job, n)})
        yield "[DONE]"

    return app


def _include_usage(body: _Request) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def _usage(job: Job, n_completion: int) -> Dict[str, Any]:
    n_prompt = len(job.prompt_tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": job.reused_tokens}}
