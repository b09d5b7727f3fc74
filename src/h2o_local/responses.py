"""The OpenAI-shaped responses, built in one place for `Llama` and the server (types: `llama_types`)."""
from __future__ import annotations

import codecs
import collections
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import __version__, _engine

from .llama_types import (ChatCompletion, ChatCompletionChunk, ChatCompletionLogprobs, Completion, CompletionChunk,
                          CompletionLogprobs, CompletionUsage)


def system_fingerprint() -> str:
    """What built the answer, as llama-server's `b<build>-<commit>`: this package's version and the pinned
    llama.cpp commit (OpenAI's clients keep it as `system_fingerprint`)."""
    return f"b{__version__}-{_engine.LLAMA_CPP_COMMIT[:7] or 'unknown'}"


def completion_meta(model: str) -> Dict[str, Any]:
    """id, object, created and model of one text completion (shared by its chunks)."""
    return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": system_fingerprint()}


def chat_meta(model: str) -> Dict[str, Any]:
    """id, created and model of one chat completion (shared by its chunks)."""
    return {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model,
            "system_fingerprint": system_fingerprint()}


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
                    use: CompletionUsage, tool_calls: Optional[List[Dict[str, Any]]] = None,
                    logprobs: Optional[ChatCompletionLogprobs] = None,
                    reasoning: Optional[str] = None) -> ChatCompletion:
    """`reasoning`: a thinking model's reasoning, apart (llama-server's `reasoning_content`; None: none)."""
    message: Dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {**meta, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason}], "usage": use}  # type: ignore[return-value]


