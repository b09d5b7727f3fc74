"""Per-head eviction in composite cells (`per_head=True`): every layer and KV head keeps its own entries, H2O's
published rule, inside the same budget of cells.

The reference is independent of llama.cpp and of the engine: a NumPy forward pass over the GGUF weights (float64)
in which each (layer, KV head) attends only the positions it keeps, with H2O's per-head rule applied after every
decode (accumulated column sums over the group's query heads; the `heavy` best-scored older entries and the
`recent` newest; ties to the older position). The engine must keep the same positions in every (layer, head) step
by step, and its logits (from cells holding a different token in each head) must equal the reference's.
"""
from __future__ import annotations

from typing import List

import numpy as np
import pytest

from attention_reference import LlamaReference
from device_tolerance import CPU_BACKEND, approximate, assert_logits_close, on_device
from h2o_local import Llama
from h2o_local.policies import H2O, TOVA, KeyDiff, SnapKV, parse
from tiny_model import write_tiny_llama

TEXT = "The lighthouse keeper climbed the stairs every evening to light the great lamp above the sea."


class PerHeadH2OReference:
    """A growing sequence under per-head H2O, computed from the model's weights alone."""

    def __init__(self, ref: LlamaReference, budget: int):
        self.r = ref
        self.heavy, self.recent = budget // 2, budget - budget // 2
        self.budget = budget
        self.n = 0
        self.k: List[np.ndarray] = []      # per layer [n, n_head_kv, d] after RoPE
        self.v: List[np.ndarray] = []
        self.kept: List[np.ndarray] = []   # per layer bool [n_head_kv, n]
        self.score: List[np.ndarray] = []  # per layer [n_head_kv, n]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        d = x.shape[-1]
        theta = self.r.rope_base ** (-np.arange(0, d, 2) / d)
        ang = pos[:, None] * theta[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out

    def feed(self, tokens: List[int]) -> np.ndarray:
        """Decode `tokens` at the next positions, then evict per head; returns the last token's logits."""
        r, w = self.r, self.r.w
        m = len(tokens)
        pos = np.arange(self.n, self.n + m)
        x = w["token_embd.weight"][tokens]
        group = r.n_head // r.n_head_kv
        for il in range(r.n_layer):
            h = r.rms(x, w[f"blk.{il}.attn_norm.weight"])
            q, k, v = (h @ w[f"blk.{il}.attn_{t}.weight"].T for t in "qkv")
            d = q.shape[1] // r.n_head
            q = self._rope(q.reshape(m, r.n_head, d), pos)
            k = self._rope(k.reshape(m, r.n_head_kv, d), pos)
            v = v.reshape(m, r.n_head_kv, d)
            if il == len(self.k):
                self.k.append(np.zeros((0, r.n_head_kv, d)))
                self.v.append(np.zeros((0, r.n_head_kv, d)))
                self.kept.append(np.zeros((r.n_head_kv, 0), bool))
                self.score.append(np.zeros((r.n_head_kv, 0)))
            self.k[il] = np.concatenate([self.k[il], k])
            self.v[il] = np.concatenate([self.v[il], v])
            self.kept[il] = np.concatenate([self.kept[il], np.ones((r.n_head_kv, m), bool)], axis=1)
            self.score[il] = np.concatenate([self.score[il], np.zeros((r.n_head_kv, m))], axis=1)
            att = np.zeros((m, r.n_head, d))
            all_pos = np.arange(self.n + m)
            for qh in range(r.n_head):
                hk = qh // group  # query head qh reads KV head qh // group
                logits = q[:, qh] @ self.k[il][:, hk].T / np.sqrt(d)  # [m, n + m]
                visible = (all_pos[None, :] <= pos[:, None]) & self.kept[il][hk][None, :]
                logits = np.where(visible, logits, -np.inf)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                att[:, qh] = p @ self.v[il][:, hk]
                self.score[il][hk] += p.sum(0)
            x = x + att.reshape(m, -1) @ w[f"blk.{il}.attn_output.weight"].T
            h = r.rms(x, w[f"blk.{il}.ffn_norm.weight"])
            g = h @ w[f"blk.{il}.ffn_gate.weight"].T
            u = h @ w[f"blk.{il}.ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[f"blk.{il}.ffn_down.weight"].T
        self.n += m
        for il in range(r.n_layer):
            for hk in range(r.n_head_kv):
                held = np.flatnonzero(self.kept[il][hk])
                if len(held) <= self.budget:
                    continue
                older = held[: len(held) - self.recent]
                s = self.score[il][hk][older]
                top = sorted(range(len(older)), key=lambda i: (-s[i], i))[: self.heavy]
                keep = set(older[top].tolist()) | set(held[len(held) - self.recent:].tolist())
                self.kept[il][hk] = np.isin(np.arange(self.n), sorted(keep))
        return r.rms(x[-1], w["output_norm.weight"]) @ w["output.weight"].T

    def kept_positions(self) -> np.ndarray:
        """[n_layer, n_head_kv, budget]: each head's kept positions, ascending."""
        return np.array([[np.flatnonzero(k) for k in layer] for layer in self.kept])


def test_each_head_keeps_what_the_per_head_reference_keeps(tiny_model):
    budget = 8
    llm = Llama(tiny_model, policy=H2O(budget=budget, per_head=True), kv_f32=True, n_batch=16)
    ref = PerHeadH2OReference(LlamaReference(tiny_model), budget)
    tokens = llm.tokenize(TEXT)
    # a prompt piece, then generation steps and short pieces
    chunks, at = [], 0
    for size in [12, 1, 1, 3, 1, 1, 5, 1, 1, 1, 2, 1, 1, 1, 1, 4, 1, 1]:
        chunks.append(tokens[at:at + size])
        at += size
    moved = 0
    for chunk in chunks:
        llm.eval(chunk)
        expected_logits = ref.feed(chunk)
        st = llm.kv_state()
        held = np.sort(st.head_positions, axis=-1)
        np.testing.assert_array_equal(held, ref.kept_positions())
        assert_logits_close(llm.last_logits(), expected_logits, device=approximate(llm), cpu_atol=1e-4, cpu_rtol=1e-4)
        assert st.n_cells == budget  # B cells per sequence, whatever the heads chose
        moved += int((st.head_positions != st.positions[None, None, :]).sum())
    assert moved > 0  # the heads did choose differently: cells hold other positions' parts
    assert st.n_head_moves > 0 and st.evict_seconds > 0
    heads = ref.kept_positions().reshape(-1, budget)
    assert len({tuple(h) for h in heads}) > 1


def test_a_budget_that_never_evicts_equals_the_full_cache(tiny_model):
    """Bit for bit on the CPU. On a device with F32 cells the per-layer export changes which kernels run (lavapipe:
    7.9e-3 apart): compared at its tolerance here; tests/engine/test_device.py demands exactness there with F16 cells."""
    tokens = Llama(tiny_model).tokenize(TEXT)
    full = Llama(tiny_model, kv_f32=True)
    ph = Llama(tiny_model, policy=H2O(budget=200, per_head=True), kv_f32=True)
    for llm in (full, ph):
        llm.eval(tokens[:20])
        llm.eval(tokens[20:])
    assert_logits_close(ph.last_logits(), full.last_logits(), device=on_device(ph), cpu_atol=0.0)
    assert ph.kv_state().n_evicted == 0


def test_label_round_trips_and_options_are_checked():
    assert H2O(budget=64, per_head=True).label == "h2o-64+ph"
    assert parse("tova-128+s4+ph") == TOVA(budget=128, sinks=4, per_head=True)
    assert parse("snapkv-96+w8+ph").per_head
    assert H2O(budget=64).per_head is None and H2O(budget=64, per_head=False).label == "h2o-64"
    with pytest.raises(ValueError, match="probe"):
        TOVA(budget=64, probe="question", per_head=True)
    with pytest.raises(ValueError, match="keys"):
        KeyDiff(budget=64, per_head=True)
    with pytest.raises(ValueError, match="ranks nothing: it takes no per_head"):
        parse("sink-64+ph")
    with pytest.raises(TypeError, match="per_head"):
        H2O(budget=64, per_head=1)


def test_rolling_and_whole_token_policies_are_refused_clearly(tiny_model):
    with pytest.raises(ValueError, match="position_rolling"):
        Llama(tiny_model, policy=H2O(budget=8, per_head=True), position_rolling=True, roll_interval=1)
    llm = Llama(tiny_model, policy=H2O(budget=8, per_head=True))
    llm.eval(llm.tokenize(TEXT)[:30])
    with pytest.raises(ValueError, match="per-head cells"):
        llm.set_policy("h2o", 8)
    with pytest.raises(ValueError, match="per-head cells"):
        llm.set_policy("local", 8, seq_id=0)
    llm.eval([70])  # still usable under its own policy
    assert llm.kv_state().n_cells == 8
    llm.reset()
    llm.set_policy("h2o", 8)  # an empty sequence takes any policy
    llm.eval(llm.tokenize(TEXT)[:30])
    assert llm.kv_state().head_positions is None


def test_snapshots_and_saved_sessions_carry_the_heads(tiny_model, tmp_path):
    tokens = Llama(tiny_model).tokenize(TEXT)
    llm = Llama(tiny_model, policy=SnapKV(budget=10, per_head=True), kv_f32=True, n_batch=16)
    llm.eval(tokens[:16])
    llm.eval(tokens[16:40])
    snap = llm.save_state()
    before = llm.kv_state()
    llm.eval(tokens[40:50])
    logits_a, heads_a = llm.last_logits().copy(), llm.kv_state().head_positions.copy()

    llm.load_state(snap)
    np.testing.assert_array_equal(llm.kv_state().head_positions, before.head_positions)
    llm.eval(tokens[40:50])
    np.testing.assert_array_equal(llm.last_logits(), logits_a)
    np.testing.assert_array_equal(llm.kv_state().head_positions, heads_a)

    # through bytes, into another Llama with the same policy
    other = Llama(tiny_model, policy=SnapKV(budget=10, per_head=True), kv_f32=True, n_batch=16)
    path = tmp_path / "s.bin"
    path.write_bytes(snap.to_bytes())
    other.load_state(type(snap).from_bytes(path.read_bytes()))
    other.eval(tokens[40:50])
    np.testing.assert_array_equal(other.last_logits(), logits_a)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_batched_sequences_each_keep_their_own_heads(tiny_model, kv_unified):
    """Against each sequence alone, on the CPU backend without flash attention, whose results do not depend on a
    batch's size (a GPU's products, and the CPU's flash kernel, round differently by batch)."""
    text_b = "A small boat crossed the harbour at dawn while gulls circled over the fish market and the old pier."
    exact = dict(kv_f32=True, flash_attn=False, **CPU_BACKEND)
    single = Llama(tiny_model, policy=H2O(budget=8, per_head=True), n_batch=16, **exact)
    tok_a, tok_b = single.tokenize(TEXT), single.tokenize(text_b)
    batched = Llama(tiny_model, policy=H2O(budget=8, per_head=True), n_batch=32, n_seq_max=2,
                    kv_unified=kv_unified, **exact)
    expected = {}
    for seq, toks in ((0, tok_a), (1, tok_b)):
        single.reset()
        for a in range(0, 40, 4):
            single.eval(toks[a:a + 4])
        expected[seq] = (single.last_logits().copy(), single.kv_state().head_positions.copy())
    for a in range(0, 40, 4):
        batched.eval_batch({0: tok_a[a:a + 4], 1: tok_b[a:a + 4]})
    for seq in (0, 1):
        np.testing.assert_allclose(batched.last_logits(seq), expected[seq][0], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(batched.kv_state(seq).head_positions, expected[seq][1])
        assert batched.kv_state(seq).n_cells == 8


def test_flash_attention_moves_untransposed_values(tiny_model):
    """With flash attention V is stored like K (one run per head and cell): the per-head reference again, within
    flash attention's own rounding (its F16 steps: about 0.01 on these logits for the full cache too)."""
    budget = 10
    llm = Llama(tiny_model, policy=H2O(budget=budget, per_head=True), kv_f32=True, n_batch=16, flash_attn=True)
    ref = PerHeadH2OReference(LlamaReference(tiny_model), budget)
    tokens = llm.tokenize(TEXT)
    for a in range(0, 60, 6):
        llm.eval(tokens[a:a + 6])
        expected = ref.feed(tokens[a:a + 6])
        np.testing.assert_array_equal(np.sort(llm.kv_state().head_positions, axis=-1), ref.kept_positions())
        np.testing.assert_allclose(llm.last_logits(), expected, atol=0.1)
        assert int(np.argmax(llm.last_logits())) == int(np.argmax(expected))


def test_quantized_cells_move_whole_blocks(tmp_path):
    """q8_0 K and V (flash attention) on a model whose heads are one q8_0 block (32 values): each move copies a
    head's blocks as they are, so the heads choose what the F16 cache's heads choose, nearly."""
    model = str(write_tiny_llama(tmp_path / "tiny-128.gguf", n_embd=128))
    tokens = Llama(model).tokenize(TEXT)
    q8 = Llama(model, policy=H2O(budget=10, per_head=True), n_batch=16, flash_attn=True, type_k="q8_0", type_v="q8_0")
    f16 = Llama(model, policy=H2O(budget=10, per_head=True), n_batch=16, flash_attn=True)
    for llm in (q8, f16):
        for a in range(0, 60, 6):
            llm.eval(tokens[a:a + 6])
    a, b = q8.kv_state().head_positions, f16.kv_state().head_positions
    assert (a != q8.kv_state().positions[None, None, :]).any()  # parts were moved
    same = np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a.reshape(-1, 10), b.reshape(-1, 10))])
    assert same >= 0.8
    assert int(np.argmax(q8.last_logits())) == int(np.argmax(f16.last_logits()))
    assert np.corrcoef(q8.last_logits(), f16.last_logits())[0, 1] > 0.995  # q8_0's rounding, not another token's K/V


