"""The generation loop: one for one sequence and for many (one sequence is a batch of one).

Each step samples every live sequence from its own logits (in C++, where the logits are), ends the ones that hit
an end-of-generation token, a stop string or `max_tokens`, and feeds the others' new tokens in one `eval`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import numpy as np

from .text import TextAssembler


@dataclass
class SeqRun:
    """One sequence being generated."""

    index: int                      # the caller's index (prompt number)
    seq_id: int                     # the engine's sequence
    sampler: object                 # _engine.Sampler
    text: TextAssembler
    max_tokens: Optional[int]
    n_generated: int = 0
    eog_token: Optional[int] = None  # the end-of-generation token sampled (not fed)
    unfed: Optional[int] = None      # the last token shown but not yet fed (fed first when the session goes on)
    finish_reason: Optional[str] = None
    tokens: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Event:
    """A generated token (`token` set) or the end of a sequence (`finish_reason` set)."""

    index: int
    token: Optional[int]
    text: str                             # text released by this token (or the rest, at the end)
    finish_reason: Optional[str] = None
    logits: Optional[np.ndarray] = None   # the logits the token was drawn from (only when asked)


def run(engine, runs: List[SeqRun], *, unbounded: bool, want_logits: bool = False,
        free_finished: bool = False) -> Iterator[Event]:
    """Generate for `runs` (their prompts already fed) until each ends; yields Events in step order.

    unbounded: the cache never evicts (policy full), so the loop stops every sequence with "length" when the next
    step would not fit. free_finished: remove a finished sequence's cache at once (batches).
    """
    live: Dict[int, SeqRun] = {}
    for r in runs:
        if r.max_tokens == 0:
            yield from _finish(engine, r, "length", free_finished)
        else:
            live[r.seq_id] = r
    while live:
        step: Dict[int, List[int]] = {}
        for seq_id, r in list(live.items()):
            logits = engine.last_logits(seq_id) if want_logits else None
            token = engine.sample(seq_id, r.sampler)
            finish = None
            if engine.is_eog(token):
                r.eog_token = token
                finish = "stop"
            else:
                r.n_generated += 1
                r.tokens.append(token)
                r.unfed = token
                yield Event(r.index, token, r.text.push(engine.token_to_piece(token, False)), None, logits)
                if r.text.stopped:
                    finish = "stop"
                elif r.max_tokens is not None and r.n_generated >= r.max_tokens:
                    finish = "length"
                else:
                    step[seq_id] = [token]
            if finish is not None:
                del live[seq_id]
                yield from _finish(engine, r, finish, free_finished)
        if not step:
            continue
        if unbounded and engine.cells_used + len(step) > engine.capacity:
            # the context is full and never evicts: stop like llama-cpp-python does
            for seq_id in list(live):
                yield from _finish(engine, live.pop(seq_id), "length", free_finished)
            break
        engine.eval(step, False)
        for seq_id in step:
            live[seq_id].unfed = None


def _finish(engine, r: SeqRun, reason: str, free: bool) -> Iterator[Event]:
    r.finish_reason = reason
    yield Event(r.index, None, r.text.flush(), reason)
    if free:
        engine.reset_seq(r.seq_id)
