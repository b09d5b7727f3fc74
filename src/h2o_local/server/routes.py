"""The HTTP routes: / (the chat page), /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions, and
llama-server's own (/completion, /tokenize, /detokenize, /apply-template, /props) and llama-cpp-python's
(/extras/...), as importable functions on a module-level FastAPI router. Each request is translated (`requests`) into a `Job` for the
app's `Scheduler`; the response starts once its prompt is in, so an error in the prompt is an HTTP error, not a
broken stream."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Union

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__, policies, reasoning, responses
from ..completions import completion_tokens, infill_prompt
from ..responses import TokenLogprob
from ..sampling import COMPLETION, SamplingParams
from . import requests
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       ExtrasTokenizeRequest, InfillRequest, LlamaServerCompletionRequest, TokenizeRequest,
                       RequestFields)
from .answers import (as_api_error, chat_answer, chat_job, chat_messages, collect_answer, event_stream,
                      job_steps, job_usage, piece_text, prepared_in_time, prompt_job, server_state, split_steps,
                      submit)
from .scheduler import Job, JobRequest
from .state import ServerState

View = Optional[Dict[str, Any]]

router = APIRouter()
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")  # the chat page: plain files, no build step


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    """The chat page: a conversation streamed from /v1/chat/completions, with what its KV cache keeps beside it
    (kv_cache.view); policy and budget chosen per conversation."""
    return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers={"Cache-Control": "no-cache"})


@router.get("/health")
@router.get("/v1/health", include_in_schema=False)  # llama-server's alias
async def health(request: Request, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """Public (as llama-server's, for container probes): with an API key set, its slot counts only for a request
    that gave the key."""
    if state.settings.api_key and not _keyed(request):
        return {"status": "ok"}
    return {"status": "ok", **state.scheduler.stats()}


# when the server started, seconds since the epoch (llama-server's /metrics header): this module's import, which
# comes before the model loads
PROCESS_START = int(time.time())


def _keyed(request: Request) -> bool:
    return request.scope.get("state", {}).get("api_key_id") is not None


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    """Prometheus' text format (server/metrics.py): ours, then llama-server's `llamacpp:*` lines; the process's
    start in the Process-Start-Time-Unix header, as llama-server sends it."""
    m = state.scheduler.metrics
    text = generate_latest(m.registry) + (m.llama_server.text().encode() if m.llama_server is not None else b"")
    return Response(text, media_type=CONTENT_TYPE_LATEST, headers={"Process-Start-Time-Unix": str(PROCESS_START)})


@router.get("/props")
async def props(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-server's server properties, as far as they apply: the longest prompt a slot takes (`n_ctx`: with a
    bounded cache longer than the slot's cells, `kv_cache.cells_per_slot`, since the policy evicts as it reads),
    /completion's default sampling (`n_predict`: the most a request may generate), the slots, the chat template.
    `model_path` is the model file's name, not its path on this machine."""
    d = LLAMA_SERVER
    params = {"n_predict": state.max_tokens, "max_tokens": state.max_tokens, "temperature": d.temperature,
              "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p, "typical_p": d.typical_p,
              "repeat_last_n": d.penalty_last_n, "repeat_penalty": d.repeat_penalty,
              "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
              "mirostat": d.mirostat_mode, "mirostat_tau": d.mirostat_tau, "mirostat_eta": d.mirostat_eta,
              "n_keep": state.default_keep, "ignore_eos": d.ignore_eos, "stop": [],
              "seed": -1 if state.settings.seed is None else state.settings.seed}  # -1: each request its own
    llm, cells = state.llm, state.scheduler.cells_per_slot
    n_ctx = state.max_prompt_tokens if llm.policy.bounded else min(cells - 1, state.max_prompt_tokens)
    return {"default_generation_settings": {"n_ctx": n_ctx, "params": params},
            "total_slots": state.scheduler.n_slots, "model_path": os.path.basename(llm.model_path),
            "chat_template": llm.chat_template.source or "", "modalities": {"vision": False, "audio": False},
            "build_info": f"h2o_local {__version__}",
            "kv_cache": {"policy": llm.policy.label, "budget": llm.budget, "cells_per_slot": cells}}


@router.get("/v1/models")
@router.get("/models", include_in_schema=False)  # llama-server's alias, for a client given the server without /v1
async def list_models(state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """OpenAI's model retrieval: the one model this server runs, by its id."""
    if model != state.model_id:
        raise APIError(404, f"the model {model[:256]!r} does not exist; this server runs {state.model_id!r}",
                       param="model", code="model_not_found")
    return _model_card(state)


def _model_card(state: ServerState) -> Dict[str, Any]:
    """The model as /v1/models shows it: OpenAI's fields, and the cache it runs with (policy, budget, the policies
    a conversation may choose and the largest budget a slot takes)."""
    llm = state.llm
    return {"id": state.model_id, "object": "model", "created": int(time.time()), "owned_by": "h2o_local",
            "policy": llm.policy.label, "budget": llm.budget,
            "policies": ["default", *sorted(n for n in policies.REGISTRY if n != "full")],
            "max_budget": requests.max_budget(state) if llm.policy.bounded else None}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    """OpenAI's completions. A list of prompts and `n` > 1 give a choice each (prompt by prompt, then sample by
    sample: index = prompt * n + sample), decoded together in the slots as separate requests would be; a sample
    after the first of a prompt draws with `seed` + its number where a seed is given."""
    body.refuse_unsupported()
    prompts = body.prompts()
    if len(prompts) * body.n == 1:
        return await _completion(state, body, request, prompts[0])
    if body.stream:
        raise APIError(400, "several prompts or n > 1 are answered whole: send stream: false", param="stream")
    asks = [body.model_copy(update={"prompt": p}) for p in prompts]
    outs = await _samples(state, body, request, asks, lambda b: _completion(state, b, request, b.prompt))
    use = responses.usage(sum(outs[i]["usage"]["prompt_tokens"] for i in range(0, len(outs), body.n)),
                          sum(o["usage"]["completion_tokens"] for o in outs))
    return {**outs[0], "choices": [{**o["choices"][0], "index": i} for i, o in enumerate(outs)], "usage": use}


async def _completion(state: ServerState, body: CompletionRequest, request: Request, prompt: Any):
    """One prompt's completion: the response, or with `stream` its event stream."""
    llm = state.llm
    try:
        if isinstance(prompt, str):  # special tokens parsed, as llama-cpp-python and llama-server do
            requests.check_prompt_bytes(state, requests.text_bytes(prompt) + requests.text_bytes(body.suffix or ""),
                                        "prompt")
            text = prompt
        else:
            text = None
        tokens = await state.prepared(completion_tokens, llm, prompt, body.suffix, body.echo)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="suffix" if body.suffix else "prompt") from None
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs:
        requests.check_echo_logprobs(state, len(tokens))
    policy, view, recall = requests.conversation_cache(state, body)
    params, sampler = await requests.sampling(state, COMPLETION, body, body.max_tokens, tokens)
    asked = JobRequest(tokens, params, sampler=sampler, n_keep=state.default_keep, policy=policy, view=view,
                       recall=recall, time_limit_s=requests.time_limit(state, body), cache_salt=body.cache_salt,
                       logprobs=body.logprobs, echo_logprobs=echo_logprobs)
    job = await submit(state, Job(asked), request)
    prompt_entries = []
    if echo_logprobs:  # made here, off the decoding thread; the logits are let go at once
        rows, job.progress.started = job.progress.started.prompt_logits, dataclasses.replace(job.progress.started, prompt_logits=None)
        prompt_entries = await state.prepared(responses.prompt_logprobs, rows, tokens, body.logprobs or 0)
        del rows
    meta = responses.completion_meta(state.model_id)
    if body.echo and text is None:  # token ids: their text, as llama-cpp-python echoes it
        text = llm.detokenize(tokens).decode("utf-8", errors="replace")
    echo = text if body.echo else ""
    piece = piece_text(llm)
    if body.stream:
        return event_stream(state, _completion_stream(state, job, meta, echo, prompt_entries, _include_usage(body),
                                                       piece))
    pieces, finish, entries = await collect_answer(state, job, request)
    logprobs = None
    if body.logprobs is not None:
        entries = responses.shown_logprobs(llm.token_to_piece, entries, "".join(pieces))
        shown = (tokens if body.echo else []) + [e.token for e in entries]
        offsets = list(itertools.accumulate((len(piece(t)) for t in shown[:-1]), initial=0)) if shown else []
        logprobs = responses.completion_logprobs(piece, shown, prompt_entries + entries, offsets)
    return responses.completion(meta, echo + "".join(pieces), finish, job_usage(job), logprobs)


@router.post("/v1/chat/completions")
@router.post("/chat/completions", include_in_schema=False)  # llama-server's alias
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(server_state)):
    """OpenAI's chat completions; `n` > 1 gives n choices, decoded together as n requests would be (answered whole;
    sample k draws with `seed` + k where a seed is given)."""
    if body.n == 1:
        return await _chat_completion(state, body, request)
    if body.stream:
        raise APIError(400, "n > 1 is answered whole: send stream: false", param="stream")
    outs = await _samples(state, body, request, [body], lambda b: _chat_completion(state, b, request))
    use = responses.usage(outs[0]["usage"]["prompt_tokens"], sum(o["usage"]["completion_tokens"] for o in outs))
    return {**outs[0], "choices": [{**o["choices"][0], "index": i} for i, o in enumerate(outs)], "usage": use}


