"""Eviction decisions: each policy keeps what its rule says, checked against independent references."""
import numpy as np
import pytest

from h2o_local import Llama, ModelInfo
from h2o_local import _engine, policies
from h2o_reference import H2OReference, ScorerReference
from device_tolerance import CPU_BACKEND, on_device

TEXT_A = "Heavy hitters are the few tokens that receive most of the attention in a long sequence of text."
TEXT_B = "Completely different words: quartz, zephyr, jigsaw, vortex, 1234567890, and a final question?"


def run_against_reference(llm: Llama, prompt, steps, seq_id=0):
    ref = H2OReference(heavy=llm.heavy, recent=llm.recent, sinks=llm.sinks)
    llm.eval(prompt, seq_id=seq_id)
    assert llm.kv_state(seq_id).positions.tolist() == ref.step(*llm.last_scores(seq_id))
    for t in steps:
        llm.eval([t], seq_id=seq_id)
        kept = llm.kv_state(seq_id).positions.tolist()
        assert kept == ref.step(*llm.last_scores(seq_id))
    return ref


@pytest.mark.parametrize("budget,heavy,recent,sinks", [(16, None, None, None), (10, 7, None, None),
                                                       (12, None, 3, 2), (9, 0, None, None), (5, 4, 1, 0)])
def test_h2o_keeps_what_the_reference_rule_keeps(tiny_model, budget, heavy, recent, sinks):
    llm = Llama(tiny_model, policy="h2o", budget=budget, heavy=heavy, recent=recent, sinks=sinks, n_batch=256)  # one prefill pass
    steps = llm.tokenize(TEXT_B, add_bos=False) * 2
    ref = run_against_reference(llm, llm.tokenize(TEXT_A), steps)
    st = llm.kv_state()
    assert st.n_cells == budget and st.n_evicted == st.n_seen - budget
    # the engine's accumulated scores are the reference's, exactly
    assert st.scores.tolist() == [float(ref.scores[p]) for p in st.positions.tolist()]
    np.testing.assert_allclose(st.head_scores.sum(axis=1), st.scores, rtol=1e-5)


def test_default_split_is_half_heavy_half_recent(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=128)
    assert (llm.sinks, llm.heavy, llm.recent) == (0, 64, 64)
    llm = Llama(tiny_model, policy="h2o", budget=7)
    assert (llm.sinks, llm.heavy, llm.recent) == (0, 3, 4)


def test_h2o_differs_from_a_window(tiny_model):
    """Heavy hitters are old tokens: the kept set is not just the last `budget` positions."""
    llm = Llama(tiny_model, policy="h2o", budget=16)
    llm.eval(llm.tokenize(TEXT_A + TEXT_B))
    kept = llm.kv_state().positions
    assert kept.min() < kept.max() - 16


def test_local_keeps_the_last_budget_positions(tiny_model):
    llm = Llama(tiny_model, policy="local", budget=10, n_batch=16)
    tokens = llm.tokenize(TEXT_A)
    llm.eval(tokens)
    n = len(tokens)
    assert llm.kv_state().positions.tolist() == list(range(n - 10, n))
    for i in range(5):
        llm.eval([70 + i])
        assert llm.kv_state().positions.tolist() == list(range(n + i + 1 - 10, n + i + 1))


def test_sink_keeps_the_first_tokens_and_the_last(tiny_model):
    llm = Llama(tiny_model, policy="sink", budget=10, sinks=3, n_batch=16)
    assert (llm.sinks, llm.heavy, llm.recent) == (3, 0, 7)
    tokens = llm.tokenize(TEXT_A)
    llm.eval(tokens)
    for i in range(4):
        llm.eval([80 + i])
    n = len(tokens) + 4
    assert llm.kv_state().positions.tolist() == [0, 1, 2] + list(range(n - 7, n))
    assert Llama(tiny_model, policy="sink", budget=10).sinks == 4  # StreamingLLM's default


def test_full_never_evicts(tiny_model):
    llm = Llama(tiny_model, n_ctx=256)
    tokens = llm.tokenize(TEXT_A)
    llm.eval(tokens)
    st = llm.kv_state()
    assert st.positions.tolist() == list(range(len(tokens))) and st.n_evicted == 0


def test_two_sequences_in_one_batch_keep_their_own_heavy_hitters(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=12, n_seq_max=2, n_batch=256)  # both prompts in one llama_decode
    a, b = llm.tokenize(TEXT_A), llm.tokenize(TEXT_B)
    refs = {0: H2OReference(llm.heavy, llm.recent), 1: H2OReference(llm.heavy, llm.recent)}
    llm.eval_batch({0: a, 1: b})
    for s in (0, 1):
        assert llm.kv_state(s).positions.tolist() == refs[s].step(*llm.last_scores(s))
    for i in range(12):
        llm.eval_batch({0: [60 + i], 1: [100 + i]})
        for s in (0, 1):
            pos, sums = llm.last_scores(s)
            # each sequence's queries attend only to its own cells: every head row sums to n_layer
            np.testing.assert_allclose(sums.sum(axis=0), 2.0, rtol=1e-5)
            assert llm.kv_state(s).positions.tolist() == refs[s].step(pos, sums)
    s0, s1 = llm.kv_state(0), llm.kv_state(1)
    assert s0.n_cells == s1.n_cells == 12
    assert s0.positions.tolist() != s1.positions.tolist() or not np.allclose(s0.scores, s1.scores)

    # the same sequence fed alone ends in the same state, on the CPU backend without flash attention, whose results
    # do not depend on a batch's size (a GPU's products round differently by batch: lavapipe's scores 6.7e-3 apart,
    # and a near tie may then keep another entry)
    exact = dict(policy="h2o", budget=12, n_batch=256, flash_attn=False, **CPU_BACKEND)
    both, solo = Llama(tiny_model, n_seq_max=2, **exact), Llama(tiny_model, **exact)
    both.eval_batch({0: a, 1: b})
    solo.eval(a)
    for i in range(12):
        both.eval_batch({0: [60 + i], 1: [100 + i]})
        solo.eval([60 + i])
    assert solo.kv_state().positions.tolist() == both.kv_state(0).positions.tolist()
    np.testing.assert_allclose(solo.kv_state().scores, both.kv_state(0).scores, rtol=1e-4)
    if not on_device(llm):
        assert both.kv_state(0).positions.tolist() == s0.positions.tolist()


