"""What every route module shares to answer a request: the body read (`json_body`), a chat or prompt request made
a `Job` and submitted (its prompt prepared in time, checked against the length limits), its steps read, its answer
collected or streamed as server-sent events, its usage, and the errors as APIError. The route modules (routes.py for
OpenAI's and llama-server's API, ollama.py, anthropic_messages.py, openai_responses.py, embeddings.py) import this,
never each other."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from .. import reasoning, responses
from .. import tools as tools_mod
from ..chat_template import check_variables
from ..completions import answer_markup, chat_logprobs_k, completion_prompt, prompt_end
from ..responses import TokenLogprob
from ..sampling import CHAT_SURFACE, SamplingParams
from . import requests
from .protocol import ROLES, APIError, ChatCompletionRequest, RequestFields
from .scheduler import Busy, Cancelled, Job, JobRequest, Mailbox, ShuttingDown, Step
from .state import ServerState


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def chat_job(state: ServerState, body: ChatCompletionRequest, request: Request,
                   prefix: Sequence[int] = ()) -> Tuple[Job, tools_mod.ToolPlan, Optional[int],
                                                         Optional[reasoning.Thinking]]:
    """A chat request checked, its prompt made and its job started (the prompt read): the job, its tools' plan,
    the top logprobs it asked for and how its answer's reasoning is split. `prefix`: token ids read before the
    chat's own (Ollama's `context`)."""
    body.refuse_unsupported()
    plan, tokens, n_keep = await chat_prompt(state, body)
    if plan.grammar is not None:
        given = [k for k in ("response_format", "grammar", "json_schema") if getattr(body, k) not in (None, "")]
        if given:
            raise APIError(400, f"a forced tool call and {given[0]} both constrain the answer: give one", param=given[0])
        body.grammar = plan.grammar
    if prefix:  # the protected prefix is the server's then: the chat's own system messages are not first
        try:
            tokens, n_keep = await state.prepared(completion_prompt, state.llm, list(prefix)) + tokens, None
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="context") from None
    try:
        k = chat_logprobs_k(body.logprobs, body.top_logprobs)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="top_logprobs") from None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    policy, view, recall = requests.conversation_cache(state, body)
    if view and plan.parses:
        raise APIError(400, "kv_cache.view streams the answer token by token; with tools it is parsed whole",
                       param="kv_cache.view")
    thinking = chat_thinking(state, body, tokens)
    params, sampler = await requests.sampling(state, CHAT_SURFACE, body, limit, tokens,
                                              preserved=answer_markup(state.llm, plan, thinking))
    asked = JobRequest(tokens, params, sampler=sampler, n_keep=state.default_keep if n_keep is None else n_keep,
                       policy=policy, view=view, recall=recall, time_limit_s=requests.time_limit(state, body),
                       cache_salt=body.cache_salt, logprobs=k)
    job = await submit(state, Job(asked), request, history=resent_history(body.messages))
    return job, plan, k, thinking


async def prompt_job(state: ServerState, body: RequestFields, request: Request, prompt: Union[str, List[int]], *,
                     prefix: Sequence[int] = (), defaults: SamplingParams = CHAT_SURFACE,
                     max_tokens: Optional[int] = None, logprobs: Optional[int] = None) -> Job:
    """A prompt read as it is (text, special tokens parsed, or token ids), after the token ids `prefix`, sampled
    from `defaults` and `body`'s fields (Ollama's raw generate, llama-server's /completion)."""
    body.refuse_unsupported()
    if isinstance(prompt, str):
        requests.check_prompt_bytes(state, len(prompt.encode("utf-8", errors="surrogatepass")), "prompt")
    try:
        tokens = list(await state.prepared(completion_prompt, state.llm, list(prefix))) if prefix else []
        if not tokens:  # a prompt of its own: with BOS where the model adds one
            tokens = await state.prepared(completion_prompt, state.llm, prompt)
        elif isinstance(prompt, str):  # going on after the context
            tokens += await state.prepared(state.llm.tokenize, prompt, add_bos=False, special=True)
        else:
            tokens += await state.prepared(state.llm.prompt_tokens, prompt)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="context" if prefix else "prompt") from None
    policy, view, recall = requests.conversation_cache(state, body)
    params, sampler = await requests.sampling(state, defaults, body, max_tokens, tokens)
    asked = JobRequest(tokens, params, sampler=sampler, n_keep=state.default_keep, policy=policy, view=view,
                       recall=recall, time_limit_s=requests.time_limit(state, body), cache_salt=body.cache_salt,
                       logprobs=logprobs)
    return await submit(state, Job(asked), request)