async def _samples(state: ServerState, body: Any, request: Request, asks: List[Any],
                   answer: Callable[[Any], Any]) -> List[Any]:
    """`answer(ask)` for each of `asks` (one per prompt) n times, all at once as separate requests, in order (ask by
    ask, sample by sample); a sample after the first draws with `seed` + its number where a seed is given."""
    most = state.scheduler.n_slots + state.scheduler.max_waiting
    if len(asks) * body.n > most:
        raise APIError(400, f"{len(asks)} prompts x n={body.n} make {len(asks) * body.n} answers; this server takes "
                            f"at most {most} at once (its slots and waiting line)", param="n" if len(asks) == 1
                       else "prompt")
    seed = body.seed if body.seed is not None else state.settings.seed  # the request's, or the server's --seed
    seeded = [a if seed is None or k == 0 else a.model_copy(update={"seed": seed + k})
              for a in asks for k in range(body.n)]
    outs = await asyncio.gather(*(answer(a) for a in seeded), return_exceptions=True)
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return outs


async def _chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request):
    job, plan, k, thinking = await chat_job(state, body, request)
    meta = responses.chat_meta(state.model_id)
    if body.stream and not plan.parses:
        return event_stream(state, _chat_stream(state, job, meta, _include_usage(body), thinking))
    answer = await chat_answer(state, job, request, plan, thinking, body.parallel_tool_calls)
    logprobs = None
    if k is not None:
        piece = state.llm.token_to_piece
        logprobs = responses.chat_logprobs(piece, responses.shown_logprobs(piece, answer.entries, answer.text))
    out = responses.chat_completion(meta, answer.content, "tool_calls" if answer.calls else answer.finish,
                                    job_usage(job), tool_calls=answer.calls, logprobs=logprobs,
                                    reasoning=answer.reasoning)
    if body.stream:  # with tools the answer is parsed whole, then streamed
        return event_stream(state, _whole_stream(meta, out, _include_usage(body)))
    return out


