"""A policy for one sequence (`Llama.set_policy(..., seq_id=...)`): a server's conversation chooses its own policy
and budget inside the cells the `Llama` was made with, and evicts exactly as a `Llama` made with that policy."""
import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.policies import parse

PROMPT = [1 + (7 * i) % 250 for i in range(150)]


def _two_slots(tiny_model, **kw):
    # streams of their own, as the server's slots have
    return Llama(tiny_model, policy="h2o", budget=48, n_seq_max=2, kv_unified=False, n_batch=32, **kw)


def _alone(tiny_model, label, n_ctx):
    """The same policy as the whole Llama's, with the same cells per stream (the same prefill plan)."""
    return Llama(tiny_model, policy=parse(label), n_seq_max=2, kv_unified=False, n_batch=32, n_ctx=n_ctx)


@pytest.mark.parametrize("label", ["tova-24", "sink-16", "h2o-40+s4", "tova-32+q8+p3"])
def test_a_sequence_with_its_own_policy_keeps_what_that_policy_keeps(tiny_model, label):
    llm = _two_slots(tiny_model)
    llm.set_policy(parse(label), seq_id=1)
    assert llm.policy_of(1).label == label and llm.policy_of(0).label == "h2o-48"
    llm.eval(PROMPT, seq_id=0)
    llm.eval(PROMPT, seq_id=1)
    ref = _alone(tiny_model, label, llm.n_ctx())
    ref.eval(PROMPT, seq_id=1)
    got, want = llm.kv_state(1), ref.kv_state(1)
    assert len(got.positions) == parse(label).budget
    np.testing.assert_array_equal(got.positions, want.positions)
    if ref.policy.needs_scores:  # (a sink alone exports none; beside h2o it sees the scores h2o is given)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)
    np.testing.assert_allclose(llm.last_logits(1), ref.last_logits(1), rtol=1e-4, atol=1e-5)
    # the other sequence follows the Llama's policy, as if the first had none of its own
    plain = _two_slots(tiny_model)
    plain.eval(PROMPT, seq_id=0)
    np.testing.assert_array_equal(llm.kv_state(0).positions, plain.kv_state(0).positions)


def test_a_sequence_policy_stays_through_resets_until_switched(tiny_model):
    llm = _two_slots(tiny_model)
    llm.set_policy("sink", 16, seq_id=1)
    llm.reset(1)
    llm.reset()
    llm.eval(PROMPT, seq_id=1)
    assert llm.policy_of(1).label == "sink-16" and len(llm.kv_state(1).positions) == 16
    llm.set_policy("local", 20)  # every sequence, those with a policy of their own too
    assert llm.policy_of(1).label == "local-20" == llm.policy.label
    llm.reset(1)
    llm.eval(PROMPT, seq_id=1)
    assert len(llm.kv_state(1).positions) == 20


def test_a_policy_that_does_not_fit_is_refused_and_changes_nothing(tiny_model):
    llm = _two_slots(tiny_model)
    llm.set_policy("sink", 16, seq_id=1)
    with pytest.raises(ValueError, match="no room"):
        llm.set_policy("h2o", 4096, seq_id=1)
    with pytest.raises(ValueError, match="out of range"):
        llm.set_policy("h2o", 16, seq_id=2)
    assert llm.policy_of(1).label == "sink-16"
    quiet = Llama(tiny_model, policy="sink", budget=48, n_seq_max=2, kv_unified=False)  # exports no scores
    with pytest.raises(ValueError, match="needs attention scores"):
        quiet.set_policy("h2o", 16, seq_id=0)
    assert quiet.policy_of(0) is quiet.policy