def chat_messages(state: ServerState,
                   body: ChatCompletionRequest) -> Tuple[tools_mod.ToolPlan, List[Dict[str, Any]]]:
    """The request's messages checked (roles, their text's bytes) and as the template takes them, with its tools'
    plan (how they are described, forced and parsed)."""
    for i, m in enumerate(body.messages):
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got "
                                f"{repr(m.get('role'))[:64]}", param=f"messages.{i}.role")
    for param, check in (("chat_template_kwargs", lambda: check_variables(body.chat_template_kwargs)),
                         ("reasoning_format", lambda: reasoning.check_format(body.reasoning_format or "auto"))):
        try:
            check()
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param=param) from None
    if body.tools == [] and body.tool_choice in (None, "none"):  # clients that send empty tools ask for nothing
        body.tools = None
    try:
        plan = tools_mod.plan(state.llm.chat_template, body.tools, body.tool_choice)
        messages = plan.messages(body.messages)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="tools" if body.tools is not None else "tool_choice") from None
    requests.check_prompt_bytes(state, sum(requests.text_bytes(m.get("content")) for m in messages), "messages",
                                history=resent_history(messages))
    return plan, messages


def resent_history(messages: List[Dict[str, Any]]) -> bool:
    """Whether a chat request resends a conversation: it holds an answer (OpenAI's, Ollama's and Anthropic's
    clients send the whole history each turn)."""
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


MAX_BODY_DEPTH = 256  # levels of objects and arrays a body read by json_body may nest (a tool's schema: a few dozen)


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects and arrays more than `limit` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


async def json_body(request: Request) -> Any:
    """A request's body read as JSON by a route that checks it itself (Ollama's, Anthropic's, the embeddings'): a
    400 for one not sent as JSON (curl -d's form content type is made JSON by the app's JSONBodies, except from a
    browser), not JSON, or nesting deeper than MAX_BODY_DEPTH (Python's parser refuses a depth that depends on its
    version: 1,500 levels on 3.11, more on some 3.12 builds, where a route that ignores the field went on)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise APIError(400, "send the body as JSON (Content-Type: application/json)")
    too_deep = APIError(400, f"the body nests too deeply to be read (at most {MAX_BODY_DEPTH} levels)")
    try:
        body = await request.json()
    except RecursionError:
        raise too_deep from None
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if isinstance(body, (dict, list)) and nests_deeper_than(body, MAX_BODY_DEPTH):
        raise too_deep
    return body


async def chat_prompt(state: ServerState,
                      body: ChatCompletionRequest) -> Tuple[tools_mod.ToolPlan, List[int], Optional[int]]:
    """A chat request's messages checked and made into its prompt (in the preparing threads): its tools' plan, the
    prompt's tokens and its protected prefix (`Llama.chat_tokens`)."""
    plan, messages = chat_messages(state, body)
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise APIError(400, "continue_final_message and add_generation_prompt are both true: a final assistant "
                            "message is either continued or answered", param="continue_final_message")
    prefill = body.continue_final_message or not body.add_generation_prompt  # a final assistant message goes on
    tokens, n_keep = await prepared_in_time(state, state.llm.chat_tokens, messages, tools=plan.template_tools,
                                             special_in_content=body.special_in_content,
                                             chat_template_kwargs=body.chat_template_kwargs, continue_final=prefill)
    return plan, tokens, n_keep


def chat_thinking(state: ServerState, body: ChatCompletionRequest,
                  tokens: Sequence[int]) -> Optional[reasoning.Thinking]:
    """How the request's answer is split into reasoning and content (reasoning_format, "auto" by default)."""
    return reasoning.thinking(body.reasoning_format or "auto", state.template_source,
                              prompt_end(state.llm, tokens))