SCORERS = ["h2o", "h2o_norm", "h2o_maxhead", "h2o_headnorm", "tova", "snapkv"]


def n_layer(path) -> int:
    return ModelInfo.load(path).n_layer


@pytest.mark.parametrize("rule", SCORERS)
@pytest.mark.parametrize("budget,heavy,recent,sinks", [(16, 8, 8, 0), (12, 7, 3, 2), (9, 8, 1, 0)])
def test_each_scorer_keeps_what_its_reference_rule_keeps(tiny_model, rule, budget, heavy, recent, sinks):
    llm = Llama(tiny_model, policy=rule, budget=budget, heavy=heavy, recent=recent, sinks=sinks, n_batch=512)
    ref = ScorerReference(rule, heavy=heavy, recent=recent, sinks=sinks)
    prompt = llm.tokenize(TEXT_A + " " + TEXT_B) * 2  # longer than the query windows: two decodes, then compress
    llm.eval(prompt)
    pos, sums = llm.last_scores()
    # the last decode of a prompt is the policy's query window: every head's column sums add up to one per query
    # and layer, so they count the window's queries (the whole prompt in one decode for the others)
    window = {"tova": 1, "snapkv": 16}.get(rule, len(prompt))
    np.testing.assert_allclose(sums.sum(axis=0), window * n_layer(tiny_model), rtol=1e-4)
    assert llm.kv_state().positions.tolist() == ref.step(pos, sums, n_new=len(prompt), in_query_window=True)
    for t in llm.tokenize(TEXT_B, add_bos=False):
        llm.eval([t])
        assert llm.kv_state().positions.tolist() == ref.step(*llm.last_scores(), n_new=1)
    assert llm.kv_state().n_cells == budget


@pytest.mark.parametrize("value,split", [
    (policies.TOVA(budget=128), (0, 127, 1)),
    (policies.SnapKV(budget=256), (0, 240, 16)),
    (policies.SnapKV(budget=20), (0, 10, 10)),
    (policies.H2ONorm(budget=128, sinks=4), (4, 62, 62)),
    (policies.H2OMaxHead(heavy=10, recent=6), (0, 10, 6)),
])
def test_scorer_default_splits(value, split):
    assert value.split == split and value.needs_scores and value.bounded
    assert value.query_window == {"tova": 1, "snapkv": 16}.get(value.name, 0)


@pytest.mark.parametrize("window", [1, 5, 40])
def test_snapkv_scores_a_prompt_by_the_window_it_is_given(tiny_model, window):
    """SnapKV(query_window=W): the prompt's last W tokens are decoded on their own and rank it (W queries per layer and
    head in the last export), and the kept set is the reference rule's."""
    value = policies.SnapKV(budget=16, heavy=10, recent=6, query_window=window)
    llm = Llama(tiny_model, policy=value, n_batch=512)
    ref = ScorerReference("snapkv", heavy=10, recent=6, sinks=0)
    prompt = llm.tokenize(TEXT_A + " " + TEXT_B) * 2
    llm.eval(prompt)
    pos, sums = llm.last_scores()
    np.testing.assert_allclose(sums.sum(axis=0), window * n_layer(tiny_model), rtol=1e-4)
    assert llm.kv_state().positions.tolist() == ref.step(pos, sums, n_new=len(prompt), in_query_window=True)
    assert value.query_window == window and policies.parse(value.label) == value
    assert value.label == ("snapkv-16+r6" if window == 16 else f"snapkv-16+w{window}+r6")


def test_a_window_is_only_for_policies_that_have_one():
    assert policies.SnapKV(budget=256, query_window=64).split == (0, 192, 64)  # recent defaults to the window
    assert policies.parse("snapkv-256+s4+w8") == policies.SnapKV(budget=256, sinks=4, query_window=8)
    with pytest.raises(ValueError, match="query_window >= 1"):
        policies.SnapKV(budget=256, query_window=0)
    with pytest.raises(ValueError, match="takes no query window"):
        policies.parse("h2o-256+w8")
    with pytest.raises(ValueError, match="takes no query window"):
        _engine.Policy("h2o", 256, query_window=8)


@pytest.mark.parametrize("rule", ["tova", "snapkv"])
def test_a_query_window_survives_the_bounded_prefill(tiny_model, rule):
    """A prompt longer than the cache is fed in chunks with eviction; its window still comes last, whole."""
    llm = Llama(tiny_model, policy=rule, budget=80, n_batch=96)
    prompt = (llm.tokenize(TEXT_A + " " + TEXT_B) * 12)[:700]
    llm.eval(prompt)
    pos, sums = llm.last_scores()
    np.testing.assert_allclose(sums.sum(axis=0), {"tova": 1, "snapkv": 16}[rule] * n_layer(tiny_model), rtol=1e-4)
    st = llm.kv_state()
    assert st.n_cells == 80 and st.peak_cells <= 80 + 96 and st.positions[-1] == len(prompt) - 1
    assert llm.generate(prompt[-3:], max_tokens=3, reset=False) is not None
