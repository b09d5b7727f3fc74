"""Ollama's API on the same slots: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version.

A request is translated into the chat request the server already takes (its messages, its `options` as sampling
fields, `format` as a grammar, `tools`) and runs as any other, bounded cache, saved conversations and limits
included; the answer comes back in Ollama's shapes: one JSON object, or with `stream` (Ollama's default) one JSON
object per line as it is generated, the last with `done: true` and the counts. Errors are Ollama's {"error": "..."}.
The server runs one model, whatever name a request gives (as its OpenAI routes do)."""
from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Union

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .. import __version__, reasoning
from ..completions import infill_prompt
from . import answers
from .protocol import APIError, ChatCompletionRequest
from .scheduler import Job
from .translated import validated
from .state import ServerState

router = APIRouter()
server_state = answers.server_state

# Ollama's options that sample, by the chat request's field names
SAMPLING_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "typical_p": "typical_p", "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "mirostat": "mirostat", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta",
                    "seed": "seed", "stop": "stop"}
# the request's name of a chat request's field that comes from an option
OPTION_OF_FIELD = {field: f"options.{option}"
                   for option, field in {**SAMPLING_OPTIONS, "num_predict": "max_tokens"}.items()}
# its options that load a model or shape its context: this server's model, cache and threads are set when it starts
# (num_ctx included: the cache is bounded by its budget), so they are ignored, as Ollama ignores what it cannot
# change; tfs_z and penalize_newline are ignored as llama.cpp removed them
IGNORED_OPTIONS = frozenset({"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                             "tfs_z", "penalize_newline"})


class _OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Ollama ignores fields it does not know (keep_alive, ...)

    model: str = ""
    stream: bool = True  # Ollama streams unless told not to
    format: Union[str, Dict[str, Any], None] = None  # "json", or a JSON schema
    options: Optional[Dict[str, Any]] = None
    think: Union[bool, str, None] = None
    # as on the OpenAI routes: saved conversations are continued only by requests with the same salt
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)


class OllamaChat(_OllamaRequest):
    messages: List[Dict[str, Any]] = Field(default_factory=list)
    tools: Optional[List[Dict[str, Any]]] = None


class OllamaGenerate(_OllamaRequest):
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False  # the prompt as it is, without the chat template
    context: Optional[List[int]] = None  # the tokens of an earlier answer's prompt and answer, read first
    suffix: Optional[str] = None
    template: Optional[str] = None
    images: Optional[List[Any]] = None


@router.post("/api/chat")
async def chat(request: Request, state: ServerState = Depends(server_state)):
    """A conversation answered (its messages through the chat template, `tools` where the template has a call
    format); messages with images are refused: the models here read text."""
    try:
        body = await _parse(request, OllamaChat)
        if not body.messages:  # Ollama's way to load a model: nothing to answer
            return _done(body.model or state.model_id, {"message": {"role": "assistant", "content": ""}}, "load")
        messages = [openai_message(i, m) for i, m in enumerate(body.messages)]
        return await _answer(state, request, body, messages, body.tools)
    except APIError as e:
        return answers.ollama_error(e)


@router.post("/api/generate")
async def generate(request: Request, state: ServerState = Depends(server_state)):
    """A prompt answered: through the chat template as a user message (after `system`), or with `raw` as it is;
    `context` (an earlier answer's) is read first. The answer's `context` goes on from it."""
    try:
        body = await _parse(request, OllamaGenerate)
        if body.template:
            raise APIError(400, "template is not supported by this server", param="template")
        if body.images:
            raise APIError(400, "images are not supported: this server runs a text model", param="images")
        if not body.prompt and not body.context:  # Ollama's way to load a model
            return _done(body.model or state.model_id, {"response": ""}, "load")
        if body.suffix:  # fill-in-the-middle: the model's own tokens around the gap, not the chat template
            try:
                tokens = await state.prepared(infill_prompt, state.llm, body.prompt, body.suffix)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="suffix") from None
            return await _answer(state, request, body, None, None, prefix=body.context or (), prompt=tokens)
        if body.raw:
            messages = None
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [{"role": "user", "content": body.prompt}]
        return await _answer(state, request, body, messages, None, prefix=body.context or ())
    except APIError as e:
        return answers.ollama_error(e)


