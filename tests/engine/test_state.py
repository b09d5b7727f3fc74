"""Snapshots and policy switches: branching several continuations from one attended prompt."""
import struct
import zlib

import numpy as np
import pytest

from h2o_local import Llama

PROMPT = "Heavy hitters receive most of the attention; the rest of the cache can go."


def test_restore_continues_exactly_like_the_original(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=128)
    llm.eval(llm.tokenize(PROMPT))
    snap = llm.save_state()
    snap_seen = llm.kv_state().n_seen
    assert snap.n_cells == 16 and snap.nbytes > 0
    first = llm.generate([65], max_tokens=20, temperature=0, reset=False)
    state_after = llm.kv_state()
    llm.load_state(snap)
    assert llm.kv_state().n_cells == 16 and llm.kv_state().n_seen == snap_seen
    again = llm.generate([65], max_tokens=20, temperature=0, reset=False)
    assert again == first
    assert llm.kv_state().positions.tolist() == state_after.positions.tolist()
    # restored entries sit in other cells: reductions run in another order, scores agree to rounding
    np.testing.assert_allclose(llm.kv_state().scores, state_after.scores, rtol=1e-5)


def test_compressing_a_full_prompt_equals_the_reference_mode(tiny_model):
    """Attend the whole prompt with a large budget, then switch to a small one and compress: the same kept set,
    scores and next logits as an engine that had the small budget from the start (reference mode)."""
    tokens = Llama(tiny_model).tokenize(PROMPT)
    direct = Llama(tiny_model, policy="h2o", budget=12, n_ctx=512)
    direct.eval(tokens)
    branched = Llama(tiny_model, policy="h2o", budget=400, n_ctx=512)
    branched.eval(tokens)
    snap = branched.save_state()
    for budget in (12, 20, 12):
        branched.load_state(snap)
        branched.set_policy("h2o", budget)
        branched.compress()
        assert branched.kv_state().n_cells == budget
    assert branched.kv_state().positions.tolist() == direct.kv_state().positions.tolist()
    np.testing.assert_array_equal(branched.kv_state().scores, direct.kv_state().scores)
    branched.eval([70])
    direct.eval([70])
    np.testing.assert_array_equal(branched.last_logits(), direct.last_logits())


def test_switch_to_local_and_full(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=300, n_ctx=512)
    tokens = llm.tokenize(PROMPT)
    llm.eval(tokens)
    llm.set_policy("local", 10)
    llm.compress()
    assert llm.kv_state().positions.tolist() == list(range(len(tokens) - 10, len(tokens)))
    llm.set_policy("full")
    llm.eval([70, 71])
    assert llm.kv_state().n_cells == 12


def test_policy_switch_errors(tiny_model):
    llm = Llama(tiny_model, policy="local", budget=16)
    with pytest.raises(ValueError, match="scores"):
        llm.set_policy("h2o", 16)
    with pytest.raises(ValueError, match="no room"):
        Llama(tiny_model, policy="h2o", budget=16).set_policy("h2o", 10_000)


def test_a_restored_cache_answers_as_the_saved_one_up_to_the_order_of_its_cells(tiny_model):
    """llama.cpp restores a sequence's cells contiguously, in their order: holes left by eviction close up, so a
    multi-token feed afterwards sums attention in another order. The bound (docs/reliability.md): logits within
    float rounding (here 1e-3 of their range; up to 0.57 on SmolLM2 Q4_1's ~30), the same argmax and greedy text."""
    a = Llama(tiny_model, policy="h2o", budget=24, n_threads=1, compact_cells=False)
    a.generate(list(range(5, 45)), max_tokens=12, temperature=0)
    assert a.kv_state().n_evicted > 0
    b = Llama(tiny_model, policy="h2o", budget=24, n_threads=1)
    b.load_state(a.save_state())
    for llm in (a, b):  # the token shown last and not fed (the snapshot's pending one), then a message
        llm.eval(list(llm.save_state().pending) + list(range(50, 60)))
    la, lb = a.last_logits(), b.last_logits()
    np.testing.assert_allclose(lb, la, atol=1e-3 * float(np.ptp(la)))
    assert int(np.argmax(la)) == int(np.argmax(lb))
    assert a.generate([], max_tokens=8, temperature=0, reset=False) == b.generate([], max_tokens=8, temperature=0,
                                                                                   reset=False)


