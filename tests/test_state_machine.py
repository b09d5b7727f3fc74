"""A stateful randomized test: long random sequences of eval / generate / evict / roll / reset / save / load /
set_policy over two sequences, checked after every step against a small Python model of what the cache must hold.

CI runs a small number of examples; a large run:
    H2O_LOCAL_FUZZ_EXAMPLES=2000 H2O_LOCAL_FUZZ_STEPS=80 pytest tests/test_state_machine.py
"""
import os

import numpy as np
import pytest

import hypothesis
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, rule,  # noqa: E402
                                 run_state_machine_as_test)

from h2o_local import H2O, Llama, Local, Sink  # noqa: E402

BUDGET, N_BATCH, N_SEQ = 12, 8, 2
PROBE = 70  # the token fed to compare a snapshot's continuation with the original's
EXAMPLES = int(os.environ.get("H2O_LOCAL_FUZZ_EXAMPLES", "12"))
STEPS = int(os.environ.get("H2O_LOCAL_FUZZ_STEPS", "30"))
# shrinking a failure can take minutes: CI reports the failing run as found (H2O_LOCAL_FUZZ_SHRINK=1 shrinks it)
PHASES = list(hypothesis.Phase) if os.environ.get("H2O_LOCAL_FUZZ_SHRINK") else \
    [hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate]

seqs = st.integers(0, N_SEQ - 1)
token_lists = st.lists(st.integers(3, 258), min_size=1, max_size=20)


class CacheMachine(RuleBasedStateMachine):
    rolling = False
    snapshots = Bundle("snapshots")

    @initialize()
    def create(self):
        self.llm = Llama(self.model_path, budget=BUDGET, n_batch=N_BATCH, n_seq_max=N_SEQ,
                         position_rolling=self.rolling, roll_interval=3 if self.rolling else 1)
        self.budget = BUDGET
        self.seen = [0] * N_SEQ    # tokens fed since the last reset
        self.cells = [0] * N_SEQ   # entries the cache must hold
        self.pending = 0           # seq 0: a token shown by generate and not fed yet

    # ------------------------------------------------------------------ rules
    @rule(seq=seqs, tokens=token_lists)
    def eval(self, seq, tokens):
        self.llm.eval(tokens, seq_id=seq)
        self._fed(seq, len(tokens))
        if seq == 0:
            self.pending = 0  # the shown token belongs to seq 0: a call on another sequence keeps it

    @rule(prompt=st.lists(st.integers(3, 258), max_size=6), max_tokens=st.integers(0, 6))
    def generate_on(self, prompt, max_tokens):
        if not prompt and self.seen[0] + self.pending == 0:
            return  # nothing to continue from
        shown = 0
        reason = None
        for e in self.llm.generate_events(prompt, reset=False, max_tokens=max_tokens, temperature=0):
            if e.token is None:
                reason = e.finish_reason
            else:
                shown += 1
        # each shown token is fed before the next is drawn; after "length" the last one waits for the next call
        # (an end-of-generation token is drawn after the last shown one was fed, and is itself not fed)
        last_unfed = 1 if shown and reason == "length" else 0
        self._fed(0, self.pending + len(prompt) + shown - last_unfed)
        self.pending = last_unfed
        assert shown <= max_tokens

    @rule(seq=st.one_of(st.none(), seqs))
    def reset(self, seq):
        self.llm.reset(seq)
        for s in range(N_SEQ) if seq is None else [seq]:
            self.seen[s] = self.cells[s] = 0
        if seq in (None, 0):
            self.pending = 0

    @rule(target=snapshots, seq=seqs)
    def save(self, seq):
        # a snapshot of seq 0 carries the token generate showed but did not feed
        pending = self.pending if seq == 0 else 0
        state = self.llm.save_state(seq)
        probe = None
        if self.cells[seq] and not pending:
            # what the original computes next; put back from the snapshot afterwards (a load must compute the same)
            self.llm.eval([PROBE], seq_id=seq)
            probe = self.llm.last_logits(seq).copy()
            self.llm.load_state(state, seq_id=seq)
        return state, self.llm.kv_state(seq).positions.tolist(), self.seen[seq], self.cells[seq], pending, probe

    @rule(snap=snapshots, seq=seqs)
    def load(self, snap, seq):
        state, positions, seen, cells, pending, probe = snap
        self.llm.load_state(state, seq_id=seq)
        assert self.llm.kv_state(seq).positions.tolist() == positions
        if probe is not None:
            self.llm.eval([PROBE], seq_id=seq)
            # cells may sit elsewhere than in the original: float summation order only (a lost K shift: several units)
            np.testing.assert_allclose(self.llm.last_logits(seq), probe, atol=5e-3)
            self.llm.load_state(state, seq_id=seq)
        self.seen[seq], self.cells[seq] = seen, cells
        if seq == 0:
            self.pending = pending

    @rule(kind=st.sampled_from(["h2o", "local", "sink"]), budget=st.integers(4, BUDGET), seq=seqs)
    def switch_policy_and_compress(self, kind, budget, seq):
        policy = {"h2o": H2O(budget=budget), "local": Local(budget=budget), "sink": Sink(budget=budget)}[kind]
        self.llm.set_policy(policy)
        self.budget = budget
        self.llm.compress(seq)
        self.cells[seq] = min(self.cells[seq], budget)
        if seq == 0:
            self.pending = 0

    # ------------------------------------------------------------------ the model
    def _fed(self, seq, n):
        if n == 0:
            return  # no forward pass, no eviction (a sequence may hold more than a budget lowered since)
        self.seen[seq] += n
        self.cells[seq] = min(self.cells[seq] + n, self.budget)

    @invariant()
    def cache_matches_the_model(self):
        if not hasattr(self, "llm"):
            return
        for s in range(N_SEQ):
            st_ = self.llm.kv_state(s)
            pos = st_.positions.tolist()
            assert st_.n_cells == self.cells[s], (s, st_.n_cells, self.cells[s])
            assert st_.n_seen == self.seen[s]
            assert st_.n_seen - st_.n_evicted == st_.n_cells
            assert pos == sorted(set(pos))
            assert self.llm._engine.seq_pos_range(s) == ((min(pos), max(pos)) if pos else (-1, -1))
            if pos and not self.rolling:
                assert pos[-1] == st_.n_seen - 1  # the newest token is always kept, at its own position
            if self.rolling:
                assert not pos or pos[-1] < BUDGET + 3 + N_BATCH  # drift bounded by the roll interval


class RollingCacheMachine(CacheMachine):
    rolling = True


def _run(machine, model_path):
    machine.model_path = model_path
    run_state_machine_as_test(machine, settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS,
                                                         deadline=None, database=None, phases=PHASES,
                                                         suppress_health_check=list(hypothesis.HealthCheck)))


def test_random_sessions_keep_the_cache_consistent(tiny_model):
    _run(CacheMachine, tiny_model)


def test_random_sessions_with_position_rolling(tiny_model):
    _run(RollingCacheMachine, tiny_model)