def test_a_switch_to_per_head_ranks_each_kv_head_by_its_share_of_the_summed_scores(tiny_model):
    """A sequence fed under a whole-token policy has no per-layer scores: after set_policy(per_head) + compress,
    each KV head ranks by its query heads' scores summed over layers (the same in every layer) until it observes
    its own."""
    llm = Llama(tiny_model, policy=H2O(budget=100), kv_f32=True)
    llm.eval(llm.tokenize(TEXT)[:40])
    head_scores = llm.kv_state().head_scores  # [40, n_head]
    llm.set_policy(H2O(budget=8, per_head=True))
    llm.compress()
    st = llm.kv_state()
    assert st.n_cells == 8
    group = head_scores.shape[1] // st.head_positions.shape[1]
    for h in range(st.head_positions.shape[1]):
        score = head_scores[:, h * group:(h + 1) * group].sum(axis=1)
        older = np.arange(40 - 4)  # recent: the 4 newest
        heavy = sorted(older[np.lexsort((older, -score[:36]))][:4].tolist())
        for layer in st.head_positions:
            assert sorted(layer[h].tolist()) == heavy + [36, 37, 38, 39]
    llm.eval([70, 71])  # and it goes on observing its own
    assert llm.kv_state().n_cells == 8


def test_a_protected_prefix_is_held_by_every_head_and_memory_is_the_budget(tiny_model):
    tokens = Llama(tiny_model).tokenize(TEXT)
    ph = Llama(tiny_model, policy=H2O(budget=12, sinks=2, per_head=True), keep=5, n_batch=16)
    whole = Llama(tiny_model, policy=H2O(budget=12, sinks=2), keep=5, n_batch=16)
    for llm in (ph, whole):
        for a in range(0, 60, 6):
            llm.eval(tokens[a:a + 6])
    st = ph.kv_state()
    for part in st.head_positions.reshape(-1, 12):
        assert set(range(5)) <= set(part.tolist())  # the prefix (it stands for the 2 sinks too)
        assert {57, 58, 59} <= set(part.tolist())    # the newest entries (recent window)
    assert st.n_cells == 12 and st.kv_bytes == whole.kv_state().kv_bytes and st.kv_cells == whole.kv_state().kv_cells
    positions, share = st.held()
    assert share.sum() == pytest.approx(12) and set(range(5)) <= set(positions.tolist())
