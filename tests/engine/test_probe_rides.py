"""A prompt's question (or catalyst) probe rides in its chunk's decode (`probe_rides`, patch 0014): one llama_decode
gives the chunk's attention and the probe's, summed apart. It changes nothing but the decodes made: the same kept
entries, scores, probe scores and logits as the probe decoded on its own after the chunk, one llama_decode fewer
per probe."""
import numpy as np
import pytest

from device_tolerance import approximate, assert_logits_close, assert_values_close, on_device
from engine_view import probes_ride, sums_rows, ubatch
from h2o_local import H2O, TOVA, Llama, SnapKV
from twin_sessions import run_twin_sessions

PROMPT = list(range(5, 125))  # 120 tokens: chunks of 16 beside a budget of 24
BUDGET = 24


def read(model, rides, feed=lambda llm: llm.eval(PROMPT), **kwargs):
    llm = Llama(model, probe_rides=rides, n_batch=16, n_threads=1, **kwargs)
    n0 = llm.stats()["decodes"]
    feed(llm)
    return llm, llm.stats()["decodes"] - n0


def rides_here(llm) -> bool:
    """A probe rides unless the CPU's flash kernel scores the layers (it sums every query together)."""
    return not (llm.flash_attn and not on_device(llm))


def assert_same_cache(a, b, seq=0, cpu_rtol=0.0):
    """cpu_rtol 0: bit for bit on the CPU backend (the same products, the rows of the other group weighed 0)."""
    sa, sb = a.kv_state(seq), b.kv_state(seq)
    assert sa.positions.tolist() == sb.positions.tolist()
    assert sa.n_probes == sb.n_probes > 0
    if approximate(a) or cpu_rtol:  # a device, or flash attention's F16 products: they add in another order
        assert_values_close(sa.scores, sb.scores, device=approximate(a), cpu_rtol=cpu_rtol, cpu_atol=0)
        assert_values_close(sa.probe_scores, sb.probe_scores, device=approximate(a), cpu_rtol=cpu_rtol, cpu_atol=0)
    else:
        np.testing.assert_array_equal(sa.scores, sb.scores)
        np.testing.assert_array_equal(sa.probe_scores, sb.probe_scores)


@pytest.mark.parametrize("policy", [TOVA(budget=BUDGET, recent=4, probe="question", question=8),
                                    SnapKV(budget=BUDGET, query_window=4, probe="question", question=8),
                                    H2O(budget=BUDGET, sinks=2, probe="question", question=12),
                                    TOVA(budget=BUDGET, probe="question", question=8, pool=3, follow=2)])
def test_a_riding_probe_keeps_what_a_probe_of_its_own_keeps(tiny_model, policy):
    riding, n_riding = read(tiny_model, True, policy=policy)
    alone, n_alone = read(tiny_model, False, policy=policy)
    assert probes_ride(riding) == rides_here(riding) and not probes_ride(alone)
    assert_same_cache(riding, alone)
    # every probe rode with its chunk: one decode fewer each
    assert n_riding == n_alone - (alone.kv_state().n_probes if rides_here(riding) else 0)
    assert_logits_close(riding.last_logits(), alone.last_logits(), device=approximate(riding), cpu_atol=0)
    if not approximate(riding):  # greedy text forks at a near tie across batch shapes on a device
        assert riding.generate([], max_tokens=5, temperature=0, reset=False) == \
            alone.generate([], max_tokens=5, temperature=0, reset=False)


def test_the_portable_reduction_sums_a_riding_probe_apart_too(tiny_model):
    """The transposed-sum path (Metal's, and Vulkan's with flash attention) forms both sums with a product by the
    two-column weight rather than a row sum: the same sums up to their order of addition."""
    policy = TOVA(budget=BUDGET, recent=4, probe="question", question=8)
    riding, _ = read(tiny_model, True, policy=policy, _scores_sum_rows=True)
    alone, _ = read(tiny_model, False, policy=policy, _scores_sum_rows=True)
    assert sums_rows(riding)
    assert_same_cache(riding, alone, cpu_rtol=1e-6)


def test_a_riding_catalyst_probe_ranks_as_one_of_its_own(tiny_model):
    policy = TOVA(budget=BUDGET, recent=4, probe="catalyst")
    riding, n_riding = read(tiny_model, True, policy=policy)
    alone, n_alone = read(tiny_model, False, policy=policy)
    assert n_riding < n_alone or not rides_here(riding)
    sa, sb = riding.kv_state(), alone.kv_state()
    assert sa.positions.tolist() == sb.positions.tolist()
    # the catalyst's cells can be placed otherwise beside the chunk, so its sums may add in another order
    assert_values_close(sa.probe_scores, sb.probe_scores, device=approximate(riding), cpu_rtol=1e-4)