class OllamaPull(BaseModel):
    model_config = ConfigDict(extra="ignore")  # insecure, ...

    model: str = ""
    name: str = ""  # the older clients' field
    stream: bool = True


@router.post("/api/pull")
async def pull(request: Request, state: ServerState = Depends(server_state)):
    """Ollama's model download: this server runs the one model it was started with, so pulling that one succeeds
    at once (clients pull before they chat) and any other is a 404 naming the model it runs."""
    try:
        body = await _parse(request, OllamaPull)
        asked = body.model or body.name
        if asked and asked.removesuffix(":latest") != state.model_id.removesuffix(":latest"):
            raise APIError(404, f"model {asked!r} not found: this server runs {state.model_id!r} and does not pull "
                                f"models")
        if body.stream:
            return _Lines(_one({"status": "success"}), state.settings.stream_send_timeout_s)
        return {"status": "success"}
    except APIError as e:
        return answers.ollama_error(e)


@router.post("/api/create", include_in_schema=False)
@router.post("/api/copy", include_in_schema=False)
@router.post("/api/push", include_in_schema=False)
@router.delete("/api/delete", include_in_schema=False)
@router.post("/api/blobs/{digest}", include_in_schema=False)
@router.head("/api/blobs/{digest}", include_in_schema=False)
async def manage(state: ServerState = Depends(server_state)) -> JSONResponse:
    """Ollama's model management: refused here (the server runs the one model it was started with)."""
    return answers.ollama_error(APIError(403, f"this server runs the one model it was started with ({state.model_id}); it does "
                                f"not create, copy, push or delete models"))