# llama-server's own /completion samples as its defaults say (SamplingParams' are llama.cpp's), until the end
LLAMA_SERVER = SamplingParams(max_tokens=None)


@router.post("/completion")
@router.post("/completions", include_in_schema=False)  # llama-server's: its own API, as /completion
async def llama_server_completion(body: LlamaServerCompletionRequest, request: Request,
                                  state: ServerState = Depends(server_state)):
    """llama-server's own completion API: `content`, `stop` (true once it ended), `tokens_predicted`,
    `tokens_evaluated`, `tokens_cached`, why it stopped (`stop_type` "eos", "word" or "limit", `stopping_word`,
    `stopped_eos` / `stopped_word` / `stopped_limit`) and `timings` (ms); with `stream`, server-sent events of the
    content's pieces, the last with `stop: true` and the counts."""
    return await _llama_server_answer(state, body, request, body.prompt, time.perf_counter())


@router.post("/infill")
async def infill(body: InfillRequest, request: Request, state: ServerState = Depends(server_state)):
    """llama-server's fill-in-the-middle for code editors: what goes between `input_prefix` (+ `prompt`) and
    `input_suffix`, with `input_extra` files as context (`completions.infill_prompt`); answered as /completion is.
    A 400 for a model without fill-in-the-middle tokens."""
    started = time.perf_counter()
    texts = [body.input_prefix, body.input_suffix, body.prompt] + [c.text + c.filename for c in body.input_extra]
    requests.check_prompt_bytes(state, sum(requests.text_bytes(t) for t in texts), "input_prefix")
    try:
        tokens = await state.prepared(infill_prompt, state.llm, body.input_prefix, body.input_suffix, body.prompt,
                                      [(c.filename, c.text) for c in body.input_extra])
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="input_prefix") from None
    return await _llama_server_answer(state, body, request, tokens, started)


