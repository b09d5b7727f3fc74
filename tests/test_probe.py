"""The question probe (`probe=N`, label `+qN`): in a bounded prefill, each piece is ranked by the prompt's last N
tokens, decoded after the piece and removed before the piece is evicted. It must leave no trace."""
import numpy as np
import pytest

from h2o_local import H2O, TOVA, KeyDiff, Llama, SnapKV, policies
from h2o_local.policies import PythonRanked

PROMPT = list(range(5, 125))  # 120 tokens: pieces of 16 beside a budget of 24


@pytest.mark.parametrize("policy", [TOVA(budget=24, probe=4), SnapKV(budget=24, window=4, probe=8),
                                    H2O(budget=24, probe=4)])
def test_a_probe_leaves_no_trace_in_the_cache(tiny_model, policy):
    llm = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert st.n_seen == len(PROMPT) and st.n_evicted == len(PROMPT) - 24
    assert st.positions.max() == len(PROMPT) - 1 and len(st.positions) == 24  # no probe position is held
    lo, hi = llm._engine.seq_pos_range(0)
    assert (lo, hi) == (st.positions.min(), st.positions.max())  # llama.cpp holds no probe cell either
    assert st.peak_cells <= 24 + 16 + policy.probe
    # the next token goes on at the prompt's end
    llm.generate([], max_tokens=3, temperature=0, reset=False)
    assert llm.kv_state().n_seen == len(PROMPT) + 2


def test_the_probe_changes_what_a_piece_keeps(tiny_model):
    kept = []
    for policy in (TOVA(budget=24), TOVA(budget=24, probe=6)):
        llm = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1)
        llm.eval(PROMPT)
        kept.append(llm.kv_state().positions.tolist())
    assert kept[0] != kept[1]


def test_the_last_logits_are_the_prompt_s_own(tiny_model):
    """The probe's decodes do not leave their logits: the logits after the prefill are those of the prompt's last
    token, so greedy generation starts from them."""
    llm = Llama(tiny_model, policy=TOVA(budget=24, probe=4), n_batch=16, n_threads=1)
    llm.eval(PROMPT)
    before = llm.last_logits().copy()
    llm.eval([PROMPT[-1] + 1])
    llm2 = Llama(tiny_model, policy=TOVA(budget=24, probe=4), n_batch=16, n_threads=1)
    llm2.eval(PROMPT)
    np.testing.assert_array_equal(llm2.last_logits(), before)  # deterministic, and not a probe's


def test_labels_and_refusals():
    assert policies.parse("tova-256+s4+q16") == TOVA(budget=256, sinks=4, probe=16)
    assert TOVA(budget=256, sinks=4, probe=16).label == "tova-256+s4+q16"
    with pytest.raises(ValueError, match="no question probe"):
        policies.parse("local-64+q8")
    with pytest.raises(ValueError, match="no question probe"):
        KeyDiff(budget=64, probe=8)

    class Mean(PythonRanked):
        name = "mean"

    with pytest.raises(ValueError, match="no question probe"):
        Mean(budget=64, probe=8)
