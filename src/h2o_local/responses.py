"""The OpenAI-shaped responses, built in one place for `Llama` and the server (types: `llama_types`)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from .llama_types import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, CompletionLogprobs, CompletionUsage


def completion_meta(model: str) -> Dict[str, Any]:
    """id, object, created and model of one text completion (shared by its chunks)."""
    return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()), "model": model}


def chat_meta(model: str) -> Dict[str, Any]:
    """id, created and model of one chat completion (shared by its chunks)."""
    return {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model}


def usage(n_prompt: int, n_completion: int, cached: Optional[int] = None,
          kv_cache: Optional[Dict[str, Any]] = None) -> CompletionUsage:
    """Token counts; `cached`: prompt tokens found in a saved cache (`prompt_tokens_details.cached_tokens`);
    `kv_cache`: what the bounded cache did (an extension field: policy, budget, entries kept, evicted, peak)."""
    out: Dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                           "total_tokens": n_prompt + n_completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if kv_cache is not None:
        out["kv_cache"] = kv_cache
    return out  # type: ignore[return-value]


def completion(meta: Dict[str, Any], text: str, finish_reason: Optional[str], use: CompletionUsage,
               logprobs: Optional[CompletionLogprobs] = None) -> Completion:
    return {**meta, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": use}  # type: ignore[return-value]


def completion_chunk(meta: Dict[str, Any], text: str, finish_reason: Optional[str] = None,
                     logprobs: Optional[CompletionLogprobs] = None) -> CompletionChunk:
    return {**meta, "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                                 "finish_reason": finish_reason}]}  # type: ignore[return-value]


def chat_completion(meta: Dict[str, Any], content: Optional[str], finish_reason: Optional[str],
                    use: CompletionUsage, tool_calls: Optional[List[Dict[str, Any]]] = None) -> ChatCompletion:
    message: Dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {**meta, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": use}  # type: ignore[return-value]


def chat_completion_chunks(meta: Dict[str, Any], whole: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """A finished chat completion as a stream (tool calls are parsed from the whole answer, then streamed): the
    role, the content, each call (`delta.tool_calls` with its index), the finish reason."""
    choice = whole["choices"][0]
    message = choice["message"]
    yield chat_chunk(meta, {"role": "assistant", "content": ""})
    if message.get("content"):
        yield chat_chunk(meta, {"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chat_chunk(meta, {"tool_calls": [{"index": i, **call}]})
    yield chat_chunk(meta, {}, choice["finish_reason"])


def chat_chunk(meta: Dict[str, Any], delta: Dict[str, Any], finish_reason: Optional[str] = None) -> ChatCompletionChunk:
    """One streamed piece: the first has delta {"role": "assistant", "content": ""}, then {"content": text}, the
    last {} with the finish reason."""
    return {**meta, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}  # type: ignore[return-value]


def usage_chunk(meta: Dict[str, Any], use: CompletionUsage, chat: bool) -> Dict[str, Any]:
    """The last streamed piece when `stream_options.include_usage` is asked: no choices, the usage."""
    return {**meta, **({"object": "chat.completion.chunk"} if chat else {}), "choices": [], "usage": use}


def logprobs(piece: Callable[[int], str], tokens: List[int], offsets: List[Optional[int]],
             logits: List[Optional[np.ndarray]], k: int) -> CompletionLogprobs:
    """llama-cpp-python's logprobs block for `tokens`, each drawn from its row of `logits` (None: no logprob), with
    the `k` most likely tokens per position; `piece(token)` is a token's text."""
    out: CompletionLogprobs = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for tok, offset, row in zip(tokens, offsets, logits):
        out["tokens"].append(piece(tok))
        if offset is not None:
            out["text_offset"].append(offset)
        if row is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp = _log_softmax(row)
        top = np.argsort(-lp)[:k]
        out["token_logprobs"].append(float(lp[tok]))
        out["top_logprobs"].append({piece(int(t)): float(lp[t]) for t in top})
    if not out["text_offset"]:
        del out["text_offset"]
    return out


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())
