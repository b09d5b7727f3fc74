"""A quantized K cache (type_k): fewer bytes per kept token, with eviction, rolling and snapshots working as with F16."""
import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.capacity import kv_bytes_per_cell
from tiny_model import write_tiny_llama
from device_tolerance import CPU_BACKEND

TEXT = "Quantized keys still find their heavy hitters. " * 12


@pytest.fixture(scope="module")
def tiny_hd64(tmp_path_factory) -> str:
    """The tiny llama with key heads of 64 values, as SmolLM2 and Qwen2.5-0.5B have (the 1.5B: 128)."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("hd64") / "tiny-hd64.gguf", n_embd=256))


@pytest.mark.parametrize("type_k,ratio", [("q8_0", (34 / 32 + 2) / 4), ("q4_0", (18 / 32 + 2) / 4), ("f32", 1.5)])
def test_a_quantized_k_cache_takes_the_bytes_its_type_says(tiny_hd64, type_k, ratio):
    """Exactly on the CPU backend; a device's allocator may pad each layer's tensor (CUDA pads a quantized row to a
    multiple of 512 values: 603,136 bytes for the 602,112 of q8_0 here), so there at most 1% more."""
    f16 = Llama(tiny_hd64, policy="h2o", budget=64, **CPU_BACKEND)
    q = Llama(tiny_hd64, policy="h2o", budget=64, type_k=type_k, **CPU_BACKEND)
    assert q.stats()["kv_bytes"] == pytest.approx(f16.stats()["kv_bytes"] * ratio, rel=1e-6)
    assert q.kv_bytes_per_cell == kv_bytes_per_cell(f16.kv_bytes_per_cell, type_k=type_k)
    anywhere = Llama(tiny_hd64, policy="h2o", budget=64, type_k=type_k)  # on the suite's device, if any
    assert q.stats()["kv_bytes"] <= anywhere.stats()["kv_bytes"] <= q.stats()["kv_bytes"] * 1.01


@pytest.mark.parametrize("type_k", ["q8_0", "q4_0"])
def test_eviction_rolling_and_snapshots_work_on_quantized_keys(tiny_hd64, type_k):
    """On the CPU backend (on a device, rolling a quantized K cache is refused: tests/engine/test_device.py)."""
    kw = dict(policy="h2o", budget=24, n_batch=32, position_rolling=True, roll_interval=1, **CPU_BACKEND)
    llm = Llama(tiny_hd64, type_k=type_k, **kw)
    llm.eval(llm.tokenize(TEXT))
    st = llm.kv_state()
    assert st.n_cells == 24 and st.positions.tolist() == list(range(24)) and st.n_evicted > 0
    copy = Llama(tiny_hd64, type_k=type_k, **kw)
    copy.load_state(llm.save_state())
    for t in llm.tokenize(" and more", add_bos=False):  # the pending K shift dequantizes, rotates, requantizes
        llm.eval([t])
        copy.eval([t])
        np.testing.assert_allclose(copy.last_logits(), llm.last_logits(), atol=1e-4)
    with pytest.raises(ValueError, match="another model or cache"):
        Llama(tiny_hd64, **kw).load_state(llm.save_state())


def log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@pytest.mark.slow
def test_q8_0_keys_stay_close_to_f16_and_q4_0_less_so(smol_model, long_text):
    """SmolLM2 over 400 tokens of prose, no eviction: per-token top-1 agreement with the F16 cache and KL(f16 || q).
    Measured: q8_0 0.945 / 0.0044, q4_0 0.84 / 0.052."""
    f16 = Llama(smol_model, n_ctx=1024, n_threads=2)
    tokens = f16.tokenize(long_text)[:400]
    ref = log_softmax(f16.eval(tokens, logits_all=True))
    stats = {}
    for type_k in ("q8_0", "q4_0"):
        lp = log_softmax(Llama(smol_model, n_ctx=1024, n_threads=2, type_k=type_k).eval(tokens, logits_all=True))
        stats[type_k] = ((ref.argmax(1) == lp.argmax(1)).mean(), (np.exp(ref) * (ref - lp)).sum(1).mean())
    assert stats["q8_0"][0] >= 0.9 and stats["q8_0"][1] < 0.02
    assert stats["q4_0"][1] > stats["q8_0"][1]


def test_type_k_errors(tiny_model):
    with pytest.raises(ValueError, match="type_k must be one of"):
        Llama(tiny_model, policy="h2o", budget=16, type_k="q3_k")
    with pytest.raises(TypeError, match="type_k"):
        Llama(tiny_model, policy="h2o", budget=16, type_k=8.0)
    for q8_0 in ("q8_0", 8):  # by name, or llama-cpp-python's ggml type number
        with pytest.raises(ValueError, match="key heads hold 16"):
            Llama(tiny_model, policy="h2o", budget=16, type_k=q8_0)  # 16 values per head: not a whole block of 32


def test_rolling_quantized_keys_needs_heads_llama_cpp_can_shift(tmp_path):
    """llama.cpp shifts quantized keys only on its Hadamard-rotated path (heads of 64k values): refused, not crashed."""
    hd32 = str(write_tiny_llama(tmp_path / "hd32.gguf", n_embd=128))
    llm = Llama(hd32, policy="h2o", budget=16, type_k="q8_0")  # one block per head: fine without rolling
    llm.eval(llm.tokenize(TEXT))
    assert llm.kv_state().n_cells == 16
    with pytest.raises(ValueError, match="multiple of 64"):
        Llama(hd32, policy="h2o", budget=16, type_k="q8_0", position_rolling=True, roll_interval=1)


def test_for_kv_limit_counts_quantized_cells(tiny_hd64):
    limit = 4 * 2**20
    f16 = Llama.for_kv_limit(tiny_hd64, limit, prompt_tokens=200, max_tokens=50, budget=None)
    q4 = Llama.for_kv_limit(tiny_hd64, limit, prompt_tokens=200, max_tokens=50, budget=None, type_k="q4_0")
    assert q4.n_seq_max > f16.n_seq_max and q4.stats()["kv_bytes"] <= limit


def test_bf16_keys_work_and_refuse_rolling_instead_of_aborting(tiny_hd64):
    llm = Llama(tiny_hd64, policy="h2o", budget=24, type_k="bf16")
    assert llm.generate(TEXT, max_tokens=8, temperature=0) is not None and llm.kv_state().n_evicted > 0
    with pytest.raises(ValueError, match="type_k 'bf16'.*f16 and f32 only"):
        Llama(tiny_hd64, policy="h2o", budget=24, type_k="bf16", position_rolling=True, roll_interval=1)
