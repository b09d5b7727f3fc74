"""The HTTP routes: / (the chat page), /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions, as
importable functions on a module-level FastAPI router. Each request becomes a `Job` for the app's `Scheduler`; the response starts once its
prompt is in, so an error in the prompt is an HTTP error, not a broken stream."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse

from .. import generation, grammar, policies, responses
from .. import tools as tools_mod
from ..llama import Llama
from ..policies import Policy
from ..sampling import CHAT_SURFACE, COMPLETION, SamplingParams
from .protocol import ROLES, APIError, ChatCompletionRequest, CompletionRequest, _Request
from .scheduler import Busy, Cancelled, Job, Mailbox, Scheduler, Started, Viewed

View = Optional[Dict[str, Any]]
from .settings import ServerSettings

router = APIRouter()
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")  # the chat page: plain files, no build step


@dataclass
class ServerState:
    """What the routes share, kept on `app.state.server` by `create_app`."""

    llm: Llama
    scheduler: Scheduler
    settings: ServerSettings
    model_id: str
    max_prompt_tokens: int
    max_prompt_bytes: int                             # text longer than this cannot be max_prompt_tokens tokens
    max_tokens: int                                   # an answer's longest length (a bounded cache never fills up)
    default_keep: int                                 # the protected prefix of a completion (tokens)
    # requests are prepared here, off the event loop and with the GIL released where it is C++: chat templates
    # rendered, prompts tokenized, grammars parsed and checked
    prepare: concurrent.futures.ThreadPoolExecutor


def server_state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    """The chat page: a conversation streamed from /v1/chat/completions, with what its KV cache keeps beside it
    (kv_cache.view); policy and budget chosen per conversation."""
    return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers={"Cache-Control": "no-cache"})


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    return {"status": "ok", **state.scheduler.stats()}


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    """Prometheus' text format (server/metrics.py)."""
    return Response(generate_latest(state.scheduler.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    llm = state.llm
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": int(time.time()),
                                        "owned_by": "h2o_local", "policy": llm.policy.label, "budget": llm.budget,
                                        "policies": ["default", *sorted(n for n in policies.REGISTRY if n != "full")],
                                        "max_budget": _max_budget(state) if llm.policy.bounded else None}]}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    body.refuse_unsupported()
    llm = state.llm
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n=1)", param="prompt")
        prompt = prompt[0]
    try:
        if isinstance(prompt, str):  # special tokens parsed, as llama-cpp-python and llama-server do
            _check_prompt_bytes(state, len(prompt.encode("utf-8", errors="surrogatepass")), "prompt")
            tokens = await _prepared(state, llm.tokenize, prompt, add_bos=llm.info.add_bos, special=True)
            text = prompt
        else:
            tokens, text = [int(t) for t in prompt], None
            if any(not 0 <= t < llm.n_vocab() for t in tokens):
                raise ValueError(f"token ids must be in [0, {llm.n_vocab()})")
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="prompt") from None
    policy, view, recall = _conversation_cache(state, body)
    params, sampler = await _sampling(state, COMPLETION, body, body.max_tokens, tokens)
    job = await _submit(state, Job(tokens, params, sampler=sampler,
                                   n_keep=state.default_keep, policy=policy, view=view, recall=recall,
                                   time_limit_s=_time_limit(state, body), cache_salt=body.cache_salt), request)
    meta = responses.completion_meta(state.model_id)
    if body.echo and text is None:  # token ids: their text, as llama-cpp-python echoes it
        text = llm.detokenize(tokens).decode("utf-8", errors="replace")
    echo = text if body.echo else ""
    if body.stream:
        return _event_stream(state, _completion_stream(state, job, meta, echo, _include_usage(body)))
    pieces, finish = await _collect(state, job, request)
    return responses.completion(meta, echo + "".join(pieces), finish, _usage(job))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(server_state)):
    body.refuse_unsupported()
    for i, m in enumerate(body.messages):
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got "
                                f"{repr(m.get('role'))[:64]}", param=f"messages.{i}.role")
    if body.tools == [] and body.tool_choice in (None, "none"):  # clients that send empty tools ask for nothing
        body.tools = None
    try:
        plan = tools_mod.plan(state.llm.chat_template.source, body.tools, body.tool_choice)
        messages = plan.messages(body.messages)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="tools" if body.tools is not None else "tool_choice") from None
    if plan.grammar is not None:
        given = [k for k in ("response_format", "grammar", "json_schema") if getattr(body, k) not in (None, "")]
        if given:
            raise APIError(400, f"a forced tool call and {given[0]} both constrain the answer: give one", param=given[0])
        body.grammar = plan.grammar
    _check_prompt_bytes(state, sum(_text_bytes(m.get("content")) for m in messages), "messages")
    limit_s = state.settings.template_timeout_s
    try:  # a template can be slow on some messages: never on the event loop, and never for long
        rendering = _prepared(state, state.llm.chat_tokens, messages, limit_s, tools=plan.tools,
                              special_in_content=body.special_in_content)
        tokens, n_keep = await asyncio.wait_for(rendering, limit_s + 1)
    except asyncio.TimeoutError:
        raise APIError(400, f"preparing these messages (the chat template rendering them, then their tokenization) "
                            f"took more than {limit_s:g} s (--template-timeout-s)", param="messages") from None
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    policy, view, recall = _conversation_cache(state, body)
    if view and plan.parses:
        raise APIError(400, "kv_cache.view streams the answer token by token; with tools it is parsed whole",
                       param="kv_cache.view")
    params, sampler = await _sampling(state, CHAT_SURFACE, body, limit, tokens)
    job = await _submit(state, Job(tokens, params, sampler=sampler,
                                   n_keep=state.default_keep if n_keep is None else n_keep, policy=policy, view=view,
                                   recall=recall,
                                   time_limit_s=_time_limit(state, body), cache_salt=body.cache_salt),
                        request)
    meta = responses.chat_meta(state.model_id)
    if body.stream and not plan.parses:
        return _event_stream(state, _chat_stream(state, job, meta, _include_usage(body)))
    pieces, finish = await _collect(state, job, request)
    content, calls = plan.parse("".join(pieces))
    if body.parallel_tool_calls is False:
        calls = calls[:1]
    out = responses.chat_completion(meta, content, "tool_calls" if calls else finish, _usage(job),
                                    tool_calls=calls)
    if body.stream:  # with tools the answer is parsed whole, then streamed
        return _event_stream(state, _whole_stream(meta, out, _include_usage(body)))
    return out


