"""Each policy's rule on synthetic scores, without a model (as kvpress tests its presses): what `Policy.select`
returns equals an independent NumPy selection by the policy's ranking."""
import numpy as np
import pytest

from h2o_local import _engine


def reference_keep(n, sinks, heavy, recent, rank):
    """The first `sinks`, the `recent` newest, and the `heavy` best-ranked of the rest (ties: the older)."""
    middle = np.arange(sinks, n - recent)
    order = sorted(middle.tolist(), key=lambda i: (-rank[i], i))[:heavy]
    return sorted(list(range(sinks)) + order + list(range(n - recent, n)))


RANKS = {
    "h2o": lambda total, head, queries: total,
    "tova": lambda total, head, queries: total,
    "h2o_norm": lambda total, head, queries: total / queries,
    "h2o_maxhead": lambda total, head, queries: head.max(axis=1),
    "h2o_headnorm": lambda total, head, queries: (head / np.where(head.max(axis=0) > 0, head.max(axis=0), 1)).sum(axis=1),
}


@pytest.mark.parametrize("name", sorted(RANKS))
@pytest.mark.parametrize("seed", range(5))
def test_a_ranked_policy_keeps_its_best_ranked_entries(name, seed):
    rng = np.random.default_rng(seed)
    n, n_head = 60, 4
    head = rng.random((n, n_head)).astype(np.float32) * rng.integers(1, 4, size=(n, 1))
    head[rng.integers(0, n, 5)] = head[rng.integers(0, n, 5)]  # some ties
    total = head.sum(axis=1, dtype=np.float32)
    queries = rng.integers(1, 100, size=n).astype(np.int64)
    positions = np.sort(rng.choice(1000, n, replace=False)).astype(np.int32)
    policy = _engine.Policy(name, 24, sinks=2)
    kept = policy.select(positions, total, head, queries)
    rank = RANKS[name](total, head, queries).astype(np.float32)
    assert kept == reference_keep(n, policy.sinks, policy.heavy, policy.recent, rank)


@pytest.mark.parametrize("name,sinks", [("local", 0), ("sink", 4)])
def test_window_policies_keep_the_first_sinks_and_the_newest(name, sinks):
    policy = _engine.Policy(name, 16)
    n = 40
    kept = policy.select(np.arange(n, dtype=np.int32), np.ones(n, np.float32), np.ones((n, 1), np.float32),
                       np.ones(n, np.int64))
    assert policy.sinks == sinks and kept == list(range(sinks)) + list(range(n - (16 - sinks), n))


def test_scores_that_do_not_describe_the_entries_are_an_error():
    with pytest.raises(ValueError, match="n entries"):
        _engine.Policy("h2o", 8).select(np.arange(10, dtype=np.int32), np.ones(9, np.float32),
                                      np.ones((10, 2), np.float32), np.ones(10, np.int64))