@router.get("/api/tags")
async def tags(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    return {"models": [_model_card(state)]}


@router.get("/api/ps")
async def running(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    card = _model_card(state)
    return {"models": [{**card, "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0}]}


@router.post("/api/show")
async def show(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    llm = state.llm
    arch = llm.info.arch
    return {"template": llm.chat_template.source or "", "parameters": "", "modelfile": "",
            "details": _model_card(state)["details"],
            "model_info": {"general.architecture": arch, f"{arch}.context_length": llm.n_ctx_train(),
                           f"{arch}.embedding_length": llm.n_embd()},
            # tools work with every template: its own call format, or llama-server's generic fallback
            "capabilities": ["completion", "tools",
                             *(["thinking"] if reasoning.thinks(llm.chat_template.source) else [])]}


@router.get("/api/version")
async def version() -> Dict[str, Any]:
    return {"version": __version__}


# ---------------------------------------------------------------------------------------------------- helpers
async def _parse(request: Request, model: type) -> Any:
    """The body as `model`."""
    return validated(model, await answers.json_body(request))


def openai_message(i: int, m: Dict[str, Any]) -> Dict[str, Any]:
    """An Ollama message as the chat request takes it: images refused, tool calls' arguments as JSON text, a
    missing content empty, an answer's `thinking` as `reasoning_content` and a tool result's `tool_name` as `name`
    (the fields templates read)."""
    if not isinstance(m, dict):
        raise APIError(400, f"messages[{i}] must be an object", param=f"messages.{i}")
    if m.get("images"):
        raise APIError(400, "images are not supported: this server runs a text model", param=f"messages.{i}.images")
    out = {"content": "", **{k: v for k, v in m.items() if k in ("role", "content")}}  # Ollama's content: "" if none
    for ollama_name, name in (("thinking", "reasoning_content"), ("tool_name", "name")):
        if isinstance(m.get(ollama_name), str):
            out[name] = m[ollama_name]
    if m.get("tool_calls"):
        out["tool_calls"] = [_openai_call(i, j, c) for j, c in enumerate(_listed(m["tool_calls"], f"messages.{i}.tool_calls"))]
    return out


def _listed(value: Any, param: str) -> List[Any]:
    if not isinstance(value, list):
        raise APIError(400, f"{param} must be a list", param=param)
    return value


def _openai_call(i: int, j: int, call: Any) -> Dict[str, Any]:
    """An Ollama tool call ({"function": {"name", "arguments": {...}}}) as OpenAI's (arguments as JSON text)."""
    param = f"messages.{i}.tool_calls.{j}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{param}.function must be an object with a name (a string) and arguments (an object)",
                       param=f"{param}.function")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise APIError(400, f"{param}.function.arguments must be an object", param=f"{param}.function.arguments")
    return {"type": "function", "id": f"call_{i}_{j}",
            "function": {"name": function["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _chat_request(body: _OllamaRequest, messages: Optional[List[Dict[str, Any]]],
                  tools: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The OpenAI-shaped chat request of an Ollama one (its options as sampling fields, its format as a grammar)."""
    out: Dict[str, Any] = {"messages": messages or [{"role": "user", "content": ""}], "stream": False}
    # think: true gives the reasoning apart (message.thinking) and asks the template to think, false asks it not to
    # (enable_thinking: Qwen3 thinks unless told not to, Gemma 4 only when told to); unset, the answer is as the
    # model wrote it
    if body.think is not None and not isinstance(body.think, bool) and body.think not in ("low", "medium", "high"):
        raise APIError(400, f"think must be true, false, or a level (low, medium, high), got {body.think!r}",
                       param="think")
    if body.think is not None and messages is None:
        raise APIError(400, "think needs the chat template, which a raw prompt does not use", param="think")
    out["reasoning_format"] = "none" if body.think is None else "auto"
    if isinstance(body.think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": body.think}
    elif isinstance(body.think, str):  # gpt-oss's levels, as its template reads them
        out["chat_template_kwargs"] = {"reasoning_effort": body.think}
    for name, value in (body.options or {}).items():
        if name in SAMPLING_OPTIONS:
            out[SAMPLING_OPTIONS[name]] = value
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise APIError(400, f"options.num_predict must be an integer, got {value!r}",
                               param="options.num_predict")
            out["max_tokens"] = value if value >= 0 else None  # -1: until the end (within the server's cap)
        elif name not in IGNORED_OPTIONS:
            raise APIError(400, f"options.{name} is not an Ollama option", param=f"options.{name}")
    if body.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        out["json_schema"] = body.format
    elif body.format not in (None, ""):
        raise APIError(400, f"format must be \"json\" or a JSON schema, got {body.format!r}", param="format")
    if tools:
        out["tools"] = tools
    if body.cache_salt is not None:
        out["cache_salt"] = body.cache_salt
    return out


async def _answer(state: ServerState, request: Request, body: _OllamaRequest,
                  messages: Optional[List[Dict[str, Any]]], tools: Optional[List[Dict[str, Any]]],
                  prefix: Sequence[int] = (), prompt: Optional[List[int]] = None):
    """The request run as a chat (messages) or a raw prompt (messages None: `prompt`'s tokens, else `body.prompt`
    read as it is)."""
    started = time.perf_counter()
    source = state.template_source
    if body.think is not None and not reasoning.thinks(source):
        raise APIError(400, f"{state.model_id} does not think (its chat template has no think tags)", param="think")
    if isinstance(body.think, str) and not reasoning.harmony(source):
        raise APIError(400, f"think levels are gpt-oss's; {state.model_id} takes true or false", param="think")
    chat = validated(ChatCompletionRequest, _chat_request(body, messages, tools), OPTION_OF_FIELD)
    thinking = None
    if messages is None:
        job = await answers.prompt_job(state, chat, request, body.prompt if prompt is None else prompt, prefix=prefix,
                                      max_tokens=chat.max_tokens)
        plan = None
    else:
        job, plan, _, thinking = await answers.chat_job(state, chat, request, prefix=prefix)
    read = time.perf_counter()
    head = {"model": body.model or state.model_id}
    generating = isinstance(body, OllamaGenerate)
    if body.stream and (plan is None or not plan.parses):
        return _Lines(_stream(state, job, head, generating, started, read, thinking),
                      state.settings.stream_send_timeout_s)
    tokens: List[int] = []
    said = await answers.chat_answer(state, job, request, None if generating else plan, thinking, tokens=tokens)
    if generating:
        answer = {"response": said.content, **({"thinking": said.reasoning} if said.reasoning is not None else {})}
    else:
        answer = {"message": {"role": "assistant", "content": said.content or ""}}
        if said.reasoning is not None:
            answer["message"]["thinking"] = said.reasoning
        if said.calls:
            answer["message"]["tool_calls"] = ollama_calls(said.calls)
    final = _done(head["model"], answer, said.finish, _counts(job, tokens, generating, started, read))
    if body.stream:  # with tools the answer is parsed whole, then sent as one line
        return _Lines(_one(final), state.settings.stream_send_timeout_s)
    return final


def ollama_calls(calls: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """OpenAI's tool calls (arguments as JSON text) as Ollama returns them (arguments as an object)."""
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]


async def _stream(state: ServerState, job: Job, head: Dict[str, Any], generating: bool, started: float,
                  read: float, thinking: Optional[reasoning.Thinking] = None) -> AsyncIterator[str]:
    tokens: List[int] = []
    try:
        async for step, thought, text in answers.split_steps(state, job, thinking):
            e = step.event
            tokens += step.tokens
            if thought or text:
                extra = {"thinking": thought} if thought else {}
                piece = {"response": text, **extra} if generating else \
                    {"message": {"role": "assistant", "content": text, **extra}}
                yield json.dumps({**head, "created_at": _now(), **piece, "done": False}) + "\n"
            if e.token is None:
                empty = {"response": ""} if generating else {"message": {"role": "assistant", "content": ""}}
                counts = _counts(job, tokens, generating, started, read)
                yield json.dumps(_done(head["model"], empty, e.finish_reason, counts)) + "\n"
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error line, as Ollama's
        yield json.dumps({"error": answers.as_api_error(e).message}) + "\n"


async def _one(final: Dict[str, Any]) -> AsyncIterator[str]:
    yield json.dumps(final) + "\n"


def _counts(job: Job, tokens: List[int], generating: bool, started: float, read: float) -> Dict[str, Any]:
    """Ollama's counts and durations (nanoseconds); a generate answer's `context` goes on from its prompt."""
    end = time.perf_counter()
    out: Dict[str, Any] = {"total_duration": int((end - started) * 1e9), "load_duration": 0,
                           "prompt_eval_count": len(job.request.prompt_tokens),
                           "prompt_eval_duration": int((read - started) * 1e9),
                           "eval_count": job.progress.n_generated, "eval_duration": int((end - read) * 1e9)}
    if generating:
        out["context"] = list(job.request.prompt_tokens) + tokens
    return out


def _done(model: str, answer: Dict[str, Any], reason: Optional[str], counts: Optional[Dict[str, Any]] = None):
    return {"model": model, "created_at": _now(), **answer, "done": True, "done_reason": reason, **(counts or {})}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _model_card(state: ServerState) -> Dict[str, Any]:
    """The model as /api/tags lists it (its file's size and time; no digest is computed)."""
    path = state.llm.model_path
    stat = os.stat(path)
    modified = datetime.datetime.fromtimestamp(stat.st_mtime, datetime.timezone.utc).isoformat()
    arch = state.llm.info.arch
    return {"name": state.model_id, "model": state.model_id, "modified_at": modified, "size": stat.st_size,
            "digest": "", "details": {"format": "gguf", "family": arch, "families": [arch], "parameter_size": "",
                                      "quantization_level": ""}}


class _Lines(StreamingResponse):
    """Newline-delimited JSON, as Ollama streams; a client that reads nothing for `send_timeout_s` is dropped (its
    request's events wait merged in its mailbox meanwhile), as the server's event streams do."""

    def __init__(self, lines: AsyncIterator[str], send_timeout_s: float):
        super().__init__(lines, media_type="application/x-ndjson")
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            with anyio.fail_after(self.send_timeout_s):
                await send(message)
        await super().stream_response(timed)