# ---------------------------------------------------------------------------------------------------- helpers
def _conversation_cache(state: ServerState, body: _Request) -> Tuple[Optional[Policy], bool, Optional[bool]]:
    """The request's own policy (None: the server's), whether it asked for the live view, and its recall setting
    (None: the server's) (`kv_cache`)."""
    policy, view = _conversation_policy(state, body)
    asked = None if body.kv_cache is None else body.kv_cache.recall
    try:
        if asked:
            state.llm.check_recall(policy)
        elif asked is None and state.llm.recall and policy is not None:
            state.llm.check_recall(policy)  # the server recalls where a conversation's own policy can
    except ValueError as e:
        if asked:
            raise APIError(400, f"kv_cache.recall: {e}", param="kv_cache.recall") from None
        asked = False
    return policy, view, asked


def _conversation_policy(state: ServerState, body: _Request) -> Tuple[Optional[Policy], bool]:
    """The request's own policy (None: the server's) and whether it asked for the live view."""
    asked = body.kv_cache
    if asked is None:
        return None, False
    llm = state.llm
    if asked.view and not body.stream:
        raise APIError(400, "kv_cache.view needs stream: true (the view comes with every streamed chunk)",
                       param="kv_cache.view")
    if asked.view and llm.position_rolling:
        raise APIError(400, "kv_cache.view shows kept entries as token indices; this server rolls positions "
                            "(--position-rolling)", param="kv_cache.view")
    if asked.policy is None and asked.budget is None:
        return None, asked.view
    if not llm.policy.bounded:
        raise APIError(400, "this server keeps the full cache; start it with a budget to choose a policy per "
                            "conversation", param="kv_cache")
    name, budget = asked.policy, asked.budget
    try:
        if name is not None and (name == "full" or "-" in name):  # a label: it carries its budget
            if budget is not None:
                raise ValueError(f"the label {name!r} carries its budget; give kv_cache.budget with a policy name")
            value = policies.parse(name)
        else:
            server = llm.policy
            if name is None:  # the server's kind of policy, with this budget
                name = "default" if server.label == policies.resolve(None, server.budget).label else server.name
            value = policies.resolve(None if name == "default" else name, budget or llm.budget)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"kv_cache.policy: {e}", param="kv_cache.policy") from None
    if not value.bounded:
        raise APIError(400, "kv_cache.policy: a slot holds a bounded cache; 'full' cannot run in it",
                       param="kv_cache.policy")
    limit = _max_budget(state, value)
    if limit < 1:
        raise APIError(400, f"kv_cache.policy: its probe takes {state.llm.probe_cells(value)} cells, more "
                            f"than a slot of this server has ({state.scheduler.slots.cells_per_slot})",
                       param="kv_cache.policy")
    if value.budget > limit:
        raise APIError(400, f"kv_cache.budget: {value.budget} entries do not fit in a slot of this server; at most "
                            f"{limit} with policy {value.name}", param="kv_cache.budget")
    if value.needs_scores and not llm.policy.needs_scores and not llm.export_scores:
        raise APIError(400, f"kv_cache.policy: {value.name} ranks by attention scores, which this server does not "
                            f"export (start it with --export-scores or a scoring policy)", param="kv_cache.policy")
    return value, asked.view


