"""A chat that never ends and never forgets (issue 73): a bounded cache renumbers its positions only near the trained
context (below it every output is what it is without rolling), recall brings evicted entries back among rolled
ones in the conversation's order with each key shifted to its new place, snapshots carry each entry's place, and a
sequence can go back to a token it was fed (what a re-rendered conversation shares with the cache)."""
import warnings

import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.policies import resolve
from device_tolerance import assert_logits_close, approximate
from tiny_model import write_tiny_llama

PROMPT = ("the keeper of the lighthouse wrote a letter to the harbour master about the storm and the ships that "
          "came in late at night, and the bells that rang until the morning came over the water")
QUESTION = " and what did the keeper write about?"
N_TRAIN = 256  # the small model's trained context: a session passes it several times within a second


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("endless") / "small.gguf", n_ctx_train=N_TRAIN))


def turns(llm, n_turns, seed=0, prompt_len=(8, 60), answer_len=(1, 10)):
    """A random conversation on sequence 0: prompts and greedy answers; yields after each turn the tokens fed so
    far (the answer's last token is shown, not fed)."""
    rng = np.random.default_rng(seed)
    fed = []
    for _ in range(n_turns):
        piece = rng.integers(3, 250, size=int(rng.integers(*prompt_len))).tolist()
        fed += llm.pending + piece
        answer = [e.token for e in llm.generate_events(piece, reset=False, temperature=0, ignore_eos=True,
                                                       max_tokens=int(rng.integers(*answer_len)))
                  if e.token is not None]
        fed += answer[:-1]
        yield fed


def test_below_the_trained_context_rolling_changes_nothing(tiny_model):
    """Rolling only when needed: a session that evicts, spills and recalls but stays below the trained context gives
    the same logits, kept entries and store bit for bit with rolling on (the default) and off."""
    runs = []
    for rolling in (True, False):
        llm = Llama(tiny_model, policy=resolve(None, 24), n_batch=32, recall=4096, position_rolling=rolling)
        assert llm.position_rolling == rolling
        steps = []
        for _ in turns(llm, 12):
            st = llm.kv_state()
            steps.append((llm.last_logits().copy(), st.positions.tolist(), sorted(st.host_positions.tolist())))
        assert st.n_seen < llm.n_ctx_train() and st.n_recalled > 0 and st.positions.tolist() == st.origins.tolist()
        runs.append(steps)
    for (logits, kept, host), (logits_off, kept_off, host_off) in zip(*runs):
        np.testing.assert_array_equal(logits, logits_off)
        assert kept == kept_off and host == host_off


def test_past_the_trained_context_positions_roll_near_it_and_every_entry_keeps_its_place(small_model):
    """Forty turns pass the trained context four times: positions stay below it (renumbered a few times, never at
    every eviction), no warning; every kept entry holds the token fed at its origin, kept and stored entries are
    different places of the conversation, and recall goes on after the rolls."""
    llm = Llama(small_model, policy=resolve(None, 24), n_batch=32, recall=4096)
    assert llm.position_rolling
    rolls, top, recalled_after_roll, drift = 0, 0, 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for fed in turns(llm, 40):
            st = llm.kv_state()
            assert st.positions.max() < N_TRAIN
            rolls += st.positions.max() < top  # renumbered (by a roll, or a recall after one)
            top = st.positions.max()
            drift = max(drift, top + 1 - st.n_cells)
            assert np.all(np.diff(st.origins) > 0) and st.origins[-1] == st.n_seen - 1 == len(fed) - 1
            assert [fed[o] for o in st.origins] == st.tokens.tolist()
            assert not set(st.host_origins.tolist()) & set(st.origins.tolist())
            assert st.host_origins.max() < st.n_seen
            if rolls == 1 and not recalled_after_roll:
                recalled_after_roll = st.n_recalled + 1  # what had come back by the first renumbering (+1: > 0)
    assert st.n_seen > 4 * N_TRAIN and rolls >= 3 and drift > 64  # rolled, and not at every eviction
    assert st.n_recalled >= recalled_after_roll > 0  # recall went on after the rolls