async def _llama_server_answer(state: ServerState, body: Union[LlamaServerCompletionRequest, InfillRequest],
                               request: Request, prompt: Union[str, List[int]], started: float):
    """A /completion or /infill prompt run (n_predict: -1 until the end) and answered in llama-server's shape."""
    limit = body.max_tokens if body.n_predict is None else None if body.n_predict < 0 else body.n_predict
    try:
        job = await prompt_job(state, body, request, prompt, defaults=LLAMA_SERVER, max_tokens=limit,
                               logprobs=body.n_probs or None)
    except APIError as e:
        if e.code == "context_length_exceeded":  # llama-server's type, which its clients branch on
            e.kind = "exceed_context_size_error"
        raise
    if body.stream:
        return event_stream(state, _llama_server_stream(state, job, body, started))
    tokens: List[int] = []
    pieces, finish, entries = await collect_answer(state, job, request, tokens)
    out = _llama_server_result(state, job, body, "".join(pieces), finish, started)
    out["tokens"] = tokens if body.return_tokens else []
    if body.n_probs:
        out["completion_probabilities"] = [_token_probabilities(state, e) for e in entries]
    return out


def _llama_server_result(state: ServerState, job: Job, body: Any, content: str, finish: Optional[str],
                         started: float) -> Dict[str, Any]:
    """llama-server's final /completion object (its to_json_non_oaicompat_final): the text, why it stopped, the
    counts, the settings it ran with and its timings (ms)."""
    end = time.perf_counter()
    n_prompt, n_gen = len(job.request.prompt_tokens), job.progress.n_generated
    n_read = n_prompt - job.progress.reused_tokens
    # as llama-server times them: the prompt until the first token (which its last batch's logits give), the
    # generation after it, its rate over the tokens after the first
    first = job.progress.first_token_at or end
    prompt_ms, predicted_ms = (first - started) * 1e3, (end - first) * 1e3
    stop_type = "word" if job.progress.stopping_word else {"stop": "eos", "length": "limit"}.get(finish or "", "none")
    return {"index": 0, "content": content, "tokens": [], "id_slot": job.progress.slot, "stop": True, "model": state.model_id,
            "tokens_predicted": n_gen, "tokens_evaluated": n_prompt, "tokens_cached": job.progress.reused_tokens,
            "generation_settings": _generation_settings(state, job, body),
            "prompt": state.llm.detokenize(job.request.prompt_tokens, special=True).decode("utf-8", errors="replace"),
            "has_new_line": "\n" in content, "truncated": False,
            "stop_type": stop_type, "stopping_word": job.progress.stopping_word, "stopped_eos": stop_type == "eos",
            "stopped_word": stop_type == "word", "stopped_limit": stop_type == "limit",
            "timings": {"cache_n": job.progress.reused_tokens, "prompt_n": n_read, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / max(n_read, 1),
                        "prompt_per_second": n_read / max(prompt_ms / 1e3, 1e-9),
                        "predicted_n": n_gen, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / (n_gen - 1) if n_gen > 1 else 0.0,
                        "predicted_per_second": 1e3 / predicted_ms * (n_gen - 1) if n_gen > 1 and predicted_ms else 0.0}}


