"""The one place where tests read below `Llama`'s public surface (`Llama.stats()`, `kv_state()`): one function per
fact, read from its C++ engine (`h2o_local._engine.Engine`).

Tests check what `Llama` reports (kept positions, scores, host entries) against llama.cpp's own view of a sequence
(its position range, the bytes of its cells, its cached keys, the host store's rows) and against the engine's
settings as llama.cpp resolved them; a user never needs these, a test of the bookkeeping does. Every call holds the
engine's own lock.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple


def position_range(llm: Any, seq: int = 0) -> Tuple[int, int]:
    """llama.cpp's smallest and largest position of the sequence's cells ((-1, -1) when it has none)."""
    return tuple(llm._engine.seq_pos_range(seq))


def next_position(llm: Any, seq: int = 0) -> int:
    """The position the sequence's next token takes."""
    return llm._engine.next_pos(seq)


def cell_bytes(llm: Any, seq: int, positions: Sequence[int]) -> bytes:
    """The K and V bytes of the sequence's cells at `positions`, every layer (llama_kv_entries_get)."""
    return llm._engine.kv_entries(seq, list(positions))


def entry_bytes(llm: Any) -> int:
    """Bytes of one cache entry, every layer's K and V (llama_kv_entry_size)."""
    return llm._engine.entry_size


def host_store_rows(llm: Any, seq: int = 0) -> Tuple[List[int], bytes]:
    """The sequence's host store (recall): each entry's position, and their rows as a recall puts them back."""
    return llm._engine.host_kv(seq)


def cached_keys(llm: Any, seq: int, layer: int) -> Any:
    """The kept entries' cached keys of one layer, F32 after RoPE ([entry][n_embd_k]), as the key scorers read them."""
    return llm._engine.keys(seq, layer)


def ubatch(llm: Any) -> int:
    """llama.cpp's physical batch (n_ubatch) as the context resolved it."""
    return llm._engine.n_ubatch


def probes_ride(llm: Any) -> bool:
    """Whether a probe is decoded with the prompt's chunk it follows (the engine's probe_rides, as resolved)."""
    return llm._engine.probe_rides


def sums_rows(llm: Any) -> bool:
    """Whether the patched attention reduces the score sums over rows (the reduction the engine chose)."""
    return llm._engine.scores_sum_rows


def take_prompt_logits(llm: Any, seq: int = 0) -> Any:
    """The logits of every prompt token the last eval kept for the sequence (taken: a second call has none)."""
    return llm._engine.take_logits_all(seq)


def builtin_template(llm: Any, pairs: List[Tuple[str, str]], add_generation_prompt: bool, template: str = "") -> str:
    """llama.cpp's own rendering of (role, content) pairs (llama_chat_apply_template): the built-in templates."""
    return llm._engine.apply_chat_template(pairs, add_generation_prompt, template)


def eval_with_riders(llm: Any, tokens: Dict[int, List[int]], riders: Callable[[], Dict[int, List[int]]]) -> None:
    """An eval of `tokens` (per sequence) whose chunks take other sequences' single tokens along (`riders()`,
    asked between chunks), as the server's scheduler feeds them."""
    llm._engine.eval(tokens, False, riders)