def test_with_room_for_everything_a_rolled_sequence_recalls_to_the_full_caches_logits(tmp_path):
    """Rolled at every eviction, then given room for everything: one question brings every stored entry back, each
    key shifted from the position it left at to its place in the conversation (0..n-1); the logits are the full
    cache's (F32 cells: the shifts' rounding only). One layer: its K and V depend on the token and its position
    alone, not on what the bounded cache held when it was read, so the full cache's are the reference."""
    one_layer = str(write_tiny_llama(tmp_path / "one-layer.gguf", n_layer=1, n_ctx_train=N_TRAIN))
    tokens = Llama(one_layer, policy="full").tokenize(PROMPT)
    full = Llama(one_layer, policy="full", n_ctx=512, n_batch=32, kv_f32=True, flash_attn=False)
    q = full.tokenize(QUESTION, add_bos=False)
    full.eval(tokens)
    full.eval(q)
    expected = full.last_logits()

    llm = Llama(one_layer, policy=resolve(None, 24), n_batch=32, n_ctx=512, recall=4096, kv_f32=True,
                flash_attn=False, roll_interval=1)
    for i in range(0, len(tokens), 32):  # a prompt at a time: each evicts, spills and rolls
        llm.eval(tokens[i:i + 32])
    st = llm.kv_state()
    assert st.positions.tolist() == list(range(24)) and st.origins.tolist() != st.positions.tolist()
    assert sorted(st.host_positions.tolist()) != sorted(st.host_origins.tolist())  # keys left at rolled positions
    llm.set_policy(resolve(None, 400))
    llm.eval(q)
    st = llm.kv_state()
    n = len(tokens) + len(q)
    assert st.positions.tolist() == st.origins.tolist() == list(range(n)) and len(st.host_positions) == 0
    assert st.tokens.tolist() == tokens + q
    got = llm.last_logits()
    assert_logits_close(got, expected, device=approximate(llm), cpu_atol=1e-4 * float(np.ptp(expected)))
    assert int(np.argmax(got)) == int(np.argmax(expected))


def test_a_snapshot_of_a_rolled_sequence_carries_each_entrys_place(small_model):
    def make():
        return Llama(small_model, policy=resolve(None, 24), n_batch=32, recall=4096)

    llm = make()
    for _ in turns(llm, 16):
        pass
    st = llm.kv_state()
    assert st.positions.tolist() != st.origins.tolist() and len(st.host_origins)
    blob = llm.save_state().to_bytes()
    expected = llm.generate(list(range(40, 70)), max_tokens=8, temperature=0, reset=False)
    other = make()
    other.load_state(type(llm.save_state()).from_bytes(blob))
    loaded = other.kv_state()
    assert loaded.origins.tolist() == st.origins.tolist() and loaded.host_origins.tolist() == st.host_origins.tolist()
    assert other.generate(list(range(40, 70)), max_tokens=8, temperature=0, reset=False) == expected


@pytest.mark.parametrize("rolled", [False, True])
def test_going_back_to_a_token_forgets_what_came_after(small_model, rolled):
    llm = Llama(small_model, policy=resolve(None, 200), n_batch=32, recall=4096, roll_interval=1 if rolled else 0)
    first, then = list(range(10, 60)), list(range(100, 130))
    if rolled:  # evict and roll first, so that positions are not the tokens' places
        llm.set_policy(resolve(None, 24))
        llm.eval(list(range(3, 90)))
        llm.set_policy(resolve(None, 200))
        first = list(range(3, 90)) + first
        llm.eval(first[87:])
    else:
        llm.eval(first)
    n = llm.kv_state().n_seen
    llm.eval(then)
    expected = llm.last_logits().copy()
    llm.truncate(n)
    st = llm.kv_state()
    assert st.n_seen == n and st.origins.max() == n - 1 and not (st.host_origins >= n).any()
    llm.eval(then)
    np.testing.assert_array_equal(llm.last_logits(), expected)  # the same tokens read again: the same logits
    for bad in (-1, n + len(then) + 1):
        with pytest.raises(ValueError):
            llm.truncate(bad)
