"""An independent NumPy reference of the published H2O rule (llama-recipes / H2O real-drop), for one sequence.

It never calls the engine: it receives the raw per-head column sums that a forward pass produced for each cached
position and decides on its own what to keep:
  - scores accumulate the raw probabilities (summed over heads, in head order, float32), no decay;
  - new tokens start at their own column sum; an evicted token's score is dropped;
  - when more than sinks + heavy + recent positions are cached, keep the first `sinks`, the `recent` newest
    (the newest token included), and the `heavy` best-scored among the rest (ties: the older position).
"""
from __future__ import annotations

import numpy as np


class H2OReference:
    def __init__(self, heavy: int, recent: int, sinks: int = 0):
        self.heavy, self.recent, self.sinks = heavy, recent, sinks
        self.scores: dict[int, np.float32] = {}

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
        sinks = order[: self.sinks]
        recent = order[len(order) - self.recent :]
        middle = order[self.sinks : len(order) - self.recent]
        ranked = sorted(middle, key=lambda p: (-float(self.scores[p]), p))
        keep = sorted(sinks + ranked[: self.heavy] + recent)
        self.scores = {p: self.scores[p] for p in keep}
        return keep