async def prepared_in_time(state: ServerState, render: Callable[..., Any], messages: List[Dict[str, Any]],
                            **options: Any) -> Any:
    """`render(messages, time_limit_s=..., **options)` in the preparing threads: a template can be slow on some
    messages, so never on the event loop and never for longer than --template-timeout-s of its own time (then a
    400; its wait for a thread is not counted)."""
    limit_s = state.settings.template_timeout_s
    timed_out = lambda: APIError(400, f"preparing these messages (the chat template rendering them, then their "
                                      f"tokenization) took more than {limit_s:g} s (--template-timeout-s)",
                                 param="messages")
    try:
        return await state.prepare.run(render, messages, own_time_s=limit_s + 1, on_time_out=timed_out,
                                       time_limit_s=limit_s, **options)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None


async def submit(state: ServerState, job: Job, request: Request, history: bool = False) -> Job:
    """The job submitted once its prompt is read (or it failed). `history`: the prompt is a conversation a client
    resent (it holds an answer), which a bounded cache reads however long it is (its text within
    --max-history-bytes, checked before it was tokenized)."""
    key = request.scope.get("state", {}).get("api_key_id")
    if key is not None:  # each API key's conversations are its own (BearerAuth)
        job.request.cache_salt = f"key{key}:{job.request.cache_salt or ''}"
    check_prompt_length(state, job, history)
    job.mailbox = Mailbox(asyncio.get_running_loop())
    try:
        state.scheduler.submit(job)
    except Busy as e:
        raise APIError(429, str(e), kind="rate_limit_error", code="slots_busy") from None
    except ShuttingDown as e:
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    watcher = asyncio.ensure_future(disconnected(state, request, job))  # a client may leave while it waits
    try:
        job.progress.started = await job.mailbox.started()  # the prompt is in (or it failed): only now does the response start
    except Cancelled:
        raise APIError(499, "the client closed the request", code="client_closed") from None
    except ShuttingDown as e:
        raise APIError(503, str(e), "server_error", code="shutting_down") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - said as the request's error
        raise APIError(500, str(e), "server_error") from None
    finally:
        watcher.cancel()
    return job


def check_prompt_length(state: ServerState, job: Job, history: bool) -> None:
    """A full cache takes a prompt that fits its slot and --max-prompt-tokens. A bounded one reads what no saved
    conversation holds: at most --max-prompt-tokens of it, or any length where the prompt is a resent conversation
    (the bounded prefill reads it in the same memory; its bytes were checked)."""
    n = len(job.request.prompt_tokens)
    limit = state.max_prompt_tokens
    policy = job.request.policy or state.llm.policy
    if not policy.bounded:
        cells = state.scheduler.cells_per_slot
        if n > limit:
            raise APIError(400, f"the prompt has {n} tokens; this server takes at most {limit}", param="messages",
                           code="context_length_exceeded", extra={"n_prompt_tokens": n, "n_ctx": limit})
        if n >= cells:
            raise APIError(400, f"the prompt ({n} tokens) does not fit in the context ({cells} tokens per slot)",
                           param="messages", code="context_length_exceeded",
                           extra={"n_prompt_tokens": n, "n_ctx": cells - 1})
        return
    if n <= limit or history:
        return
    to_read = n - state.scheduler.held_tokens(job)
    if to_read > limit:
        raise APIError(400, f"the prompt has {n} tokens, {to_read} of them new to this server; it reads at most "
                            f"{limit} new tokens of a request (--max-prompt-tokens)", param="messages",
                       code="context_length_exceeded", extra={"n_prompt_tokens": to_read, "n_ctx": limit})


async def job_steps(state: ServerState, job: Job) -> AsyncIterator[Step]:
    """The job's steps: each event, with the cache's view when the job asked for it and its tokens' logprobs."""
    try:
        async for step in job.mailbox.steps():
            yield step
    except Cancelled:
        return
    finally:
        state.scheduler.cancel(job)  # a client that went away frees its slot at the next step