def _max_budget(state: ServerState, policy: Optional[Policy] = None) -> int:
    """The largest budget a conversation can take in a slot (with `policy`'s probe; default: the server's)."""
    return state.scheduler.slots.cells_per_slot - 1 - state.llm.probe_cells(policy)


def _prepared(state: ServerState, fn, *args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
    """`fn(*args, **kwargs)` in the server's preparing threads, off the event loop (await it)."""
    return asyncio.get_running_loop().run_in_executor(state.prepare, lambda: fn(*args, **kwargs))


def _text_bytes(content: Any) -> int:
    """The bytes of a message's text (a string, or a list of text parts)."""
    if isinstance(content, str):
        return len(content.encode("utf-8", errors="surrogatepass"))
    if isinstance(content, list):
        return sum(_text_bytes(part.get("text") if isinstance(part, dict) else part) for part in content)
    return 0


def _check_prompt_bytes(state: ServerState, n_bytes: int, param: str) -> None:
    """Text that cannot fit in max_prompt_tokens is refused before anything tokenizes it."""
    if n_bytes > state.max_prompt_bytes:
        raise APIError(400, f"the prompt's text has {n_bytes} bytes, more than {state.max_prompt_tokens} tokens "
                            f"of this model can hold; this server takes at most {state.max_prompt_tokens} tokens",
                       param=param, code="context_length_exceeded")


async def _sampling(state: ServerState, defaults: SamplingParams, body: _Request, max_tokens: Optional[int],
                    tokens: List[int]) -> Tuple[SamplingParams, Any]:
    """The request's sampling parameters, and with a grammar its sampler, made (the grammar parsed and checked
    against the vocabulary) in the preparing threads: a grammar that does not parse, allows nothing or needs more
    work than allowed is the request's 400, here."""
    changes: Dict[str, Any] = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                              "presence_penalty", "frequency_penalty", "repeat_penalty")
                               if getattr(body, k) is not None}
    if body.repetition_penalty is not None:
        if body.repeat_penalty is not None and body.repeat_penalty != body.repetition_penalty:
            raise APIError(400, "repeat_penalty and repetition_penalty differ: give one", param="repetition_penalty")
        changes["repeat_penalty"] = body.repetition_penalty
    if body.repeat_last_n is not None:
        changes["penalty_last_n"] = body.repeat_last_n
    given = [k for k in ("response_format", "grammar", "json_schema") if getattr(body, k) not in (None, "")]
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(given)}, not several", param=given[1])
    limits = state.settings.grammar_limits()
    changes["grammar_limits"] = limits
    try:
        if body.grammar:
            changes["grammar"] = body.grammar
        elif body.json_schema is not None:
            changes["grammar"] = grammar.json_schema_grammar(body.json_schema, limits)
        elif body.response_format is not None:
            changes["grammar"] = grammar.response_format_grammar(body.response_format, limits)
    except ValueError as e:
        raise APIError(400, str(e), param=given[0], code=_limit_code(e)) from None
    if body.logit_bias:
        n_vocab = state.llm.n_vocab()
        bias = {int(k): v for k, v in body.logit_bias.items()}
        outside = [k for k in bias if k >= n_vocab]
        if outside:
            raise APIError(400, f"logit_bias names token {outside[0]}, outside this model's {n_vocab} tokens",
                           param="logit_bias")
        changes["logit_bias"] = bias
    if body.ignore_eos:
        changes["ignore_eos"] = True
    if body.stop is not None:
        changes["stop"] = body.stop
    # a bounded cache never fills up: without a cap a model that never ends would hold its slot for good
    asked = max_tokens if max_tokens is not None else defaults.max_tokens  # None: no limit asked for
    changes["max_tokens"] = state.max_tokens if asked is None else min(asked, state.max_tokens)
    try:
        params = defaults.replace(**changes)
        if not params.grammar:
            return params, None
        return params, await _prepared(state, state.llm.sampler, params, history=tokens)
    except (TypeError, ValueError) as e:
        named = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        param = given[0] if given and "grammar" in str(e) else named if named in type(body).model_fields else None
        raise APIError(400, str(e), param=param, code=_limit_code(e)) from None


