"""Bounded prefill: a prompt far longer than the cache is fed in chunks with eviction in between."""
import numpy as np
import pytest

from h2o_local import Llama


def test_prompt_ten_times_the_budget_stays_within_budget_plus_a_batch(tiny_model, long_text):
    budget, n_batch = 128, 64
    llm = Llama(tiny_model, policy="h2o", budget=budget, n_batch=n_batch)
    tokens = llm.tokenize(long_text)[: 10 * budget]
    assert len(tokens) == 10 * budget
    llm.eval(tokens)
    st = llm.kv_state()
    assert st.n_seen == len(tokens)
    assert st.n_cells == budget
    assert st.peak_cells <= budget + n_batch
    assert st.n_evicted == len(tokens) - budget
    # the context allocates budget + n_batch cells (llama.cpp rounds up to 256), not the prompt
    assert st.kv_cells == 256
    full = Llama(tiny_model, n_ctx=len(tokens))
    assert st.kv_bytes * 4 < full.kv_state().kv_bytes
    assert st.kv_bytes / st.kv_cells == full.kv_state().kv_bytes / full.kv_state().kv_cells


def test_prompt_that_fits_is_attended_whole_then_compressed(tiny_model, long_text):
    """Reference mode: with room for the whole prompt, nothing is evicted before the prompt has been seen."""
    llm = Llama(tiny_model, policy="h2o", budget=32, n_batch=64, n_ctx=512)
    tokens = llm.tokenize(long_text)[:300]
    llm.eval(tokens)
    st = llm.kv_state()
    assert st.peak_cells == 300 and st.n_cells == 32


def test_generation_after_a_long_prompt(tiny_model, long_text):
    llm = Llama(tiny_model, policy="h2o", budget=64, n_batch=32)
    prompt = llm.tokenize(long_text)[:1000]
    out = llm.create_completion(prompt, max_tokens=20, temperature=0)
    assert out["usage"]["prompt_tokens"] == 1000
    assert out["usage"]["completion_tokens"] == 20 or out["choices"][0]["finish_reason"] == "stop"
    assert llm.kv_state().peak_cells <= 64 + 32


@pytest.mark.slow
def test_real_model_long_prompt_bounded(smol_model, long_text):
    llm = Llama(smol_model, policy="h2o", budget=256, n_batch=128)
    tokens = llm.tokenize(long_text)[:2560]
    llm.eval(tokens)
    st = llm.kv_state()
    assert st.n_cells == 256 and st.peak_cells <= 256 + 128
    assert st.kv_cells == 512


def test_the_end_of_a_bounded_prompt_is_ranked_by_its_last_token(tiny_model, long_text):
    """A bounded prefill evicts between chunks only when the next piece needs the cells: TOVA's last token (decoded
    on its own) ranks the prompt's whole last piece, as it would if the prompt fitted, not what survived an eviction
    ranked by the piece's own queries."""
    budget, n_batch = 16, 32
    llm = Llama(tiny_model, policy="tova", budget=budget, n_batch=n_batch)
    prompt = llm.tokenize(long_text)[:60]  # a first piece of 32 (evicted: 28 more do not fit), then 27 + the last
    llm.eval(prompt)
    candidates, sums = llm.last_scores()
    assert set(range(n_batch, len(prompt))) <= set(candidates.tolist())
    assert len(candidates) == budget + len(prompt) - n_batch
    ranked = candidates[:-1][np.argsort(-sums[:-1].sum(axis=1), kind="stable")]
    st = llm.kv_state()
    assert st.positions.tolist() == sorted(ranked[: budget - 1].tolist() + [len(prompt) - 1])
    assert st.peak_cells == len(candidates) <= budget + n_batch
