"""With a budget that never triggers eviction, every policy computes exactly what the full cache computes."""
import numpy as np
import pytest

from device_tolerance import approximate, assert_logits_close
from greedy import greedy_trace
from h2o_local import Llama
from support.engine_view import ubatch
from twin_sessions import run_twin_sessions

PROMPT = "Once upon a time, in a small village by the sea, there lived an old clockmaker."


@pytest.mark.parametrize("policy,budget", [("h2o", 1000), ("local", 1000), ("sink", 1000)])
def test_unreached_budget_gives_the_full_cache_logits_exactly(tiny_model, policy, budget):
    full = Llama(tiny_model, n_ctx=1536)
    bounded = Llama(tiny_model, policy=policy, budget=budget, n_ctx=1536)
    prompt = full.tokenize(PROMPT)
    t_full, l_full = greedy_trace(full, prompt, 40)
    t_bnd, l_bnd = greedy_trace(bounded, prompt, 40)
    assert bounded.kv_state().n_evicted == 0
    assert t_bnd == t_full
    assert np.array_equal(l_bnd, l_full)  # bit for bit: score export only reads the softmax


@pytest.mark.parametrize("policy", [None, "tova", "snapkv", "h2o"])
def test_a_prompt_that_does_not_evict_is_cut_as_the_full_cache_cuts_it(tiny_model, policy):
    """llama.cpp's arithmetic depends on how a prompt is cut into decodes (here the last token decoded alone moved
    the logits by 1e-6; on Qwen2.5 and Gemma 3 Q4_K_M a 32-token last chunk moved them by up to 0.8), so a query
    window (TOVA's last token, SnapKV's last tokens, the default's question) is decoded apart only where the prompt
    ends in an eviction, which ranks by it: a prompt after which nothing is evicted goes in the full cache's cuts."""
    prompt = [3 + i % 250 for i in range(600)]  # 512 + 88 tokens at n_batch 512
    full = Llama(tiny_model, n_ctx=1536)
    bounded = Llama(tiny_model, policy=policy, budget=1000, n_ctx=1536, export_scores=True)
    for llm in (full, bounded):
        llm.eval(prompt)
    assert bounded.kv_state().n_evicted == 0
    assert np.array_equal(bounded.last_logits(), full.last_logits())
    # the last decode's queries: each adds a probability of 1 per head and layer (2 layers)
    np.testing.assert_allclose(bounded.last_scores()[1].sum(0), 2 * 88, rtol=1e-4)
    if policy is None:  # a prompt that evicts: the question is decoded on its own
        small = Llama(tiny_model, budget=100, n_ctx=1536)
        small.eval(prompt)
        assert small.kv_state().n_evicted == 500
        assert small.stats()["decodes"] == 1 + 2 + 1  # 512, then 56, the question's 32, and its probe


def test_generate_matches_the_full_cache(tiny_model):
    full = Llama(tiny_model, n_ctx=512)
    h2o = Llama(tiny_model, policy="h2o", budget=400, n_ctx=512)
    a = full.create_completion(PROMPT, max_tokens=30, temperature=0.7, seed=3)
    b = h2o.create_completion(PROMPT, max_tokens=30, temperature=0.7, seed=3)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"] == b["usage"]


def test_eviction_changes_the_computation(tiny_model):
    """The converse: once the budget is reached, logits differ from the full cache's (the check can fail)."""
    full = Llama(tiny_model, n_ctx=512)
    small = Llama(tiny_model, policy="h2o", budget=8, n_ctx=512)
    prompt = full.tokenize(PROMPT)
    _, l_full = greedy_trace(full, prompt, 5)
    _, l_small = greedy_trace(small, prompt, 5)
    assert not np.allclose(l_full[1:], l_small[1:])


