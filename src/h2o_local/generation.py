"""The generation loop: one for one sequence and for many (one sequence is a batch of one).

Each step samples every live sequence from its own logits (in C++, where the logits are), ends the ones that hit
an end-of-generation token, a stop string or `max_tokens`, and feeds the others' new tokens in one `eval`.

A batch given a `background` executor (a server's slots) draws the tokens of grammar-constrained sequences there,
from a copy of their logits: a draw that is not done within `draw_wait_s` is left running, its sequence skips the
step (not fed, no event), and the others go on; it joins a later step once its token is drawn. One conversation's
grammar then never holds the decode step the others share. Such a batch also keeps its sequences apart when a draw
fails (a grammar that cannot go on, or needs more work than its limits allow): that sequence ends with the error in
its end event, the others go on; a draw still running when its sequence's deadline passes ends it with "length"
(the draw itself is bounded by its grammar's work limit, so its worker is soon free again).
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

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
    pending: Optional[int] = None    # the last token shown but not yet fed (fed first when the session goes on)
    finish_reason: Optional[str] = None
    tokens: List[int] = field(default_factory=list)
    deadline: Optional[float] = None  # time.monotonic() after which it ends with "length" (a server's time limit)
    drawing: Optional[concurrent.futures.Future] = None  # its next token, being drawn aside (Batch.background)
    want_logits: bool = False        # its events carry the logits each token was drawn from (as Batch.want_logits)
    shown_special: Tuple[int, ...] = ()  # special tokens whose text it shows (SamplingParams.preserved_tokens)


@dataclass(frozen=True)
class Event:
    """A generated token (`token` set) or the end of a sequence (`finish_reason` set)."""

    index: int
    token: Optional[int]
    text: str                             # text released by this token (or the rest, at the end)
    finish_reason: Optional[str] = None
    logits: Optional[np.ndarray] = None   # the logits the token was drawn from (only when asked)
    error: Optional[Exception] = None     # why the sequence ended, when it failed (finish_reason "error")
    stop_word: Optional[str] = None       # the stop string that ended it, if one did


class Batch:
    """Sequences generated together. A step is `sample()` (a token, or the end, for every live sequence: the events
    to show) then `feed()` (the new tokens in one `eval`). Sequences join (`add`, their prompts already fed) and
    leave (`cancel`) between steps.

    unbounded: the cache never evicts (policy full), so a step stops every sequence with "length" when it would
    not fit. free_finished: remove a finished sequence's cache at once (batches).
    """

    def __init__(self, engine, *, unbounded: bool, want_logits: bool = False, free_finished: bool = False,
                 background: Optional[concurrent.futures.Executor] = None, draw_wait_s: float = 0.01):
        self.engine = engine
        self.unbounded = unbounded
        self.want_logits = want_logits
        self.free_finished = free_finished
        self.background = background
        self.draw_wait_s = draw_wait_s
        self.live: Dict[int, SeqRun] = {}
        self._feed: Dict[int, List[int]] = {}
        self._finished: List[int] = []  # freed at the next call, after the caller has seen their last event

    def add(self, r: SeqRun) -> List[Event]:
        """A sequence whose prompt is fed joins; returns its end at once when it may generate nothing."""
        if r.max_tokens == 0:
            return self._finish(r, "length")
        self.live[r.seq_id] = r
        return []

    def cancel(self, seq_id: int) -> None:
        """The sequence leaves now, with no event (a client that went away)."""
        r = self.live.pop(seq_id, None)
        self._feed.pop(seq_id, None)
        if r is not None and self.free_finished:
            self.engine.reset_seq(r.seq_id)

    @property
    def drawing(self) -> List[concurrent.futures.Future]:
        """The draws running aside (background): sequences that skip steps until their token is drawn."""
        return [r.drawing for r in self.live.values() if r.drawing is not None]

    def wait_for_draws(self, timeout_s: float) -> None:
        """Block until a draw running aside is done (or timeout_s): a step with nothing else to do waits here."""
        if self.drawing:
            concurrent.futures.wait(self.drawing, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def _draws(self) -> Dict[int, Union[int, Exception]]:
        """The tokens drawn this step: grammar-constrained sequences aside (those not done within draw_wait_s go
        on drawing and skip the step), the others here. With `background`, a failed draw gives its exception."""
        engine, tokens = self.engine, {}
        if self.background is not None:
            for seq_id, r in self.live.items():
                if r.drawing is None and r.sampler.has_grammar:
                    r.drawing = self.background.submit(r.sampler.sample, engine.last_logits(seq_id))
        for seq_id, r in self.live.items():
            if r.drawing is None:
                try:
                    tokens[seq_id] = engine.sample(seq_id, r.sampler)
                except ValueError as e:  # the sequence's own input (its grammar, its biases) is at fault
                    if self.background is None:
                        raise
                    tokens[seq_id] = e
        deadline = time.monotonic() + self.draw_wait_s
        for seq_id, r in self.live.items():
            if r.drawing is not None:
                try:
                    tokens[seq_id] = r.drawing.result(timeout=max(deadline - time.monotonic(), 0.0))
                except concurrent.futures.TimeoutError:
                    continue
                except Exception as e:  # noqa: BLE001 - a draw's failure is its sequence's alone
                    tokens[seq_id] = e
                r.drawing = None
        return tokens

    def _overdue(self) -> List[Event]:
        """Sequences whose draw is still running past their deadline end with "length" (the draw's token is
        dropped when it comes)."""
        out, now = [], time.monotonic()
        for seq_id, r in list(self.live.items()):
            if r.drawing is not None and r.deadline is not None and now >= r.deadline:
                r.drawing = None
                del self.live[seq_id]
                out += self._finish(r, "length")
        return out

    def sample(self) -> List[Event]:
        """One token for every live sequence (or its end); with `background`, a sequence whose grammar draw is
        still running skips this step."""
        self.release()
        engine = self.engine
        feed = self._feed
        drawn = self._draws()
        out = self._overdue()
        for seq_id, r in list(self.live.items()):
            if seq_id not in drawn:
                continue
            token = drawn[seq_id]
            if isinstance(token, Exception):
                del self.live[seq_id]
                out += self._finish(r, "error", token)
                continue
            logits = engine.last_logits(seq_id) if self.want_logits or r.want_logits else None
            finish = None
            if engine.is_eog(token):
                r.eog_token = token
                finish = "stop"
            else:
                r.n_generated += 1
                r.tokens.append(token)
                r.pending = token
                piece = engine.token_to_piece(token, token in r.shown_special)
                out.append(Event(r.index, token, r.text.push(piece), None, logits))
                if r.text.stopped:
                    finish = "stop"
                elif (r.max_tokens is not None and r.n_generated >= r.max_tokens) or \
                        (r.deadline is not None and time.monotonic() >= r.deadline):
                    finish = "length"
                else:
                    feed[seq_id] = [token]
            if finish is not None:
                del self.live[seq_id]
                out += self._finish(r, finish)
        return out

    def feed(self) -> List[Event]:
        """Feed the tokens the last `sample()` drew; returns the ends of sequences that no longer fit."""
        self.release()
        feed, self._feed, out = self._feed, {}, []
        if not feed:
            return out
        if self.unbounded:
            out += self._stop_what_does_not_fit(feed)
            if not feed:
                return out
        self.engine.eval(feed, False)
        for seq_id in feed:
            self.live[seq_id].pending = None
        return out

    def ride(self) -> Tuple[List[Event], Dict[int, List[int]]]:
        """Like `feed()`, but hands the tokens over instead of feeding them: they ride with a prompt's next chunk
        (`engine.eval(..., between_chunks=)` decodes them in the same batch). Returns (the ends of sequences that
        no longer fit, the riders)."""
        self.release()
        feed, self._feed, out = self._feed, {}, []
        if self.unbounded:
            out += self._stop_what_does_not_fit(feed)
        for seq_id in feed:
            self.live[seq_id].pending = None  # fed with the chunk (a failed decode fails every slot)
        return out, feed

    def _stop_what_does_not_fit(self, feed: Dict[int, List[int]]) -> List[Event]:
        """A cache that never evicts: a sequence whose stream (or the shared cache) has no cell left for its next
        token ends with "length", as llama-cpp-python does at the end of the context; the others go on."""
        out, taken = [], 0
        for seq_id in list(feed):
            room = self.engine.room(seq_id) - (taken if self.engine.kv_unified else 0)
            if room >= len(feed[seq_id]):
                taken += len(feed[seq_id])
                continue
            del feed[seq_id]
            out += self._finish(self.live.pop(seq_id), "length")
        return out

    def _finish(self, r: SeqRun, reason: str, error: Optional[Exception] = None) -> List[Event]:
        r.finish_reason = reason
        if self.free_finished:
            self._finished.append(r.seq_id)
        return [Event(r.index, None, r.text.flush(), reason, error=error, stop_word=r.text.stop_word)]

    def release(self) -> None:
        """Free the caches of the sequences that finished (with free_finished)."""
        for seq_id in self._finished:
            if seq_id not in self.live:
                self.engine.reset_seq(seq_id)
        self._finished = []


def run(engine, runs: List[SeqRun], *, unbounded: bool, want_logits: bool = False,
        free_finished: bool = False) -> Iterator[Event]:
    """Generate for `runs` (their prompts already fed) until each ends; yields Events in step order."""
    batch = Batch(engine, unbounded=unbounded, want_logits=want_logits, free_finished=free_finished)
    for r in runs:
        yield from batch.add(r)
    while batch.live:
        yield from batch.sample()
        yield from batch.feed()
    batch.release()
