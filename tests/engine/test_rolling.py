"""Position rolling: kept positions renumbered 0..n-1, so generation runs far past the trained context."""
import numpy as np
import pytest

from h2o_local import Llama
from engine_view import position_range
from tiny_model import write_tiny_llama

PROMPT = "A long story begins here and goes on and on."


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny llama with a trained context of 128: generation passes it within a second."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("rolling") / "tiny-128.gguf", n_ctx_train=128))


def test_positions_stay_contiguous_from_zero(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, position_rolling=True, roll_interval=1, n_batch=32)
    llm.eval(llm.tokenize(PROMPT))
    for i in range(40):
        st = llm.kv_state()
        assert st.positions.tolist() == list(range(st.n_cells))
        assert position_range(llm, 0) == (0, st.n_cells - 1)  # llama.cpp's own view agrees
        llm.eval([65 + i % 26])
    assert llm.kv_state().n_cells == 16


def test_generation_runs_well_past_the_trained_context(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=32, position_rolling=True, roll_interval=1, n_batch=32)
    n_train = llm.n_ctx_train()
    assert n_train == 128
    out = llm.generate(PROMPT, max_tokens=5 * n_train, temperature=0.8, seed=1, ignore_eos=True)
    st = llm.kv_state()
    assert st.n_seen > 5 * n_train
    assert st.positions.max() < 32 and st.n_cells == 32
    assert len(out) > 0


def test_without_rolling_positions_keep_growing(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=32, n_batch=32, position_rolling=False)
    llm.eval(llm.tokenize(PROMPT))
    for i in range(200):
        llm.eval([3 + (i * 37) % 256])
    st = llm.kv_state()
    assert st.positions.max() == st.n_seen - 1 > llm.n_ctx_train()


def test_rolling_a_contiguous_window_keeps_the_logits(tiny_model):
    """`local` keeps a contiguous window, so rolling moves every kept key by the same delta: with RoPE only
    relative positions matter, and the logits must equal (to rounding of the K shift) those without rolling.
    A missing or wrong shift would change relative positions and the logits. F32 cells: F16 keys are re-rounded
    by every shift, and this random model's peaked attention amplifies that rounding. Flash attention off: a
    device's flash kernel multiplies in F16 whatever the cells hold (lavapipe: logits 0.08 apart with it)."""
    runs = {}
    for rolling in (False, True):
        llm = Llama(tiny_model, policy="local", budget=12, position_rolling=rolling, roll_interval=1, n_batch=64,
                    kv_f32=True,
                    flash_attn=False)
        llm.eval(llm.tokenize(PROMPT * 2))
        logits = []
        for i in range(20):
            llm.eval([70 + i])
            logits.append(llm.last_logits())
        runs[rolling] = np.stack(logits)
        assert llm.kv_state().positions.max() == (11 if rolling else llm.kv_state().n_seen - 1)
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-2, atol=1e-2)
    assert not np.allclose(runs[True][1:], runs[True][:-1])  # the steps do differ from each other


def test_a_roll_interval_bounds_the_drift_of_positions(tiny_model):
    """roll_interval=8: positions may drift up to 8 past 0..n-1, then are renumbered at once."""
    llm = Llama(tiny_model, policy="h2o", budget=16, position_rolling=True, roll_interval=8, n_batch=32)
    llm.eval(llm.tokenize(PROMPT))
    drifts = []
    for i in range(60):
        llm.eval([65 + i % 26])
        st = llm.kv_state()
        assert st.n_cells == 16
        drift = int(st.positions.max()) + 1 - st.n_cells
        assert 0 <= drift < 8
        assert position_range(llm, 0) == (int(st.positions.min()), int(st.positions.max()))
        drifts.append(drift)
    assert 0 in drifts and 7 in drifts  # it both drifts the whole interval and rolls back to contiguous
    assert sum(1 for a, b in zip(drifts, drifts[1:]) if b < a) >= 60 // 8 - 1  # a roll every 8 evictions


def test_a_roll_interval_longer_than_the_run_never_rolls(tiny_model):
    """Rolling is only renumbering: if it never triggers, the run is bit-identical to one without rolling."""
    runs = {}
    for rolling in (False, True):
        llm = Llama(tiny_model, policy="h2o", budget=16, position_rolling=rolling, roll_interval=10**6, n_batch=32)
        llm.eval(llm.tokenize(PROMPT))
        logits = []
        for i in range(30):
            llm.eval([65 + i % 26])
            logits.append(llm.last_logits())
        runs[rolling] = (np.stack(logits), llm.kv_state().positions.tolist())
    np.testing.assert_array_equal(runs[True][0], runs[False][0])
    assert runs[True][1] == runs[False][1] and max(runs[True][1]) > 40


def test_a_negative_roll_interval_is_refused(tiny_model):
    with pytest.raises(ValueError, match="roll_interval"):
        Llama(tiny_model, policy="h2o", budget=16, position_rolling=True, roll_interval=-1)


@pytest.mark.parametrize("kv_f32", [False, True])
def test_a_snapshot_taken_while_a_shift_is_pending_continues_exactly(tiny_model, kv_f32):
    """Rolling renumbers positions at once but llama.cpp rotates the keys at the next decode: a snapshot taken
    in between must hold keys rotated for the positions it records (it used to keep the old rotation: the
    restored copy then disagreed by several logits)."""
    a = Llama(tiny_model, policy="h2o", budget=24, position_rolling=True, roll_interval=1, n_batch=32, kv_f32=kv_f32)
    b = Llama(tiny_model, policy="h2o", budget=24, position_rolling=True, roll_interval=1, n_batch=32, kv_f32=kv_f32)
    a.eval(a.tokenize(PROMPT * 8))  # evicts and rolls after the last chunk: the shift is pending
    b.load_state(a.save_state())
    for t in a.tokenize(" and then", add_bos=False):
        a.eval([t])
        b.eval([t])
        np.testing.assert_allclose(b.last_logits(), a.last_logits(), atol=1e-4)