@pytest.mark.slow
def test_real_model_h2o_with_a_large_budget_equals_the_full_cache(smol_model):
    full = Llama(smol_model, n_ctx=1024)
    h2o = Llama(smol_model, policy="h2o", budget=900, n_ctx=1024)
    prompt = full.tokenize("The three most important inventions of the nineteenth century were")
    t_full, l_full = greedy_trace(full, prompt, 24)
    t_h2o, l_h2o = greedy_trace(h2o, prompt, 24)
    assert t_h2o == t_full
    assert np.array_equal(l_h2o, l_full)


def test_the_benchmarks_plain_llama_cpp_baseline_decodes_what_the_full_cache_decodes(tiny_model):
    """benchmarks/bench.py's "llama.cpp" setting (llama.cpp's own API, nothing of ours around it) does the same work
    as the full cache: the same greedy tokens, from the same prompt cut into the same chunks, on the same backend."""
    from h2o_local import _engine

    full = Llama(tiny_model, n_ctx=512, n_batch=32, n_gpu_layers=-1, flash_attn=False)
    prompt = full.tokenize(PROMPT)
    tokens, _ = greedy_trace(full, prompt, 12)
    run = _engine.plain_run(tiny_model, prompt, 12, n_gpu_layers=-1, flash_attn=False, n_batch=32)
    assert run["tokens"] == tokens
    assert len(run["step_s"]) == 12 and all(s > 0 for s in run["step_s"]) and run["prefill_s"] > 0
    # a warm-up on part of the prompt is forgotten before the timed run
    warm = _engine.plain_run(tiny_model, prompt, 12, n_gpu_layers=-1, flash_attn=False, n_batch=32,
                             warmup_tokens=len(prompt) // 2)
    assert warm["tokens"] == tokens
    with pytest.raises(ValueError, match="n_decode"):
        _engine.plain_run(tiny_model, prompt, 0)


@pytest.mark.parametrize("kw", [dict(policy="full", n_ctx=512), dict(policy="h2o", budget=24), dict(budget=24),
                                dict(policy="h2o-24+ph")], ids=["full", "h2o", "default", "per-head"])
def test_a_batch_computed_in_ubatches_is_evicted_as_one_batch(tiny_model, kw):
    """n_ubatch below n_batch (llama.cpp's physical batch: what its compute buffers hold): each batch is computed in
    ubatches and evicted once, after all of them, by its scores summed over all of them. The same decodes, entries
    kept and logits as one ubatch per batch: exactly on the CPU backend (its scores up to the order of additions), at
    the device's tolerance where attention adds in a device's precision."""
    one = Llama(tiny_model, n_batch=64, **kw)
    split = Llama(tiny_model, n_batch=64, n_ubatch=16, **kw)
    assert (ubatch(one), ubatch(split)) == (64, 16) and split.n_ctx() == one.n_ctx()
    assert ubatch(Llama(tiny_model, n_batch=64, n_ubatch=1000, **kw)) == 64  # llama.cpp's min(n_batch, n_ubatch)
    prompt = [3 + i % 250 for i in range(120)]  # two batches, an eviction after each in a bounded cache
    for llm in (one, split):
        llm.eval(prompt)
        llm.eval([7])
    assert split.stats()["decodes"] == one.stats()["decodes"]
    kept, got = one.kv_state(), split.kv_state()
    assert got.n_evicted == kept.n_evicted and (kept.n_evicted > 0) == (one.budget is not None)
    device = approximate(one)
    assert_logits_close(split.last_logits(), one.last_logits(), device=device, cpu_atol=0.0)
    if not device:
        assert got.positions.tolist() == kept.positions.tolist()
        np.testing.assert_allclose(got.scores, kept.scores, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs", [dict(kv_unified=True), dict(kv_unified=False, recall=True)],
                         ids=["unified", "streams+recall"])
def test_random_sessions_in_ubatches_keep_what_whole_batches_keep(tiny_model, kwargs):
    """Two sequences, policies with probes that ride, snapshots, recall: ubatches of 5 tokens beside batches of 16
    computed whole, whatever is called in whatever order (tests/support/twin_sessions.py)."""
    run_twin_sessions(tiny_model, ({"n_ubatch": 5}, {}), **kwargs)
