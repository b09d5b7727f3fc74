"""The exported scores are the attention probabilities' column sums, read another way."""
import numpy as np
import pytest

from attention_reference import LlamaReference
from h2o_local import Llama
from engine_view import sums_rows
from device_tolerance import CPU_BACKEND

# the CPU backend's own export without flash attention (its flash kernel's sums: tests/engine/test_flash_attn.py; a
# device's, both reductions: tests/engine/test_device.py)
CPU = dict(flash_attn=False, **CPU_BACKEND)

# llama.cpp multiplies Q4_1 weights with activations quantized to 8 bits; the reference stays in float64. Measured on
# SmolLM2 (51 tokens): largest relative difference 5%, 1.0% of the total mass, correlation 0.99998
TOL_QUANTIZED = 0.1

TEXT = "The lighthouse keeper climbed the stairs every evening to light the great lamp above the sea."


def oracle_check(llm: Llama, tokens, n_layer: int, tol: float = 1e-4):
    """Feed tokens into a fresh cache and compare the export with a NumPy forward pass over the same weights."""
    llm.reset()
    llm.eval(tokens)
    positions, exported = llm.last_scores(0)
    oracle = LlamaReference(llm.model_path).column_sums(tokens)
    assert positions.tolist() == list(range(len(tokens)))
    np.testing.assert_allclose(exported, oracle, rtol=tol, atol=tol)
    # every query row of every head and layer is a distribution over the cache
    assert exported.sum() == pytest.approx(n_layer * llm.info.n_head * len(tokens), rel=1e-5)
    return exported


def test_exported_scores_equal_softmax_column_sums(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=1000, kv_f32=True, **CPU)
    tokens = llm.tokenize(TEXT)
    exported = oracle_check(llm, tokens, n_layer=2)
    # causal attention: the first token gets attention from every query, the last only from itself
    assert exported[0].sum() > exported[-1].sum()


def test_decode_step_scores_equal_softmax_column_sums(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=1000, kv_f32=True, **CPU)
    tokens = llm.tokenize(TEXT)
    llm.eval(tokens)
    llm.eval([65])  # one decode step: one query row per head and layer
    positions, exported = llm.last_scores(0)
    oracle = LlamaReference(tiny_model).column_sums(tokens + [65], queries=slice(-1, None))
    assert positions.tolist() == list(range(len(tokens) + 1))
    np.testing.assert_allclose(exported, oracle, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(exported.sum(axis=0), 2.0, rtol=1e-5)  # per head: 2 layers x 1 query


def test_sum_rows_path_gives_the_same_scores(tiny_model):
    """The Metal path (transpose + sum_rows), forced on the CPU, against the out_prod path."""
    a = Llama(tiny_model, policy="h2o", budget=1000, **CPU)
    b = Llama(tiny_model, policy="h2o", budget=1000, _scores_sum_rows=True, **CPU)
    assert not sums_rows(a) and sums_rows(b)  # which reduction the engine chose
    tokens = a.tokenize(TEXT)
    for llm in (a, b):
        llm.eval(tokens)
        llm.eval([70, 71])
    pa, sa = a.last_scores(0)
    pb, sb = b.last_scores(0)
    assert pa.tolist() == pb.tolist()
    np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.kv_state().head_scores, b.kv_state().head_scores, rtol=1e-5, atol=1e-5)


def test_scores_follow_positions_not_cells(tiny_model):
    """After eviction, freed cells are reused by new tokens: scores must still be keyed by position."""
    llm = Llama(tiny_model, policy="h2o", budget=8, n_batch=8)
    llm.eval(llm.tokenize(TEXT))
    kept = llm.kv_state().positions.tolist()
    llm.eval([66])
    positions, exported = llm.last_scores(0)
    assert positions.tolist() == sorted(kept + [max(kept) + 1])
    assert exported.sum() == pytest.approx(2 * 4 * 1, rel=1e-5)


@pytest.mark.slow
def test_real_model_scores_equal_softmax_column_sums(smol_model):
    llm = Llama(smol_model, policy="h2o", budget=4096, kv_f32=True)
    assert llm.info.n_head == 9 and llm.info.n_head_kv == 3  # GQA 3:1
    tokens = llm.tokenize(TEXT * 3)
    exported = oracle_check(llm, tokens, n_layer=30, tol=TOL_QUANTIZED)
    oracle = LlamaReference(smol_model).column_sums(tokens)
    assert np.abs(exported - oracle).sum() < 0.03 * oracle.sum()