def _time_limit(state: ServerState, body: _Request) -> float:
    """Seconds the request may generate: the server's limit, or less when the request asks (t_max_predict_ms)."""
    limit = state.settings.request_time_limit_s
    return limit if body.t_max_predict_ms is None else min(limit, body.t_max_predict_ms / 1000)


def _limit_code(error: Exception) -> Optional[str]:
    return "grammar_too_large" if isinstance(error, grammar.GrammarTooLarge) else None


async def _submit(state: ServerState, job: Job, request: Request) -> Job:
    n = len(job.prompt_tokens)
    if n > state.max_prompt_tokens:
        raise APIError(400, f"the prompt has {n} tokens; this server takes at most {state.max_prompt_tokens}",
                       param="messages", code="context_length_exceeded")
    cells = state.scheduler.slots.cells_per_slot
    if not state.llm.policy.bounded and n >= cells:
        raise APIError(400, f"the prompt ({n} tokens) does not fit in the context ({cells} tokens per slot)",
                       param="messages", code="context_length_exceeded")
    job.mailbox = Mailbox(asyncio.get_running_loop())
    try:
        state.scheduler.submit(job)
    except Busy as e:
        raise APIError(429, str(e), kind="rate_limit_error", code="slots_busy") from None
    watcher = asyncio.ensure_future(_disconnected(state, request, job))  # a client may leave while it waits
    try:
        first = await job.mailbox.get()  # the prompt is in (or it failed): only now does the response start
    finally:
        watcher.cancel()
    if isinstance(first, Cancelled):
        raise APIError(499, "the client closed the request", code="client_closed")
    if isinstance(first, BaseException):
        raise APIError(400, str(first)) if isinstance(first, ValueError) else APIError(500, str(first), "server_error")
    assert isinstance(first, Started)
    job.started = first
    return job


