"""An independent NumPy reference of the published H2O rule (llama-recipes / H2O real-drop), for one sequence.

It never calls the engine: it receives the raw per-head column sums that a forward pass produced for each cached
position and decides on its own what to keep:
  - scores accumulate the raw probabilities (summed over heads, in head order, float32), no decay;
  - new tokens start at their own column sum; an evicted token's score is dropped;
  - when more than sinks + heavy + recent positions are cached, keep the first `sinks`, the `recent` newest
    (the newest token included), and the `heavy` best-scored among the rest (ties: the older position).
  - a protected prefix of `keep` positions (the oldest) is always kept and counts inside the budget: the rule then
    runs on the positions after it, with the prefix's size taken from the sinks, then heavy, then recent.
"""
from __future__ import annotations

import numpy as np


class H2OReference:
    def __init__(self, heavy: int, recent: int, sinks: int = 0, keep: int = 0):
        self.heavy, self.recent, self.sinks, self.keep = heavy, recent, sinks, keep
        self.scores: dict[int, np.float32] = {}

    def tail_split(self) -> tuple[int, int, int]:
        """(sinks, heavy, recent) for the positions after the protected prefix."""
        split, left = [self.sinks, self.heavy, self.recent], self.keep
        for i in range(3):
            taken = min(split[i], left)
            split[i] -= taken
            left -= taken
        assert split[2] >= 1 and left == 0, "the prefix leaves no room for the newest token"
        return split[0], split[1], split[2]

    def step(self, positions: np.ndarray, head_sums: np.ndarray) -> list[int]:
        """Fold one forward pass (positions cached now, their [n, n_head] column sums); return the kept positions."""
        agg = np.zeros(len(positions), dtype=np.float32)
        for h in range(head_sums.shape[1]):
            agg += head_sums[:, h]
        for p, s in zip(positions.tolist(), agg):
            self.scores[p] = np.float32(self.scores.get(p, np.float32(0)) + s)
        assert set(self.scores) == set(positions.tolist()), "the reference and the cache disagree on what is cached"

        order = sorted(self.scores)
        if len(order) <= self.sinks + self.heavy + self.recent:
            return order
        protected, order = order[: self.keep], order[self.keep :]
        n_sinks, n_heavy, n_recent = self.tail_split()
        sinks = order[:n_sinks]
        recent = order[len(order) - n_recent :]
        middle = order[n_sinks : len(order) - n_recent]
        ranked = sorted(middle, key=lambda p: (-float(self.scores[p]), p))
        keep = sorted(protected + sinks + ranked[:n_heavy] + recent)
        self.scores = {p: self.scores[p] for p in keep}
        return keep


class ScorerReference:
    """The scoring policies' rules (cpp/policies/), written from their papers' descriptions, for one sequence.

    Per position it keeps per-head scores and the number of queries that have seen the position. A step folds one
    forward pass: `n_new` tokens were fed (the newest positions), `in_query_window` says the pass was a prompt's query
    window (SnapKV), `replace` rules start from zero at every pass (TOVA). Ranking, per rule:
      h2o: sum over heads; h2o_norm: that sum / queries; h2o_maxhead: the largest head; h2o_headnorm: each head
      divided by its largest over the kept positions, summed; tova: as h2o (scores replaced every pass);
      snapkv: as h2o, averaged over the 5 neighbouring kept positions (zeros past the ends), replaced by a window.
    Sinks, heavy and recent as in H2OReference; ties go to the older position.
    """

    def __init__(self, rule: str, heavy: int, recent: int, sinks: int = 0):
        self.rule, self.heavy, self.recent, self.sinks = rule, heavy, recent, sinks
        self.head: dict[int, np.ndarray] = {}
        self.queries: dict[int, int] = {}

    def step(self, positions: np.ndarray, head_sums: np.ndarray, n_new: int, in_query_window: bool = False) -> list[int]:
        positions = positions.tolist()
        for p in self.queries:
            self.queries[p] += n_new
        for i, p in enumerate(positions[len(positions) - n_new:]):
            self.queries[p] = n_new - i
        if self.rule == "tova" or (self.rule == "snapkv" and in_query_window):
            self.head = {}
        for p, sums in zip(positions, head_sums.astype(np.float32)):
            self.head[p] = self.head.get(p, np.zeros(len(sums), np.float32)) + sums
        assert set(self.queries) == set(positions), "the reference and the cache disagree on what is cached"

        order = sorted(self.queries)
        if len(order) <= self.sinks + self.heavy + self.recent:
            return order
        rank = dict(zip(order, self.rank(order)))
        middle = order[self.sinks : len(order) - self.recent]
        ranked = sorted(middle, key=lambda p: (-float(rank[p]), p))
        keep = sorted(order[: self.sinks] + ranked[: self.heavy] + order[len(order) - self.recent :])
        self.head = {p: self.head[p] for p in keep}
        self.queries = {p: self.queries[p] for p in keep}
        return keep

    def total(self, p: int) -> np.float32:
        t = np.float32(0)
        for v in self.head[p]:
            t = np.float32(t + v)
        return t

    def rank(self, order: list[int]) -> list[np.float32]:
        if self.rule in ("h2o", "tova"):
            return [self.total(p) for p in order]
        if self.rule == "h2o_norm":
            return [np.float32(self.total(p) / np.float32(self.queries[p])) for p in order]
        if self.rule == "h2o_maxhead":
            return [self.head[p].max() for p in order]
        if self.rule == "h2o_headnorm":
            peak = np.max([self.head[p] for p in order], axis=0)
            out = []
            for p in order:
                r = np.float32(0)
                for v, m in zip(self.head[p], peak):
                    r = np.float32(r + (v / m if m > 0 else np.float32(0)))
                out.append(r)
            return out
        if self.rule == "snapkv":
            totals = [self.total(p) for p in order]
            out = []
            for i in range(len(order)):
                r = np.float32(0)
                for j in range(max(0, i - 2), min(len(order), i + 3)):
                    r = np.float32(r + totals[j])
                out.append(np.float32(r / np.float32(5)))
            return out
        raise ValueError(self.rule)