def _generation_settings(state: ServerState, job: Job, body: Any) -> Dict[str, Any]:
    """The sampling a request ran with, in llama-server's names (its generation_settings); `logit_bias` as it
    lists it, with the end-of-generation tokens banned by ignore_eos (a bias of null: -inf)."""
    p = job.request.params
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = dict(p.logit_bias or {})
    if p.ignore_eos:
        bias.update((t, float("-inf")) for t in state.llm.eog_tokens())
    listed = [{"token": t, "bias": None if b == float("-inf") else b} for t, b in sorted(bias.items())]
    return {"n_predict": -1 if p.max_tokens is None else p.max_tokens, "seed": p.seed, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "typical_p": p.typical_p,
            "repeat_last_n": p.penalty_last_n, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "mirostat": p.mirostat_mode, "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta,
            "stop": stop, "n_keep": job.request.n_keep, "ignore_eos": p.ignore_eos, "stream": bool(body.stream),
            "n_probs": body.n_probs, "grammar": p.grammar or "", "logit_bias": listed}


def _token_probabilities(state: ServerState, entry: TokenLogprob) -> Dict[str, Any]:
    """One generated token's n_probs entry as llama-server writes it: the token and its log-probability under the
    model (before the sampling settings), with the n most likely tokens'."""
    def one(token: int, logprob: float) -> Dict[str, Any]:
        piece = state.llm.token_to_piece(token, special=True)
        return {"id": token, "token": piece.decode("utf-8", errors="replace"), "bytes": list(piece),
                "logprob": logprob}

    return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


async def _llama_server_stream(state: ServerState, job: Job, body: Any, started: float):
    try:
        async for step in job_steps(state, job):
            e = step.event
            if e.text or step.tokens:
                chunk = {"index": 0, "content": e.text, "tokens": list(step.tokens), "stop": False,
                         "id_slot": job.progress.slot, "tokens_predicted": job.progress.n_generated,
                         "tokens_evaluated": len(job.request.prompt_tokens)}
                if body.n_probs:
                    chunk["completion_probabilities"] = [_token_probabilities(state, x) for x in step.logprobs]
                yield json.dumps(chunk)
            if e.token is None:
                yield json.dumps(_llama_server_result(state, job, body, "", e.finish_reason, started))
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, as llama-server's
        yield json.dumps(as_api_error(e).body())


# ------------------------------------------------------------------------- tokens and templates (no generation)
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-server's: the content's token ids, or with `with_pieces` each id with its text."""
    tokens = await _tokenized(state, body.content, body.add_special, body.parse_special)
    if not body.with_pieces:
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": _piece_json(state.llm.token_to_piece(t, special=True))} for t in tokens]}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-server's: the text of token ids (special tokens written out)."""
    return {"content": await _detokenized(state, body.tokens, special=True)}