async def _events(state: ServerState, job: Job) -> AsyncIterator[Tuple[generation.Event, View]]:
    """The job's events, each with the cache's view when the job asked for it (else None)."""
    try:
        while True:
            item = await job.mailbox.get()
            if isinstance(item, Cancelled):
                return
            if isinstance(item, BaseException):
                raise item
            event, view = (item.event, item.view) if isinstance(item, Viewed) else (item, None)
            yield event, view
            if event.token is None:
                return
    finally:
        state.scheduler.cancel(job)  # a client that went away frees its slot at the next step


async def _collect(state: ServerState, job: Job, request: Request) -> Tuple[List[str], Optional[str]]:
    pieces: List[str] = []
    finish = None
    events = _events(state, job)
    watcher = asyncio.ensure_future(_disconnected(state, request, job))
    try:
        async for e, _ in events:
            pieces.append(e.text)
            finish = e.finish_reason
    except Exception as e:  # noqa: BLE001 - said as the request's error
        raise _failed(e) from None
    finally:
        watcher.cancel()
        await events.aclose()
    return pieces, finish


def _failed(error: Exception) -> APIError:
    """A request that failed while it generated: its own input's fault (a grammar that cannot go on: 400) or the
    server's (500)."""
    if isinstance(error, ValueError):
        return APIError(400, str(error), code=_limit_code(error) or "generation_failed")
    return APIError(500, str(error), "server_error")


async def _disconnected(state: ServerState, request: Request, job: Job) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    state.scheduler.cancel(job)


async def _completion_stream(state: ServerState, job: Job, meta: Dict[str, Any], echo: str, usage: bool):
    first = _viewed(responses.completion_chunk(meta, echo), job.started.view)
    if echo or first.get("kv_cache"):
        yield json.dumps(first)
    try:
        async for e, view in _events(state, job):
            yield json.dumps(_viewed(responses.completion_chunk(meta, e.text, e.finish_reason), view))
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, as llama-server's
        yield json.dumps(_failed(e).body())
        return
    if usage:
        yield json.dumps(responses.usage_chunk(meta, _usage(job), chat=False))
    yield "[DONE]"


async def _chat_stream(state: ServerState, job: Job, meta: Dict[str, Any], usage: bool):
    yield json.dumps(_viewed(responses.chat_chunk(meta, {"role": "assistant", "content": ""}), job.started.view))
    try:
        async for e, view in _events(state, job):
            if e.text or (view is not None and e.token is not None):  # the view goes with every token
                yield json.dumps(_viewed(responses.chat_chunk(meta, {"content": e.text}), view))
            if e.token is None:
                yield json.dumps(_viewed(responses.chat_chunk(meta, {}, e.finish_reason), view))
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, as llama-server's
        yield json.dumps(_failed(e).body())
        return
    if usage:
        yield json.dumps(responses.usage_chunk(meta, _usage(job), chat=True))
    yield "[DONE]"


def _event_stream(state: ServerState, chunks: AsyncIterator[str]) -> EventSourceResponse:
    """Server-sent events; a client that reads none of them for stream_send_timeout_s is dropped (its request's
    events wait merged in its mailbox meanwhile)."""
    return EventSourceResponse(chunks, ping=15, send_timeout=state.settings.stream_send_timeout_s)


def _viewed(chunk: Dict[str, Any], view: View) -> Dict[str, Any]:
    """A chunk with the cache's view (`kv_cache`, an extension field) when the request asked for it."""
    if view is not None:
        chunk["kv_cache"] = view
    return chunk


async def _whole_stream(meta: Dict[str, Any], out: Dict[str, Any], usage: bool):
    for chunk in responses.chat_completion_chunks(meta, out):
        yield json.dumps(chunk)
    if usage:
        yield json.dumps(responses.usage_chunk(meta, out["usage"], chat=True))
    yield "[DONE]"


def _include_usage(body: _Request) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def _usage(job: Job):
    """The request's usage, once its end was read (the scheduler counts its tokens as it delivers them)."""
    return responses.usage(len(job.prompt_tokens), job.n_generated, cached=job.reused_tokens, kv_cache=job.kv_cache)