@pytest.mark.parametrize("unified", [True, False])
def test_probes_ride_beside_several_sequences(tiny_model, unified):
    """A unified cache keeps one probe's cells beside its chunk, so one probe rides per decode there; streams of
    their own each take theirs."""
    policy = TOVA(budget=BUDGET, recent=4, probe="question", question=8)
    prompts = {0: PROMPT, 1: PROMPT[::-1], 2: PROMPT[10:]}
    kwargs = dict(policy=policy, n_seq_max=3, kv_unified=unified, feed=lambda llm: llm.eval_batch(prompts))
    riding, n_riding = read(tiny_model, True, **kwargs)
    alone, n_alone = read(tiny_model, False, **kwargs)
    assert n_riding < n_alone or not rides_here(riding)
    for seq in prompts:
        assert_same_cache(riding, alone, seq)
        assert riding.kv_state(seq).peak_cells <= BUDGET + 16 + riding.probe_cells(policy)


def test_a_riding_probe_takes_the_cells_a_decode_of_its_own_would(tiny_model):
    """In a cache shared by several sequences the probe's tokens come after every sequence's chunk, where a decode of
    its own would put them, so the cells that later tokens fill, and the order in which attention adds them, are the
    same (the probe placed beside its own sequence's tokens left seq 1 9.5e-7 apart here)."""
    policy = TOVA(budget=16, sinks=2, recent=4, probe="question", question=8, pool=3, follow=2)
    feeds = [{0: [3], 1: [3]}] * 3 + [{0: [3] * 9, 1: [3] * 10}, {0: [3] * 5, 1: [3] * 19}]

    def feed(llm):
        for tokens in feeds:
            llm.eval_batch(tokens)
    kwargs = dict(policy=policy, n_seq_max=2, kv_unified=True, feed=feed)
    riding, n_riding = read(tiny_model, True, **kwargs)
    alone, n_alone = read(tiny_model, False, **kwargs)
    assert n_riding < n_alone or not rides_here(riding)
    for seq in (0, 1):
        assert_same_cache(riding, alone, seq)
        assert_logits_close(riding.last_logits(seq), alone.last_logits(seq), device=approximate(riding), cpu_atol=0)


def test_a_batch_stays_the_size_it_was_asked(tiny_model):
    """llama.cpp's batch grows by the probe that rides; the chunks a prompt is read in do not."""
    llm, _ = read(tiny_model, True, policy=TOVA(budget=BUDGET, probe="question", question=8), n_ubatch=8)
    assert (llm.n_batch, ubatch(llm)) == (16, 8)


@pytest.mark.parametrize("how", ["repeat", "flash_attn_on_the_cpu", "no_probe"])
def test_where_no_probe_rides(tiny_model, how):
    """The repeat probe is batches of its own, the CPU's flash kernel sums every query together (a riding probe
    would need the separate pass there): each probe is a decode of its own, and the rest reads as before."""
    kwargs = {"repeat": dict(policy=TOVA(budget=BUDGET, probe="repeat", pool=3)),
              "flash_attn_on_the_cpu": dict(policy=TOVA(budget=BUDGET, probe="question", question=8), flash_attn=True,
                                            n_gpu_layers=0, op_offload=False),
              "no_probe": dict(policy=TOVA(budget=BUDGET, recent=4))}[how]
    riding, n_riding = read(tiny_model, True, **kwargs)
    alone, n_alone = read(tiny_model, False, **kwargs)
    assert not probes_ride(riding)
    assert n_riding == n_alone
    assert riding.kv_state().positions.tolist() == alone.kv_state().positions.tolist()


@pytest.mark.parametrize("kwargs", [dict(kv_unified=True), dict(kv_unified=False), dict(kv_unified=False, recall=True)],
                         ids=["unified", "streams", "streams+recall"])
def test_random_sessions_ride_as_probes_of_their_own(tiny_model, kwargs):
    """The riding `Llama` beside one with `probe_rides=False`, whatever is called in whatever order (tests/support/
    twin_sessions.py; they found the probe placed before the next sequence's chunk, above)."""
    run_twin_sessions(tiny_model, ({"probe_rides": True}, {"probe_rides": False}), **kwargs)