@router.post("/apply-template")
async def apply_template(body: ChatCompletionRequest, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-server's: the prompt the chat template makes of a chat request's messages (and tools), as text, for a
    client that edits it and sends it to /v1/completions."""
    plan, messages = chat_messages(state, body)
    return {"prompt": await prepared_in_time(state, state.llm.apply_chat_template, messages,
                                              add_generation_prompt=body.add_generation_prompt and
                                              not body.continue_final_message,
                                              tools=plan.template_tools, chat_template_kwargs=body.chat_template_kwargs)}


@router.post("/extras/tokenize")
async def extras_tokenize(body: ExtrasTokenizeRequest, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-cpp-python's: the input's token ids, BOS included where the model adds one."""
    return {"tokens": await _tokenized(state, body.input, True, True, param="input")}


@router.post("/extras/tokenize/count")
async def extras_tokenize_count(body: ExtrasTokenizeRequest,
                                state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-cpp-python's: how many tokens the input is, BOS included where the model adds one."""
    return {"count": len(await _tokenized(state, body.input, True, True, param="input"))}


@router.post("/extras/detokenize")
async def extras_detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> Dict[str, Any]:
    """llama-cpp-python's: the text of token ids."""
    return {"text": await _detokenized(state, body.tokens, special=False)}


async def _tokenized(state: ServerState, text: str, add_bos: bool, special: bool, param: str = "content") -> List[int]:
    requests.check_prompt_bytes(state, len(text.encode("utf-8", errors="surrogatepass")), param)
    try:
        return await state.prepared(state.llm.tokenize, text, add_bos=add_bos, special=special)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param=param) from None


async def _detokenized(state: ServerState, tokens: List[int], special: bool) -> str:
    try:
        tokens = state.llm.check_token_ids(tokens)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="tokens") from None
    text = await state.prepared(state.llm.detokenize, tokens, special=special)
    return text.decode("utf-8", errors="replace")


def _piece_json(piece: bytes) -> Any:
    """A token's text as llama-server shows it: a string, or its bytes where they are not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


# ---------------------------------------------------------------------------------------------------- helpers
async def _completion_stream(state: ServerState, job: Job, meta: Dict[str, Any], echo: str,
                             echoed: List[Optional[TokenLogprob]], usage: bool, piece: Callable[[int], str]):
    first = _viewed(responses.completion_chunk(meta, echo, logprobs=responses.completion_logprobs(
        piece, job.request.prompt_tokens, echoed) if echoed else None), job.progress.started.view)
    if echo or first.get("kv_cache"):
        yield json.dumps(first)
    shown = responses.ShownLogprobs(state.llm.token_to_piece)
    try:
        async for step in job_steps(state, job):
            e, lp = step.event, None
            shown.drawn(step.logprobs)
            out = shown.shown(e.text, end=e.token is None)
            if out:
                lp = responses.completion_logprobs(piece, [x.token for x in out], out)
            yield json.dumps(_viewed(responses.completion_chunk(meta, e.text, e.finish_reason, lp), step.view))
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, as llama-server's
        yield json.dumps(as_api_error(e).body())
        return
    if usage:
        yield json.dumps(responses.usage_chunk(meta, job_usage(job), chat=False))
    yield "[DONE]"


async def _chat_stream(state: ServerState, job: Job, meta: Dict[str, Any], usage: bool,
                       thinking: Optional[reasoning.Thinking]):
    # the role first with no content yet (null, as llama-server sends it); no delta carries empty content
    yield json.dumps(_viewed(responses.chat_chunk(meta, {"role": "assistant", "content": None}), job.progress.started.view))
    shown = responses.ShownLogprobs(state.llm.token_to_piece)
    try:
        async for step, thought, text in split_steps(state, job, thinking):
            e, view = step.event, step.view
            shown.drawn(step.logprobs)
            out = shown.shown(e.text, end=e.token is None)  # a token's logprobs come with its text
            lp = responses.chat_logprobs(state.llm.token_to_piece, out) if out else None
            delta = responses.chat_delta(thought, text)
            # the view goes with every token; logprobs with their tokens' text (at the end, maybe with none)
            if delta or (view is not None and e.token is not None) or lp is not None:
                yield json.dumps(_viewed(responses.chat_chunk(meta, delta, logprobs=lp), view))
            if e.token is None:
                yield json.dumps(_viewed(responses.chat_chunk(meta, {}, e.finish_reason), view))
    except Exception as e:  # noqa: BLE001 - a started stream ends with an error event, as llama-server's
        yield json.dumps(as_api_error(e).body())
        return
    if usage:
        yield json.dumps(responses.usage_chunk(meta, job_usage(job), chat=True))
    yield "[DONE]"


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


def _include_usage(body: RequestFields) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