@pytest.mark.parametrize("bad_pos", [-5, -2**31, 2**31 - 1])
def test_a_snapshot_cell_at_a_position_no_removal_reaches_is_refused_and_leaves_nothing(tiny_model, bad_pos):
    """A cell restored at a negative position (or INT32_MAX) once stayed in llama.cpp's cache for good: removal covers
    [0, INT32_MAX) only, so every later restore of the sequence failed. Patch 0006 refuses such a state."""
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=128)
    llm.eval(llm.tokenize(PROMPT))
    snap = llm.save_state()
    blob = snap.to_bytes()
    # the frame (magic, origin, the KV array's length), llama.cpp's 8-byte header, then its cells: the first one's
    # position follows the stream and cell counts
    cells_at = 8 + 8 + struct.unpack_from("<Q", blob, 8)[0] + 8 + 8
    n_stream, n_cells, pos, n_seq_id, seq_id = struct.unpack_from("<IIiIi", blob, cells_at)
    assert (n_stream, n_cells, n_seq_id, seq_id) == (1, 16, 1, 0) and pos in llm.kv_state().positions
    bad = blob[:cells_at + 8] + struct.pack("<i", bad_pos) + blob[cells_at + 12:-4]
    bad += struct.pack("<I", zlib.crc32(bad))  # a well-formed snapshot that llama.cpp must refuse on its own
    with pytest.raises(ValueError, match="refused its KV cells|do not match its positions"):
        llm.load_state(type(snap).from_bytes(bad))
    llm.load_state(snap)  # the sequence takes its own snapshot again
    assert llm.kv_state().n_cells == 16 and llm.generate([65], max_tokens=4, temperature=0, reset=False) is not None


def test_a_damaged_snapshot_is_refused_wherever_its_bytes_are_flipped_and_the_sequence_stays_usable(tiny_model):
    """Snapshot bytes end with a CRC-32 of everything before it: a flipped byte anywhere (the KV data included,
    where the structure checks see nothing) is a ValueError, and the sequence keeps what it held."""
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=128)
    llm.eval(llm.tokenize(PROMPT))
    snap = llm.save_state()
    blob = snap.to_bytes()
    assert struct.unpack("<I", blob[-4:])[0] == zlib.crc32(blob[:-4])  # the standard CRC-32 (zlib's, zip's)
    expected = llm.generate([], max_tokens=6, temperature=0, reset=False)
    rng = np.random.default_rng(0)
    spots = sorted({0, 7, 8, len(blob) // 2, len(blob) - 5, len(blob) - 1, *rng.integers(0, len(blob), 40).tolist()})
    for at in spots:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[at] ^= flip
            with pytest.raises(ValueError, match="damaged|not a session snapshot|format"):
                type(snap).from_bytes(bytes(bad))
    with pytest.raises(ValueError):
        type(snap).from_bytes(blob[:-1])
    llm.load_state(type(snap).from_bytes(blob))
    assert llm.generate([], max_tokens=6, temperature=0, reset=False) == expected


def test_snapshots_of_formats_3_to_5_still_load(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=128)
    llm.eval(llm.tokenize(PROMPT))
    blob = llm.save_state().to_bytes()
    # format 6 ends with the (empty) dropped text's places, tokens and scores, then the checksum (4 bytes); before
    # them, format 5's origins of the kept entries and of the (empty) host store
    text = 8 + 8 + (4 + 5 * 8)
    origins = 8 + 4 * llm.kv_state().n_cells + 8
    # format 4: without the origins; format 3: without its host store (empty: 100 bytes) and checksum either
    empty_host = 8 + 8 + 8 + (4 + 5 * 8) + 8 + 3 * 8
    five = b"h2osnap5" + blob[8:-4 - text]
    five += zlib.crc32(five).to_bytes(4, "little")
    four = b"h2osnap4" + blob[8:-4 - text - origins]
    four += zlib.crc32(four).to_bytes(4, "little")
    three = b"h2osnap3" + blob[8:-4 - text - origins - empty_host]
    expected = llm.generate([], max_tokens=6, temperature=0, reset=False)
    for old in (five, four, three):
        llm.load_state(type(llm.save_state()).from_bytes(old))
        assert llm.kv_state().origins.tolist() == llm.kv_state().positions.tolist()  # no roll before origins
        assert llm.generate([], max_tokens=6, temperature=0, reset=False) == expected
