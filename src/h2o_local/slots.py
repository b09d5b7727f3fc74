"""Slots: the sequences of one `Llama` that concurrent generations fill and leave, decoded together.

What a server needs of a `Llama`, on its public side: start a prompt in a slot (fresh, or continuing a saved
session), step every live slot by one token, save a slot's cache, release it. The owner holds the `Llama` while it
steps (`with slots.owned(): ...`), so no other call interleaves with a step.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import generation
from .policies import Policy
from .sampling import SamplingParams
from .text import TextAssembler


class Slots:
    """The `llm.n_seq_max` sequences of `llm` as slots, each with its own budget, scores and sampler."""

    def __init__(self, llm: Any, engine: Any, draws: Optional[concurrent.futures.Executor] = None,
                 draw_wait_s: float = 0.01):
        """Made by `Llama.slots()`, which hands over its engine (`engine`: what the slots step, under the `Llama`'s
        lock). `draws`: where grammar-constrained slots draw their tokens (default: a thread per slot); a draw not
        done within draw_wait_s seconds leaves its slot out of that step."""
        self.llm = llm
        self._engine = engine
        self.n_slots: int = llm.n_seq_max
        self.cells_per_slot: int = self._engine.stream_capacity  # KV cells a slot's prompt and answer can take
        # a long prompt can be read in chunks with the other slots stepped in between: only where each slot has a
        # stream of its own (in a shared one their cells would move where the prompt is cut)
        self.interleaves: bool = not llm.kv_unified
        # a grammar's draw runs aside, so that it never holds the step the other slots share
        self._draws = draws or concurrent.futures.ThreadPoolExecutor(max_workers=self.n_slots,
                                                                     thread_name_prefix="h2o-draw")
        self._batch = generation.Batch(self._engine, unbounded=not llm.policy.bounded, free_finished=False,
                                       background=self._draws, draw_wait_s=draw_wait_s)
        self._runs: dict = {}
        self._evicted_before: dict = {}  # slot -> entries its restored session had evicted already

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """Hold the `Llama` for one step of the owner: its lock, and a generation of it left suspended ends."""
        with self.llm.exclusive():
            yield

    def start(self, slot: int, tokens: List[int], params: SamplingParams, *, n_keep: int = 0,
              resume: Optional[Tuple[Any, int]] = None,
              between_chunks: Optional[Callable[[], Optional[Dict[int, List[int]]]]] = None,
              save_prefix: Optional[Callable[[Any], None]] = None,
              policy: Optional[Policy] = None,
              time_limit_s: Optional[float] = None,
              recall: Optional[bool] = None, sampler: Optional[Any] = None, logits: bool = False,
              prompt_logits: bool = False) -> List[generation.Event]:
        """Feed a prompt to `slot` (emptied first) and let it join the steps. `n_keep`: its protected prefix.
        `policy`: the slot's own (a resolved value that fits the slot's cells), None: the `Llama`'s.
        `resume`: (a saved snapshot, n): the snapshot holds `tokens[:n]` already, only the rest is fed (nothing
        where it holds them all: its logits after the last one are drawn from); what it holds after them is
        forgotten first (a request that parts from a saved answer, sessions.py).
        `save_prefix(snapshot)`: without `resume`, the protected prefix is fed alone first and its snapshot given
        to it (a shared system prompt that later requests start from).
        `between_chunks()` runs between the chunks of a long prompt (with `interleaves`): it may return
        `ride()`'s tokens, which are decoded with the next chunk, so that the running slots go on while it is read.
        `time_limit_s`: generation ends with "length" once it has run this long (seconds, from its first token).
        `recall`: the slot's own recall setting (None: the `Llama`'s).
        `sampler`: made beforehand (`Llama.sampler(params, history=tokens)`: a grammar's parse kept out of the step
        the slots share), None: made here.
        `logits`: each token's event carries the logits it was drawn from. `prompt_logits`: every prompt token's
        logits are kept for `take_prompt_logits(slot)` (the whole prompt is fed: no `resume`, no prefix fed alone).
        Returns the slot's end at once when it may generate nothing (max_tokens 0)."""
        if prompt_logits and resume is not None:
            raise ValueError("a prompt whose logits are kept is fed whole: it cannot resume a snapshot")
        if sampler is None:  # bad sampling input raises before the slot changes
            sampler = self.llm.sampler(params, history=tokens)
        self._engine.reset_seq(slot)
        self.llm.configure(slot, policy=policy, recall=recall, keep=None if resume is not None else n_keep)
        feed = tokens
        if resume is not None:
            snapshot, n_fed = resume
            self._engine.restore(slot, snapshot)
            if n_fed < self._engine.state(slot)["n_seen"]:  # the request parts from it there (sessions.py)
                self._engine.truncate(slot, n_fed)
            self._evicted_before[slot] = self._engine.state(slot)["n_evicted"]
            feed = tokens[n_fed:]
        elif not feed:
            raise ValueError("the prompt is empty")
        hook = between_chunks if self.interleaves else None
        if save_prefix is not None and resume is None and not prompt_logits and 0 < n_keep < len(tokens):
            self._engine.eval({slot: tokens[:n_keep]}, False, hook)
            save_prefix(self._engine.snapshot(slot))
            feed = tokens[n_keep:]
        if feed:  # else the snapshot held the whole prompt, and the logits after it
            self._engine.eval({slot: feed}, prompt_logits, hook)
        run = generation.SeqRun(slot, slot, sampler, TextAssembler(params.stop), params.max_tokens,
                                deadline=None if time_limit_s is None else time.monotonic() + time_limit_s,
                                want_logits=logits, shown_special=params.preserved_tokens)
        self._runs[slot] = run
        return self._batch.add(run)

    def step(self, idle_wait_s: float = 0.05) -> List[generation.Event]:
        """One token (or its end) for every live slot, then the new tokens fed in one decode. A slot whose
        grammar's draw is still running skips the step; when nothing else happened, this waits up to idle_wait_s
        for such a draw (rather than spinning)."""
        events = self._batch.sample() + self._batch.feed()
        if not events and idle_wait_s > 0:
            self._batch.wait_for_draws(idle_wait_s)
        return events

    def ride(self) -> Tuple[List[generation.Event], Dict[int, List[int]]]:
        """Between a prompt's chunks (`start(between_chunks=)`): a token (or its end) for every live slot, as in
        `step()`, but not fed here: returns (the events, the tokens to decode with the prompt's next chunk)."""
        events = self._batch.sample()
        ends, riders = self._batch.ride()
        return events + ends, riders

    def take_prompt_logits(self, slot: int) -> Any:
        """float32 [n, n_vocab]: the logits after each token of the slot's prompt (`start(prompt_logits=True)`),
        handed over (without a copy; the engine keeps none of them, a second call gives none)."""
        return self._engine.take_logits_all(slot)

    @property
    def n_live(self) -> int:
        """Slots generating now."""
        return len(self._batch.live)

    def generated(self, slot: int) -> Tuple[List[int], int]:
        """The tokens `slot` generated (its end-of-generation token not included), and how many of the last of
        them the cache does not hold yet (0 or 1: the one shown last is fed at the next step)."""
        run = self._runs.get(slot)
        if run is None:
            return [], 0
        return list(run.tokens), int(run.pending is not None)

    def cache_summary(self, slot: int) -> dict:
        """What the slot's cache did for its request: entries `kept` now, `evicted` since the request started (a
        restored session's earlier evictions not counted), `peak` entries held at once, and the policy."""
        st = self.llm.kv_state(slot)
        policy = self.llm.policy_of(slot)
        summary = {"policy": policy.label, "budget": policy.budget, "kept": st.n_cells,
                   "evicted": st.n_evicted - self._evicted_before.get(slot, 0), "peak": st.peak_cells,
                   "protected": st.n_keep}
        if st.n_spilled or len(st.host_positions):  # in host memory now, and brought back by a prompt so far
            summary.update(host=int(len(st.host_positions)), recalled=int(st.n_recalled))
        return summary

    def view(self, slot: int) -> dict:
        """What the slot's cache holds now, for a live view: the kept `positions` (token indices of the prompt and
        answer, as fed: a roll renumbers the cells, not these), their `scores` (4 significant digits), tokens `seen` (fed) and
        `evicted` since the slot was last emptied, the entries waiting in host memory (`host`, with recall: every
        evicted position from `host_from` on, as the store drops the oldest first) and those a prompt brought back
        from there (`recalled`). Under a per-head policy the positions are those some layer's KV
        head holds and the scores the share of the layers' KV heads that hold each."""
        st = self.llm.kv_state(slot)
        positions, share = st.held()
        scores = share if st.head_positions is not None else st.scores
        return {"positions": [int(p) for p in positions], "scores": [float(f"{x:.4g}") for x in scores],
                "seen": int(st.n_seen), "evicted": int(st.n_evicted), "host": int(len(st.host_positions)),
                "host_from": int(st.host_origins.min()) if len(st.host_origins) else None,
                "recalled": int(st.n_recalled)}

    def save(self, slot: int) -> Any:
        """A snapshot of the slot's cache (`Llama.load_state` / `start(resume=...)` take it back)."""
        return self._engine.snapshot(slot)

    def close(self) -> None:
        """Stop drawing aside (a draw still running ends on its own; its token is dropped)."""
        if isinstance(self._draws, concurrent.futures.ThreadPoolExecutor):
            self._draws.shutdown(wait=False, cancel_futures=True)

    def release(self, slot: int) -> None:
        """The slot leaves the steps and is emptied."""
        self._batch.cancel(slot)
        self._runs.pop(slot, None)
        self._evicted_before.pop(slot, None)
        self._engine.reset_seq(slot)
