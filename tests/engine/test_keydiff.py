"""KeyDiff: eviction by the keys alone. The exported keys equal a NumPy forward pass over the GGUF's weights, and
the kept set at every step equals an independent NumPy ranking of those keys."""
import numpy as np
import pytest

from attention_reference import LlamaReference
from h2o_local import KeyDiff, Llama, ModelInfo
from device_tolerance import assert_values_close, approximate
from engine_view import cached_keys

TEXT = "Keys that stand out are kept, keys like the others go. "


def all_keys(llm, seq=0):
    """{layer: (positions, keys [n, n_embd_k_gqa])} of the cached entries."""
    return {il: cached_keys(llm, seq, il) for il in range(llm.info.n_layer)}


def test_exported_keys_are_the_keys_attention_reads(tiny_model):
    """F32 cache, no eviction: every layer's cached keys equal the reference's keys after RoPE."""
    llm = Llama(tiny_model, n_ctx=256, kv_f32=True)
    tokens = llm.tokenize(TEXT)[:40]
    llm.eval(tokens)
    ref = LlamaReference(tiny_model).keys(tokens)
    for il, (pos, keys) in all_keys(llm).items():
        assert pos.tolist() == list(range(len(tokens)))
        assert_values_close(keys, ref[il].reshape(len(tokens), -1), device=approximate(llm), cpu_rtol=1e-3,
                            cpu_atol=1e-4)


def keydiff_scores(layers, n_head_kv):
    """kvpress's KeyDiff per layer and KV head: -cos(k_i, mean_j k_j / |k_j|), summed over layers and heads."""
    total = 0.0
    for keys in layers:
        k = keys.reshape(keys.shape[0], n_head_kv, -1).astype(np.float64)   # [n, head, d]
        unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
        anchor = unit.mean(axis=0)                                           # [head, d]
        cos = (k * anchor).sum(-1) / np.maximum(np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor, axis=-1), 1e-8)
        total = total - cos.sum(axis=1)
    return total


def kept(scores, heavy, recent, sinks=0):
    n = len(scores)
    middle = sorted(range(sinks, n - recent), key=lambda i: (-scores[i], i))[:heavy]
    return sorted(list(range(sinks)) + middle + list(range(n - recent, n)))


@pytest.mark.parametrize("budget,heavy,recent,sinks,rolling", [(16, 8, 8, 0, False), (12, 7, 3, 2, False),
                                                                 (16, 8, 8, 0, True)])
def test_keydiff_keeps_what_the_reference_keeps(tiny_model, budget, heavy, recent, sinks, rolling):
    """At every step. The engine reads only new tokens' keys between evictions (all of them again after a roll,
    whose K shift rotates every key); the reference reads all of them afresh."""
    n_head_kv = ModelInfo.load(tiny_model).n_head_kv
    llm = Llama(tiny_model, policy=KeyDiff(heavy=heavy, recent=recent, sinks=sinks), n_batch=512,
                position_rolling=rolling, roll_interval=3)
    assert not llm.policy.needs_scores  # no attention scores exported
    prompt = llm.tokenize(TEXT * 3)
    # the prompt fits: attended whole, then compressed once, by the same keys a full cache holds
    full = Llama(tiny_model, n_ctx=512)
    full.eval(prompt)
    layers = [k for _, k in all_keys(full).values()]
    llm.eval(prompt)
    expect = kept(keydiff_scores(layers, n_head_kv), heavy, recent, sinks)
    if not rolling:  # (with rolling, the compaction after the prompt applied its K shift: the keys are rotated)
        np.testing.assert_array_equal(all_keys(llm)[0][1], layers[0][expect])
    checked = 0
    for t in llm.tokenize(TEXT, add_bos=False)[:24]:
        st = llm.kv_state()
        shift_pending = rolling and st.positions.tolist() == list(range(st.n_cells))
        before = all_keys(llm)                 # the kept entries' keys do not change when a token is fed
        llm.eval([t])
        after = all_keys(llm)
        if shift_pending:  # this decode rotated the keys: the ones read before it are not what the policy saw
            continue
        layers = [np.vstack([before[il][1], after[il][1][-1:]]) for il in before]  # the new token is always kept
        expect = kept(keydiff_scores(layers, n_head_kv), heavy, recent, sinks)
        np.testing.assert_array_equal(after[0][1], layers[0][expect])
        if not rolling:
            pos = np.append(before[0][0], after[0][0][-1])
            assert llm.kv_state().positions.tolist() == pos[expect].tolist()
        checked += 1
    assert llm.kv_state().n_cells == budget and checked >= 12


def test_keys_of_a_bad_sequence_or_layer_are_refused(tiny_model):
    llm = Llama(tiny_model, policy="keydiff", budget=16)
    with pytest.raises(ValueError, match="seq_id"):
        cached_keys(llm, 5, 0)
    with pytest.raises(ValueError, match="layer"):
        cached_keys(llm, 0, 99)
