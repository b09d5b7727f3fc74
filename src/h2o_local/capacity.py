"""How many sequences fit in a KV memory limit: the sizing rule behind `Llama.for_kv_limit`.

One KV cell holds one token's K and V in every layer. The full cache needs prompt + generation cells per
sequence; a bounded policy needs its budget per sequence plus one batch of fresh tokens, shared by all sequences
in a unified cache and per sequence when each has its own stream. llama.cpp rounds the context up (to a multiple
of 256 cells, and each stream too; `padded_cells`), so that is what a limit has to cover.
"""
from __future__ import annotations

from typing import Optional

from . import _engine

def padded_cells(n_cells: int, n_seq: int = 1, kv_unified: bool = True) -> int:
    """Cells llama.cpp allocates for a context of `n_cells` cells and `n_seq` sequences (asked of C++)."""
    return int(_engine.padded_cells(int(n_cells), int(n_seq), bool(kv_unified)))


def cells_needed(n_seq: int, *, prompt_tokens: int, max_tokens: int, budget: Optional[int], n_batch: int,
                 kv_unified: bool = True) -> int:
    """KV cells (tokens) a context must hold for `n_seq` sequences decoded together.

    Full cache (`budget=None`): every sequence keeps its prompt and its generated tokens. Bounded: each sequence
    keeps `budget` entries, and one chunk of at most `n_batch` fresh tokens sits beside them before eviction (one
    chunk for all in a unified cache, one per sequence otherwise).
    """
    if n_seq < 1 or prompt_tokens < 1 or max_tokens < 0 or n_batch < 1:
        raise ValueError("n_seq, prompt_tokens and n_batch must be >= 1 and max_tokens >= 0")
    if budget is None:
        return n_seq * (prompt_tokens + max_tokens)
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    return _engine.bounded_cells(n_seq, budget, n_batch, kv_unified)


def largest_batch(kv_limit_bytes: int, *, bytes_per_cell: int, prompt_tokens: int, max_tokens: int,
                  budget: Optional[int], n_batch: int, kv_unified: bool = True, n_seq_cap: int = 256) -> int:
    """The most sequences whose cache, as llama.cpp allocates it, takes at most `kv_limit_bytes` bytes.

    Returns 0 when not even one sequence fits; at most `n_seq_cap` (llama.cpp's limit on sequences per context).
    """
    if bytes_per_cell < 1:
        raise ValueError(f"bytes_per_cell must be >= 1, got {bytes_per_cell}")
    n = 0
    while n < n_seq_cap:
        cells = cells_needed(n + 1, prompt_tokens=prompt_tokens, max_tokens=max_tokens, budget=budget,
                             n_batch=n_batch, kv_unified=kv_unified)
        if padded_cells(cells, n + 1, kv_unified) * bytes_per_cell > kv_limit_bytes:
            break
        n += 1
    return n


def kv_bytes_per_cell(f16_bytes_per_cell: int, *, kv_f32: bool = False, type_k: Optional[str] = None,
                      type_v: Optional[str] = None) -> int:
    """One token's K and V bytes with these cache types, from its F16 size (K and V are half of it each)."""
    base = 4.0 if kv_f32 else 2.0
    k = _engine.kv_type_bytes(type_k) if type_k else base  # ggml's block sizes, asked of C++
    v = _engine.kv_type_bytes(type_v) if type_v else base
    return max(1, round(f16_bytes_per_cell / 4 * (k + v)))