async def split_steps(state: ServerState, job: Job, thinking: Optional[reasoning.Thinking]
                      ) -> AsyncIterator[Tuple[Step, str, str]]:
    """The job's steps, each with its new text split into reasoning and answer by the template's thinking markers
    (all answer when the job has no thinking): what every stream loop reads, whatever shape its dialect gives it."""
    splitter = None if thinking is None else thinking.splitter()
    async for step in job_steps(state, job):
        thought, text = reasoning.pieces(splitter, step.event.text, end=step.event.token is None)
        yield step, thought, text


@dataclasses.dataclass
class ChatAnswer:
    """A chat's answer read whole: its reasoning (None: none), its text outside its calls (None: calls only), its
    calls (OpenAI's shape), why it ended, the text as generated and its tokens' logprob entries."""

    reasoning: Optional[str]
    content: Optional[str]
    calls: List[Dict[str, Any]]
    finish: Optional[str]
    text: str
    entries: List[TokenLogprob]


async def chat_answer(state: ServerState, job: Job, request: Request, plan: Optional[tools_mod.ToolPlan],
                      thinking: Optional[reasoning.Thinking], parallel_tool_calls: Optional[bool] = None,
                      tokens: Optional[List[int]] = None) -> ChatAnswer:
    """A chat job's answer, read whole and split: reasoning apart (`thinking`), calls parsed (`plan`; None: a raw
    prompt's answer, not parsed), at most one call where `parallel_tool_calls` is false."""
    pieces, finish, entries = await collect_answer(state, job, request, tokens)
    text = "".join(pieces)
    thought, answer = (None, text) if thinking is None else thinking.split(text)
    # off the event loop: a bounded cache lets an answer run on without end, and reading it is linear in its length
    content, calls = await state.prepared(plan.parse, answer) if plan is not None else (answer, [])
    if parallel_tool_calls is False:
        calls = calls[:1]
    return ChatAnswer(thought, content, calls, finish, text, entries)


async def collect_answer(state: ServerState, job: Job, request: Request,
                         tokens: Optional[List[int]] = None) -> Tuple[List[str], Optional[str], List[TokenLogprob]]:
    """The answer's text pieces, its finish reason and (with Job.logprobs) its tokens' logprobs; `tokens` gets its
    token ids."""
    pieces: List[str] = []
    finish = None
    entries: List[TokenLogprob] = []
    events = job_steps(state, job)
    watcher = asyncio.ensure_future(disconnected(state, request, job))
    try:
        async for step in events:
            pieces.append(step.event.text)
            finish = step.event.finish_reason
            if tokens is not None:
                tokens += step.tokens
            entries += step.logprobs
    except Exception as e:  # noqa: BLE001 - said as the request's error
        raise as_api_error(e) from None
    finally:
        watcher.cancel()
        await events.aclose()
    return pieces, finish, entries


def piece_text(llm) -> Callable[[int], str]:
    return lambda token: llm.token_to_piece(token).decode("utf-8", errors="replace")


def as_api_error(error: Exception) -> APIError:
    """A request that failed while it generated: its own input's fault (a grammar that cannot go on: 400) or the
    server's (500)."""
    if isinstance(error, ValueError):
        return APIError(400, str(error), code=requests.limit_code(error) or "generation_failed")
    return APIError(500, str(error), "server_error")


async def disconnected(state: ServerState, request: Request, job: Job) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    state.scheduler.cancel(job)


def event_stream(state: ServerState, chunks: AsyncIterator[Any]) -> EventSourceResponse:
    """Server-sent events; a client that reads none of them for stream_send_timeout_s is dropped (its request's
    events wait merged in its mailbox meanwhile)."""
    return EventSourceResponse(chunks, ping=15, send_timeout=state.settings.stream_send_timeout_s)


def job_usage(job: Job):
    """The request's usage, once its end was read (the scheduler counts its tokens as it delivers them)."""
    return responses.usage(len(job.request.prompt_tokens), job.progress.n_generated, cached=job.progress.reused_tokens, kv_cache=job.progress.kv_cache)


def ollama_error(e: APIError) -> JSONResponse:
    """An error in Ollama's shape (`{"error": message}`, which its clients show), for its routes."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)
