"""Scorers written in Python (`policies.PythonRanked`): they run in the same engine, between the same decodes."""
import numpy as np
import pytest

from h2o_local import H2O, Llama
from h2o_local.policies import PythonRanked

TEXT = "Scores in, a ranking out: the engine keeps the sinks, the recent window and the best ranked. " * 5


class PythonH2O(PythonRanked):
    name = "python-h2o"

    def rank(self, total, head, queries):
        return total  # H2O: the accumulated attention


class MeanAttention(PythonRanked):
    name = "mean"

    def rank(self, total, head, queries):
        return total / queries


@pytest.mark.parametrize("split", [dict(budget=24), dict(budget=24, sinks=2), dict(heavy=8, recent=6)])
def test_h2o_written_in_python_keeps_exactly_what_the_cpp_h2o_keeps(tiny_model, split):
    ref, py = (Llama(tiny_model, policy=p, n_batch=16, n_threads=1) for p in (H2O(**split), PythonH2O(**split)))
    assert py.policy.split == ref.policy.split
    prompt = ref.tokenize(TEXT)
    kept = []
    for llm in (ref, py):
        events = list(llm.generate_events(prompt, max_tokens=24, temperature=0))
        st = llm.kv_state()
        kept.append(([e.token for e in events], st.positions.tolist(), st.scores.tolist(), st.n_evicted))
    assert kept[0] == kept[1] and kept[0][3] > 0


def test_a_python_ranking_decides_what_is_kept(tiny_model):
    """Another ranking keeps other entries (the test above could not tell a ranking that is never called)."""
    h2o, mean = (Llama(tiny_model, policy=p, n_batch=16, n_threads=1)
                 for p in (PythonH2O(budget=24), MeanAttention(budget=24)))
    prompt = h2o.tokenize(TEXT)
    for llm in (h2o, mean):
        llm.generate(prompt, max_tokens=16, temperature=0)
    a, b = h2o.kv_state(), mean.kv_state()
    assert a.positions.tolist() != b.positions.tolist()
    # the mean ranking's heavy part: the older entries with the highest total / queries
    assert len(b.positions) == 24


class Broken(PythonRanked):
    name = "broken"

    def rank(self, total, head, queries):
        return np.zeros(3)


def test_a_ranking_of_the_wrong_length_is_an_error_and_the_llama_goes_on(tiny_model):
    llm = Llama(tiny_model, policy=Broken(budget=16), n_threads=1)
    with pytest.raises(ValueError, match="one number per entry"):
        llm.generate(TEXT, max_tokens=4)
    llm.set_policy(H2O(budget=16))
    assert llm.generate("still usable", max_tokens=2, temperature=0) is not None


class Raising(PythonRanked):
    name = "raising"

    def rank(self, total, head, queries):
        raise KeyError("a bug in the ranking")


@pytest.mark.parametrize("n_batch", [8, 512])  # a prompt fed in pieces, and whole
def test_a_ranking_that_raises_leaves_the_sequence_as_it_was(tiny_model, n_batch):
    """The exception reaches the caller as it is, and the prompt it was evicting for is dropped again: the sequence
    keeps what it held, within its budget, and takes more under another policy (it once stayed over its budget and
    every later feed failed with 'no KV cell is free')."""
    llm = Llama(tiny_model, policy=Raising(budget=16), n_batch=n_batch, n_threads=1)
    llm.eval(llm.tokenize("short")[:10])
    before = llm.kv_state()
    logits = llm.last_logits().copy()
    with pytest.raises(KeyError, match="a bug in the ranking"):
        llm.eval(llm.tokenize(TEXT, add_bos=False))
    after = llm.kv_state()
    assert after.positions.tolist() == before.positions.tolist() and after.tokens.tolist() == before.tokens.tolist()
    np.testing.assert_array_equal(llm.last_logits(), logits)
    llm.set_policy(H2O(budget=16))
    llm.eval(llm.tokenize(TEXT, add_bos=False))
    assert llm.kv_state().n_cells == 16 and llm.kv_state().n_seen == before.n_seen + len(llm.tokenize(TEXT, add_bos=False))