def chat_completion_chunks(meta: Dict[str, Any], whole: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """A finished chat completion as a stream (tool calls are parsed from the whole answer, then streamed): the
    role, the content, each call (`delta.tool_calls` with its index), the finish reason; the answer's logprobs
    (when asked) with the first piece after the role."""
    choice = whole["choices"][0]
    message = choice["message"]
    pieces = ([{"reasoning_content": message["reasoning_content"]}] if message.get("reasoning_content") else []) + \
        ([{"content": message["content"]}] if message.get("content") else []) + \
        [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls") or [])]
    yield chat_chunk(meta, {"role": "assistant", "content": None})
    for i, delta in enumerate(pieces):
        yield chat_chunk(meta, delta, logprobs=choice.get("logprobs") if i == 0 else None)
    yield chat_chunk(meta, {}, choice["finish_reason"], logprobs=None if pieces else choice.get("logprobs"))


def chat_delta(reasoning: str, content: str) -> Dict[str, str]:
    """A streamed piece's delta: its reasoning (`reasoning_content`) and content, each where there is some."""
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}


def chat_chunk(meta: Dict[str, Any], delta: Dict[str, Any], finish_reason: Optional[str] = None,
               logprobs: Optional[ChatCompletionLogprobs] = None) -> ChatCompletionChunk:
    """One streamed piece: the first has delta {"role": "assistant", "content": ""}, then {"content": text}, the
    last {} with the finish reason; `logprobs`: those of the tokens drawn for this piece."""
    return {**meta, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}  # type: ignore[return-value]


def usage_chunk(meta: Dict[str, Any], use: CompletionUsage, chat: bool) -> Dict[str, Any]:
    """The last streamed piece when `stream_options.include_usage` is asked: no choices, the usage."""
    return {**meta, **({"object": "chat.completion.chunk"} if chat else {}), "choices": [], "usage": use}


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (natural log, of the model's distribution before any sampling setting):
    the token's, and the `top` most likely tokens' (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """`token`'s log-probability under one row of logits, with the k most likely tokens (ties: the lower id first).
    One pass for the normalizer and one partial sort: it runs in a server's decoding thread, once per token."""
    x = np.asarray(logits, dtype=np.float32)
    top = float(x.max())
    lse = top + math.log(float(np.exp(x - top, dtype=np.float32).sum(dtype=np.float64)))
    k = min(k, x.size)
    best = np.flatnonzero(x >= np.partition(x, -k)[-k]) if k else np.zeros(0, np.int64)  # ties: more than k
    if len(best) > 4 * k:  # a row of many equal values: a stable sort of it all, rather than of a huge tie
        best = np.argsort(-x, kind="stable")[:k]
    best = sorted((int(t) for t in best), key=lambda t: (-x[t], t))[:k]
    return TokenLogprob(int(token), float(x[token]) - lse, tuple((t, float(x[t]) - lse) for t in best))


def prompt_logprobs(rows: np.ndarray, tokens: Sequence[int], k: int) -> List[Optional[TokenLogprob]]:
    """A prompt's own logprobs from the logits after each of its tokens (`rows[i]`: after token i): each token's
    under the row before it, None for the first (nothing came before it)."""
    return [None if i == 0 else token_logprob(rows[i - 1], t, k) for i, t in enumerate(tokens)]


class ShownLogprobs:
    """The logprobs of the tokens whose text an answer shows: a token's entry is given once the text released so far
    reaches its first character (a token that ends inside a character: the character it helps make), so a stop
    string's tokens, cut off with it, show none; at the end (`shown(text, end=True)`) the tokens that made no text
    after the last character come too (a token whose text is empty, or a character the answer ended inside of).
    `piece(token)` is a token's bytes, as the text is made from them."""

    def __init__(self, piece: Callable[[int], bytes]):
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as TextAssembler decodes
        self._chars = 0       # characters the drawn tokens make
        self._shown = 0       # characters released
        self._waiting: Deque[Tuple[int, TokenLogprob]] = collections.deque()  # (first character, entry)

    def drawn(self, entries: Iterable[TokenLogprob]) -> None:
        for e in entries:
            self._waiting.append((self._chars, e))
            self._chars += len(self._decoder.decode(self._piece(e.token)))

    def shown(self, text: str, end: bool = False) -> List[TokenLogprob]:
        """`text` was released (`end`: the answer's last text): the entries of the tokens it reaches."""
        self._shown += len(text)
        out = []
        while self._waiting and (self._waiting[0][0] < self._shown or end and self._waiting[0][0] >= self._chars):
            out.append(self._waiting.popleft()[1])
        return out


def shown_logprobs(piece: Callable[[int], bytes], entries: Iterable[TokenLogprob], text: str) -> List[TokenLogprob]:
    """Of a whole answer's entries, those of the tokens its returned `text` shows (`ShownLogprobs`)."""
    shown = ShownLogprobs(piece)
    shown.drawn(entries)
    return shown.shown(text, end=True)


def completion_logprobs(piece: Callable[[int], str], tokens: List[int], entries: List[Optional[TokenLogprob]],
                        offsets: Optional[List[int]] = None) -> CompletionLogprobs:
    """llama-cpp-python's logprobs block of a text completion: each token's text, its log-probability (None where
    nothing came before it: a prompt's first token) and its top tokens as {text: logprob}; `offsets`: where each
    token's text starts in the answer (characters), left out of streamed pieces. `piece(token)` is a token's text."""
    out: CompletionLogprobs = {"tokens": [piece(t) for t in tokens], "text_offset": list(offsets or []),
                               "token_logprobs": [None if e is None else e.logprob for e in entries],
                               "top_logprobs": [None if e is None else {piece(t): lp for t, lp in e.top}
                                                for e in entries]}
    if offsets is None:
        del out["text_offset"]
    return out


def chat_logprobs(piece: Callable[[int], bytes], entries: List[TokenLogprob]) -> ChatCompletionLogprobs:
    """OpenAI's logprobs of a chat answer: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}, ...], "refusal": None}; `piece(token)` is a token's bytes (a token that ends inside a
    character shows U+FFFD in `token`; `bytes` is exact)."""
    def one(token: int, logprob: float) -> Dict[str, Any]:
        raw = piece(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}  # type: ignore[typeddict-item]
