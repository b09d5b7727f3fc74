"""The attention designs a user's GGUF may bring, each as a tiny random model: Qwen3 (per-head q/k norms, heads wider
than n_embd / n_head), Gemma 2 (a sliding window on every other layer, soft-capped logits), Gemma 3 (five window
layers to one global, llama.cpp's iSWA cache), Phi-3 (fused q/k/v) and DeepSeek-V2's latent attention (MLA: the
cache holds one compressed row per token and no V). On each, the engine's contract holds as on a llama: a budget
that never evicts is the full cache, the exported scores are each query's attention, eviction keeps the budget, and
a bounded snapshot continues as the original, and embeddings come from a context of their own."""
import numpy as np
import pytest

from device_tolerance import approximate, assert_logits_close, assert_values_close
from greedy import greedy_continuation
from h2o_local import Llama
from tiny_model import write_tiny_deepseek2, write_tiny_gemma2, write_tiny_gemma3, write_tiny_phi3, write_tiny_qwen3

# writer, the layers that attend all tokens (the scored ones), and whether the cache can keep evicted entries apart
ARCHITECTURES = {
    "qwen3": (write_tiny_qwen3, 2, True),
    "gemma2": (write_tiny_gemma2, 2, False),  # layers 1 and 3; 0 and 2 attend a 32-token window
    "gemma3": (write_tiny_gemma3, 1, False),  # layer 5; 0-4 attend a 32-token window
    "phi3": (write_tiny_phi3, 2, True),
    "deepseek2-mla": (write_tiny_deepseek2, 2, True),
}
N_HEAD = 4
PROMPT = [3 + (7 * i) % 250 for i in range(200)]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request, tmp_path_factory):
    write, n_scored, separable = ARCHITECTURES[request.param]
    path = write(tmp_path_factory.mktemp("models") / f"tiny-{request.param}.gguf")
    return str(path), n_scored, separable


@pytest.mark.parametrize("policy", [None, "h2o", "tova"])
def test_a_budget_that_never_evicts_gives_the_full_cache_output(arch, policy):
    path, _, _ = arch
    full = Llama(path, n_ctx=1024)
    scored = Llama(path, n_ctx=1024, export_scores=True)  # the bounded cache's graph, the scores' pass included
    bounded = Llama(path, policy=policy, budget=600)
    for llm in (full, scored, bounded):
        llm.eval(PROMPT)
    assert bounded.kv_state().n_evicted == 0
    a, s, b = greedy_continuation(full), greedy_continuation(scored), greedy_continuation(bounded)
    assert b[0] == s[0] and np.array_equal(b[1], s[1])
    # the scores' pass changes no output; on a device with flash attention, a graph with it rounds otherwise
    # (lavapipe, Gemma 2's soft-capped attention: 3.6e-6)
    assert_logits_close(b[1], a[1], device=approximate(bounded), cpu_atol=0.0)


def test_the_exported_scores_are_each_querys_attention(arch):
    # each query's softmax sums to 1 in every head of every scored layer: the column sums over a prompt add up to
    # layers x heads x tokens, spread over the prompt's positions (not a uniform or a zero export)
    path, n_scored, _ = arch
    llm = Llama(path, n_ctx=1024, export_scores=True)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert st.positions.tolist() == list(range(len(PROMPT)))
    assert float(np.sum(st.scores)) == pytest.approx(n_scored * N_HEAD * len(PROMPT), rel=1e-4)
    assert np.all(st.scores > 0) and st.scores.max() > 4 * np.median(st.scores)


@pytest.mark.parametrize("policy", [None, "h2o", "local", "sink", "snapkv", "keydiff"])
def test_eviction_keeps_the_budget_through_the_prompt_and_generation(arch, policy):
    path, _, _ = arch
    llm = Llama(path, policy=policy, budget=48, n_batch=64)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert len(st.positions) == 48 and st.n_evicted == len(PROMPT) - 48
    _, logits = greedy_continuation(llm, 24)  # generation past the budget evicts token by token
    assert len(llm.kv_state().positions) == 48 and np.isfinite(logits).all()
    assert llm.kv_state().positions[-1] == len(PROMPT) + 23


def test_a_bounded_snapshot_loads_and_continues_as_the_original(arch):
    path, _, _ = arch
    llm = Llama(path, policy="h2o", budget=48, n_batch=64)
    llm.eval(PROMPT)
    kept = llm.kv_state().positions.tolist()
    snap = llm.save_state()
    first = greedy_continuation(llm)
    llm.load_state(snap)
    assert llm.kv_state().positions.tolist() == kept
    again = greedy_continuation(llm)
    llm.load_state(snap)
    third = greedy_continuation(llm)
    assert again[0] == first[0] == third[0]
    assert np.array_equal(third[1], again[1])  # two restores: the same cells, bit for bit
    # against the original, the cells lie in another order (the new tokens' cells depend on the cache's history): the
    # attention sums run in another order, which the sliding-window models' random weights amplify to 7e-4 in some
    # logits on the CPU (6e-3 with flash attention; the tokens stay the same; a lost or extra entry moves them by ~1)
    assert_logits_close(again[1], first[1], device=approximate(llm), cpu_atol=2e-3)
    assert np.abs(again[1] - first[1]).mean() < 1e-3


def test_recall_keeps_evictions_in_host_memory_where_the_cache_can_part_them(arch):
    path, _, separable = arch
    if not separable:  # a window cache beside the base cache: its entries cannot be taken out one by one
        with pytest.raises(ValueError, match="recall is not available"):
            Llama(path, budget=48, recall=True)
        return
    llm = Llama(path, budget=48, recall=True, n_batch=64)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert len(st.positions) == 48 and st.n_evicted == len(PROMPT) - 48
    llm.eval(PROMPT[:16])  # a new prompt brings back what it attends of what was spilled, within the budget
    assert len(llm.kv_state().positions) == 48
    assert np.isfinite(llm.last_logits()).all()


def test_embeddings_pool_the_per_token_rows_and_leave_the_generation_s_cache_as_it_was(arch):
    path, _, _ = arch
    llm = Llama(path, policy="h2o", budget=64, pooling_type=0)
    llm.eval(PROMPT)
    before = llm.kv_state()
    rows = np.asarray(llm.embed(PROMPT[:40]))
    assert rows.shape == (40, llm.n_embd()) and np.all(np.isfinite(rows))
    mean = np.asarray(Llama(path, policy="full", n_ctx=256, pooling_type=1).embed(PROMPT[:40]))
    assert_values_close(mean, rows.mean(axis=0), device=approximate(llm), cpu_rtol=1e-5, cpu_atol=1e-6)
    after = llm.kv_state()
    assert after.positions.tolist() == before.positions.tolist() and np.array_equal(after.scores, before.scores)
