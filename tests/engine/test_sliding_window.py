"""A model whose layers mostly attend a sliding window (Gemma 3, gpt-oss, ...: llama.cpp's iSWA cache, a window
cache beside the base cache): the policies rank by the base layers' scores, an eviction removes a token from both
caches, and snapshots, compaction and a budget that never evicts behave as on any model."""
import numpy as np
import pytest

from h2o_local import Llama

PROMPT = [3 + (7 * i) % 250 for i in range(160)]  # five times the 32-token window


def continuation(llm: Llama, n: int = 12):
    """The greedy tokens after what the cache holds, and the logits each was drawn from."""
    tokens, logits = [], []
    for _ in range(n):
        logits.append(llm.last_logits().copy())
        tokens.append(int(np.argmax(logits[-1])))
        llm.eval([tokens[-1]])
    return tokens, np.stack(logits)


@pytest.mark.parametrize("budget", [None, 64])
def test_a_snapshot_taken_past_the_window_loads_and_continues_as_the_original(tiny_swa_model, budget):
    llm = Llama(tiny_swa_model, budget=budget, n_ctx=0 if budget else 1024)
    llm.eval(PROMPT)
    kept = llm.kv_state().positions.tolist()
    snap = llm.save_state()
    first = continuation(llm)
    llm.load_state(snap)  # refused once: the window cache's oldest entry is not the sequence's oldest
    assert llm.kv_state().positions.tolist() == kept
    again = continuation(llm)
    assert again[0] == first[0]
    np.testing.assert_allclose(again[1], first[1], rtol=1e-3, atol=1e-4)  # restored cells: sums in another order


@pytest.mark.parametrize("policy", [None, "h2o", "tova"])
def test_a_budget_that_never_evicts_gives_the_full_cache_output(tiny_swa_model, policy):
    full = Llama(tiny_swa_model, n_ctx=1024)
    bounded = Llama(tiny_swa_model, policy=policy, budget=600)
    for llm in (full, bounded):
        llm.eval(PROMPT)
    assert bounded.kv_state().n_evicted == 0
    a, b = continuation(full), continuation(bounded)
    assert b[0] == a[0]
    assert np.array_equal(b[1], a[1])


@pytest.mark.parametrize("policy", [None, "h2o", "local"])
def test_eviction_keeps_the_budget_through_the_prompt_and_generation(tiny_swa_model, policy):
    llm = Llama(tiny_swa_model, policy=policy, budget=48, n_batch=64)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert len(st.positions) == 48 and st.n_evicted == len(PROMPT) - 48
    _, logits = continuation(llm, 40)  # generation past the budget evicts token by token
    assert len(llm.kv_state().positions) == 48 and np.isfinite(logits).all()
    assert llm.kv_state().positions[-1] == len(PROMPT) + 39
