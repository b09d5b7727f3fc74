"""The per-head H2O simulation (experiments/perhead.py) against a physical-drop reference of the llama-recipes rule.

The simulation keeps every K/V and masks evicted (head, token) pairs; the reference below keeps, per KV head, only
the cached entries (key, value, score, position) and drops the rest, as llama-recipes' HHCache does. Fed the same
random queries, keys and values step by step, both must give the same attention outputs and keep the same tokens.
"""
import numpy as np
import pytest

OPTIONAL = "optional: the experiments extra (pip install '.[experiments]': torch, transformers) is not installed"
torch = pytest.importorskip("torch", reason=OPTIONAL)

from experiments.perhead import PerHeadH2O  # noqa: E402


class FakeAttention:
    def __init__(self, layer_idx, groups):
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups


def reference_step(cache, q, k, v, pos0, budget, groups, gqa):
    """cache: per KV head a list of [key, value, score, position]; q [n_heads, n_new, d], k/v [n_kv, n_new, d]."""
    n_heads, n_new, d = q.shape
    out = np.zeros((n_heads, n_new, d))
    for h, entries in enumerate(cache):
        for i in range(n_new):
            entries.append([k[h, i], v[h, i], 0.0, pos0 + i])
        add = np.zeros(len(entries))
        for j in range(groups):
            qh = h * groups + j
            for i in range(n_new):
                vis = [e for e in entries if e[3] <= pos0 + i]
                logits = np.array([q[qh, i] @ e[0] for e in vis]) / np.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[qh, i] = sum(pi * e[1] for pi, e in zip(p, vis))
                if gqa == "sum" or j == 0:
                    add[: len(vis)] += p  # visible entries are a prefix: the cache is in position order
        for e, a in zip(entries, add):
            e[2] += a
        if budget is not None and len(entries) > budget:
            heavy, recent = budget // 2, budget - budget // 2
            old = entries[: len(entries) - recent]
            top = sorted(sorted(range(len(old)), key=lambda t: -old[t][2])[:heavy])
            entries[:] = [old[t] for t in top] + entries[len(entries) - recent:]
    return out


@pytest.mark.parametrize("gqa", ["first", "sum"])
@pytest.mark.parametrize("budget", [6, 7, None])
def test_mask_simulation_equals_physical_drop(gqa, budget):
    rng = np.random.default_rng(0)
    n_kv, groups, d = 2, 3, 8
    sim = PerHeadH2O(n_layers=1, n_kv_heads=n_kv, gqa=gqa, budget=budget)
    ref = [[] for _ in range(n_kv)]
    keys = torch.zeros(1, n_kv, 0, d, dtype=torch.float64)
    values = torch.zeros(1, n_kv, 0, d, dtype=torch.float64)
    pos = 0
    for n_new in [9, 1, 1, 3, 1, 1, 1, 2, 1, 1]:  # a prompt, then decode steps and short chunks
        q = rng.standard_normal((n_kv * groups, n_new, d)) * 2
        k = rng.standard_normal((n_kv, n_new, d)) * 2
        v = rng.standard_normal((n_kv, n_new, d))
        keys = torch.cat([keys, torch.from_numpy(k)[None]], dim=2)
        values = torch.cat([values, torch.from_numpy(v)[None]], dim=2)
        n_tok = keys.shape[2]
        causal = torch.full((n_new, n_tok), float("-inf"), dtype=torch.float64).triu(n_tok - n_new + 1)
        out, _ = sim.attend(FakeAttention(0, groups), torch.from_numpy(q)[None], keys, values, causal[None, None],
                            scaling=d ** -0.5)
        expected = reference_step(ref, q, k, v, pos, budget, groups, gqa)
        pos += n_new
        np.testing.assert_allclose(out[0].transpose(0, 1).numpy(), expected, rtol=1e-5, atol=1e-6)  # the softmax runs in float32, as in transformers
        for h in range(n_kv):
            assert torch.nonzero(sim.keep[0][h]).flatten().tolist() == [e[3] for e in ref[h]]
    if budget is not None:
        assert sim.kept() == [n_kv * budget]
        # the heads disagree somewhere: the eviction really is per head
        assert not torch.equal(sim.keep[0][0], sim.keep[0][1])


def test_with_budget_evicts_a_prompt_at_once_and_keeps_the_recent_window():
    sim = PerHeadH2O(n_layers=1, n_kv_heads=1)
    sim.keep[0] = torch.ones(1, 10, dtype=torch.bool)
    sim.scores[0] = torch.tensor([[5.0, 0.1, 4.0, 0.2, 0.3, 3.0, 0.0, 0.0, 0.0, 0.0]])
    small = sim.with_budget(4)  # 2 heavy + 2 recent
    assert torch.nonzero(small.keep[0][0]).flatten().tolist() == [0, 2, 8, 9]
    assert sim.kept() == [10]  # the original is untouched: settings branch from it


def test_transformers_model_reads_the_gguf_as_llama_cpp_does(tiny_model):
    """Same GGUF, two runtimes: with nothing evicted, transformers through PerHeadH2O gives llama.cpp's logits."""
    pytest.importorskip("transformers", reason=OPTIONAL)
    pytest.importorskip("accelerate", reason=OPTIONAL)
    from h2o_local import Llama
    from experiments.perhead import HFModel

    tokens = [1] + list(range(40, 100))
    hf = HFModel(tiny_model, threads=1)
    cache, h2o, logits = hf.prefill(tokens, gqa="first")
    llm = Llama(tiny_model, n_ctx=128)
    llm.eval(tokens)
    ours = llm.last_logits()
    assert np.argmax(ours) == int(logits.argmax())
    np.testing.assert_allclose(logits.numpy(), ours, atol=5e-3 * np.abs(ours).max())  # F16 KV cells in llama.cpp
    assert h2o.kept() == [2 * len(tokens)] * 2  # full attention in the prompt: every head keeps every token
    assert h2o.with_budget(16).kept() == [2 * 16] * 2
