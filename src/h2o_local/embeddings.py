"""Embeddings of whole texts: llama-cpp-python's `Llama.embed` / `create_embedding`, and what the server's OpenAI,
llama-server and Ollama embedding routes answer. An input's vector is the model's last hidden states (after its
final norm, before the output layer), pooled: the model's own pooling where its GGUF names one, else their mean
(Ollama's way for a generative model; llama-server would refuse such a model). They are computed in a llama.cpp
context of their own, made at the first call (its KV cache holds one input: `context_size` tokens), so a
generation's bounded cache is never touched or outgrown."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _engine

# llama.cpp's pooling types (llama_cpp.LLAMA_POOLING_TYPE_*, as llama-cpp-python's `pooling_type` takes them), by
# the names of llama.cpp's --pooling; -1 takes the model's own (mean where it names none)
POOLING_NAMES = {"none": 0, "mean": 1, "cls": 2, "last": 3}

Vector = List[float]


# an input's tokens are read in one ubatch (llama.cpp pools a sequence only within one): the embedding context's
# size, at least this many where the model was trained on as many (a server's n_batch of 128 would cut a retrieval
# chunk short)
MIN_CONTEXT = 512


def context_size(n_batch: int, n_ctx_train: int) -> int:
    """The embedding context's tokens: n_batch (llama-cpp-python's limit), at least MIN_CONTEXT, at most the model's
    trained context."""
    return max(1, min(max(n_batch, MIN_CONTEXT), n_ctx_train or max(n_batch, MIN_CONTEXT)))


@dataclass(frozen=True)
class Embedded:
    """One call's vectors, in the inputs' order (each a list of rows where pooling is none), and the tokens read."""

    vectors: List[Union[Vector, List[Vector]]]
    n_tokens: int


def check_pooling_type(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (-1, *POOLING_NAMES.values()):
        raise ValueError("pooling_type must be -1 (the model's own) or one of " +
                         ", ".join(f"{v} ({k})" for k, v in POOLING_NAMES.items()) + f", got {value!r}")
    return value


def normalized(row: Sequence[float], norm: int = 2) -> Vector:
    """`row` normalized as llama.cpp's `embd_normalize` says: 2 to Euclidean length 1 (OpenAI's and Ollama's
    embeddings), -1 as it is, 0 scaled to int16's range by its largest absolute value, 1 taxicab, p > 2 the p-norm.
    A zero row stays zero."""
    x = np.asarray(row, dtype=np.float64)
    if norm < 0 or x.size == 0:
        return x.tolist()
    largest = np.abs(x).max()
    if largest == 0:
        return x.tolist()
    # the p-norm from the row scaled by its largest value: no overflow at any p (the largest term is 1)
    total = largest / 32760.0 if norm == 0 else largest * np.sum((np.abs(x) / largest) ** float(norm)) ** (1.0 / norm)
    return (x / total).tolist()


class Embeddings:
    """One `Llama`'s embedding context, made at its first use, freed by `close`; calls from several threads take
    turns in it."""

    def __init__(self, engine: Callable[[], Any], *, n_ctx: int, n_threads: int, pooling_type: int):
        self._engine = engine  # the Llama's engine now (raises once the Llama is closed)
        self.n_ctx = n_ctx
        self._n_threads = n_threads
        self._asked = check_pooling_type(pooling_type)
        self._embedder: Optional[Any] = None
        self._lock = threading.Lock()

    def _context(self) -> Any:
        with self._lock:
            if self._embedder is None:
                self._embedder = _engine.Embedder(self._engine(), self.n_ctx, self._n_threads, self._asked)
            return self._embedder

    @property
    def pooling_type(self) -> int:
        """The pooling that runs (0 none, 1 mean, 2 cls, 3 last): the asked one, or the model's resolved."""
        return self._context().pooling

    def embed(self, inputs: Sequence[Sequence[int]], *, normalize: bool = False) -> Embedded:
        """The vectors of token lists, each at most `n_ctx` tokens (ValueError otherwise, or for an empty one)."""
        context = self._context()
        vectors: List[Union[Vector, List[Vector]]] = []
        for tokens in inputs:
            rows = context.embed(list(tokens))
            if normalize:
                rows = [normalized(r) for r in rows]
            vectors.append(rows if context.pooling == 0 else rows[0])
        return Embedded(vectors, sum(len(t) for t in inputs))

    def close(self) -> None:
        with self._lock:
            self._embedder = None


def truncated(tokens: List[int], n_ctx: int, truncate: bool) -> List[int]:
    """An input's tokens cut to `n_ctx` (truncate) or refused beyond it (ValueError), as llama-cpp-python's `embed`."""
    if len(tokens) > n_ctx and not truncate:
        raise ValueError(f"the input is {len(tokens)} tokens, more than the {n_ctx} an embedding takes (n_batch); "
                         f"pass truncate=True to embed its first {n_ctx}")
    return tokens[:n_ctx]


def as_inputs(value: Any) -> Tuple[List[Union[str, List[int]]], bool]:
    """The inputs of a call (a text, a list of texts, token ids or lists of token ids) and whether one was given
    alone (its vector is returned alone)."""
    if isinstance(value, (str, bytes)):
        return [value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value], True
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"input must be a text, a list of texts or of token ids, got {type(value).__name__}")
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)], True
    inputs: List[Union[str, List[int]]] = []
    for item in value:
        if isinstance(item, (str, bytes)):
            inputs.append(item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item)
        elif isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            inputs.append(list(item))
        else:
            raise TypeError(f"each input must be a text or a list of token ids, got {item!r:.80}")
    return inputs, False
