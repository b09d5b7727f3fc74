"""Flash attention: every policy runs with it. Flash attention forms no softmax: on the CPU its kernel keeps each
row's KQ values and writes the softmax's column sums beside its output (patch 0007); for a cache on another device a
pass of its own computes KQ and its softmax beside the flash kernel (no V product, patch 0004), which
`_scores_sum_rows=True` forces here. Both equal the non-flash export's sums to rounding. A quantized V cache (which
llama.cpp allows only with flash attention) works with every policy."""
import os

import numpy as np
import pytest

from h2o_local import Llama
from tiny_model import write_tiny_llama
from device_tolerance import CPU_BACKEND as CPU

TEXT = ("Flash attention forms no softmax, so the scores come from a pass of their own beside it, and every policy "
        "runs with it, the heavy hitters included. ")


@pytest.fixture(scope="module")
def tiny_hd64(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("fa") / "tiny-hd64.gguf", n_embd=256))


@pytest.mark.skipif(bool(os.environ.get("H2O_LOCAL_TEST_FLASH_ATTN")), reason="checks the default, which "
                    "H2O_LOCAL_TEST_FLASH_ATTN replaces")
def test_flash_attention_is_auto_and_says_what_it_became(tiny_hd64):
    """"auto" (the default) is off with every layer on the CPU (a GPU device turns it on: tests/engine/test_device.py);
    "on" / True and "off" / False are kept; anything else is refused before a model is loaded."""
    assert Llama(tiny_hd64, n_ctx=256, n_gpu_layers=0).flash_attn is False
    for on in ("on", True):
        assert Llama(tiny_hd64, n_ctx=256, flash_attn=on).flash_attn is True
    for off in ("off", False):
        assert Llama(tiny_hd64, n_ctx=256, flash_attn=off).flash_attn is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="flash_attn must be 'auto', 'on', 'off'"):
            Llama(tiny_hd64, n_ctx=256, flash_attn=bad)


def test_the_full_cache_with_flash_attention_computes_the_same_logits_to_rounding(tiny_hd64):
    """Flash attention (its F16 products on the CPU) moves the logits less than storing the cache in F16 does
    (measured 0.22 against 0.39 on a scale of 15)."""
    tokens = Llama(tiny_hd64, n_ctx=256).tokenize(TEXT)[:100]
    exact = Llama(tiny_hd64, n_ctx=256, kv_f32=True).eval(tokens, logits_all=True)
    flash = Llama(tiny_hd64, n_ctx=256, kv_f32=True, flash_attn=True).eval(tokens, logits_all=True)
    f16 = Llama(tiny_hd64, n_ctx=256).eval(tokens, logits_all=True)
    assert np.abs(flash - exact).max() <= np.abs(f16 - exact).max()
    assert (flash.argmax(1) == exact.argmax(1)).mean() >= 0.95


def test_scores_with_flash_attention_after_a_short_prompt_then_a_longer_one(smol_model, long_text):
    """A prompt of 64 tokens, a reset, then one over more cells: with 7 or more of SmolLM2's layers on a Vulkan device
    (lavapipe) the scores' out-product reduction crashed the process here; a Vulkan device sums the transposed pass
    instead. Every position is scored, and every query's probabilities sum to 1 per head and layer."""
    llm = Llama(smol_model, n_ctx=1024, n_batch=512, export_scores=True, flash_attn=True)
    tokens = llm.tokenize(long_text)[:300]
    llm.eval(tokens[:64])
    llm.reset()
    llm.eval(tokens)
    pos, sums = llm.last_scores()
    np.testing.assert_array_equal(pos, np.arange(300))
    np.testing.assert_allclose(sums.sum(), 300 * sums.shape[1] * llm.info.n_layer, rtol=1e-3)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("fa1") / "tiny-1layer.gguf", n_embd=256, n_layer=1))


def test_scores_with_flash_attention_equal_the_non_flash_export(one_layer):
    """One layer, so that both paths score the same queries and keys: the same sums per position and head, for a
    prompt and then for single tokens. (With more layers the queries of the later ones differ by flash attention's
    rounding of the earlier ones' outputs; the policies' choices are compared below.)"""
    kw = dict(n_ctx=256, export_scores=True)
    plain, flash = Llama(one_layer, **kw), Llama(one_layer, flash_attn=True, **kw)
    tokens = plain.tokenize(TEXT)
    for step in (tokens[:60], tokens[60:61], tokens[61:62]):
        plain.eval(step)
        flash.eval(step)
        (pp, ps), (fp, fs) = plain.last_scores(), flash.last_scores()
        np.testing.assert_array_equal(fp, pp)
        # every query's probabilities sum to 1 per head: the sums' total is queries x heads
        np.testing.assert_allclose(fs.sum(), len(step) * fs.shape[1], rtol=1e-4)
        np.testing.assert_allclose(fs, ps, rtol=1e-5, atol=1e-6)


def test_flash_attention_scores_the_f16_keys_it_attends(one_layer):
    """Flash attention reads an F32 cache's keys rounded to F16, and its sums are those of what it attended: they
    move from the F32 export's no more than the F16 cache's export does (up to the order of additions). The CPU
    kernel's reading; a device's kernel reads the cells its own way."""
    plain32, flash32, plain16 = (Llama(one_layer, n_ctx=256, export_scores=True, **kw, **CPU) for kw in
                                 (dict(kv_f32=True), dict(kv_f32=True, flash_attn=True), dict()))
    tokens = plain32.tokenize(TEXT)
    for step in (tokens[:60], tokens[60:61]):
        for llm in (plain32, flash32, plain16):
            llm.eval(step)
        s32, sflash, s16 = (llm.last_scores()[1] for llm in (plain32, flash32, plain16))
        np.testing.assert_allclose(sflash, s16, rtol=1e-5, atol=1e-6)
        assert np.abs(sflash - s32).max() <= np.abs(s16 - s32).max() + 1e-5


# The CPU kernel has three paths, each of which keeps the column sums its own way: a row at a time (fewer than 64
# queries, or a quantized cache), tiles of 64 queries x 64 keys (a prompt piece on an F16 cache) and, for one query
# over 512 keys or more on an F16 cache, the keys split among the threads. Thread counts that divide nothing evenly.
KERNEL_PATHS = {
    "row at a time": (dict(type_k="q8_0", type_v="q8_0"), (60, 1, 200, 1)),
    "tiles": (dict(), (200, 150)),
    "keys split among threads": (dict(), (300, 300, 1, 1, 1)),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("path", list(KERNEL_PATHS))
def test_the_kernels_sums_equal_the_separate_pass(one_layer, path, threads):
    """The tiled path multiplies F32 queries with the keys where the pass (and non-flash attention) round the
    queries to F16 first: its sums differ by that rounding (measured 7e-4 of the largest sum; 1e-3 against an F32
    cache without flash attention, the pass's 1.4e-3), the other paths' by the order of additions."""
    cache, steps = KERNEL_PATHS[path]
    kw = dict(n_ctx=1024, n_batch=512, export_scores=True, flash_attn=True, n_threads=threads, **cache, **CPU)
    kernel, separate = Llama(one_layer, **kw), Llama(one_layer, _scores_sum_rows=True, **kw)
    tokens = kernel.tokenize(TEXT * 12)
    start = 0
    for n in steps:
        step = tokens[start:start + n]
        start += n
        kernel.eval(step)
        separate.eval(step)
        (kp, ks), (sp, ss) = kernel.last_scores(), separate.last_scores()
        np.testing.assert_array_equal(kp, sp)
        np.testing.assert_allclose(ks.sum(axis=0), len(step), rtol=1e-4)  # each head: one per query
        tiled = n >= 64 and not cache  # the prompt pieces of an F16 cache
        tolerance = 2e-3 if tiled else 1e-5
        assert np.abs(ks - ss).max() <= tolerance * ss.max(), (n, np.abs(ks - ss).max(), ss.max())
        np.testing.assert_array_equal(kernel.last_logits(), separate.last_logits())  # the output is untouched
    assert start > 512 or path != "keys split among threads"


@pytest.mark.parametrize("path", list(KERNEL_PATHS))
def test_the_kernels_sums_are_the_same_in_every_run(one_layer, path):
    """Exact within one backend: each thread adds the same rows in every run (chunks taken as they came gave sums
    up to 7.6e-6 apart from run to run with 2 threads, and so evictions that could differ on a near tie)."""
    cache, steps = KERNEL_PATHS[path]
    runs = []
    for _ in range(4):
        llm = Llama(one_layer, n_ctx=1024, n_batch=512, export_scores=True, flash_attn=True, n_threads=3, **cache, **CPU)
        tokens = llm.tokenize(TEXT * 12)
        sums, start = [], 0
        for n in steps:
            llm.eval(tokens[start:start + n])
            start += n
            sums.append(llm.last_scores()[1].copy())
        runs.append(sums)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_the_kernels_sums_keep_sequences_apart(one_layer):
    """Two sequences in one batch, in one stream (the mask separates them) and in a stream each."""
    for unified in (True, False):
        kw = dict(n_ctx=1024, n_batch=512, n_seq_max=2, kv_unified=unified, export_scores=True, flash_attn=True,
                  n_threads=2)
        kernel, separate = Llama(one_layer, **kw), Llama(one_layer, _scores_sum_rows=True, **kw)
        tokens = kernel.tokenize(TEXT * 4)
        for batch in ({0: tokens[:100], 1: tokens[100:170]}, {0: tokens[170:171], 1: tokens[171:172]}):
            kernel.eval_batch(batch)
            separate.eval_batch(batch)
            for seq in (0, 1):
                (kp, ks), (sp, ss) = kernel.last_scores(seq), separate.last_scores(seq)
                np.testing.assert_array_equal(kp, sp)
                assert np.abs(ks - ss).max() <= 2e-3 * ss.max()
                np.testing.assert_allclose(ks.sum(axis=0), len(batch[seq]), rtol=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "h2o_norm"])
def test_scoring_policies_keep_what_they_keep_without_flash_attention(tiny_hd64, policy):
    kw = dict(policy=policy, budget=24, n_batch=32)
    plain, flash = Llama(tiny_hd64, **kw), Llama(tiny_hd64, flash_attn=True, **kw)
    tokens = plain.tokenize(TEXT * 2)
    plain.eval(tokens)
    flash.eval(tokens)
    assert flash.kv_state().n_cells == 24 and flash.kv_state().n_evicted == len(tokens) - 24
    same = np.intersect1d(flash.kv_state().positions, plain.kv_state().positions).size
    assert same >= 22, (flash.kv_state().positions, plain.kv_state().positions)


@pytest.mark.parametrize("policy", ["h2o", "tova+question", "keydiff", "local", "sink"])
def test_every_policy_evicts_rolls_and_snapshots_with_flash_attention_and_quantized_v(tiny_hd64, policy):
    name, _, probe = policy.partition("+")
    kw = dict(policy=name, budget=24, n_batch=32, flash_attn=True, type_k="q8_0", type_v="q8_0",
              position_rolling=True, roll_interval=1, n_gpu_layers=0)  # the CPU backend: a device refuses to roll quantized keys
    if probe:
        from h2o_local.policies import resolve
        kw["policy"] = resolve(name, 24, probe=probe, question=8)
        del kw["budget"]
    llm = Llama(tiny_hd64, **kw)
    llm.eval(llm.tokenize(TEXT))
    st = llm.kv_state()
    assert st.n_cells == 24 and st.n_evicted > 0 and st.positions.tolist() == list(range(24))
    copy = Llama(tiny_hd64, **kw)
    copy.load_state(llm.save_state())
    for t in llm.tokenize(" and on and on", add_bos=False):
        llm.eval([t])
        copy.eval([t])
        np.testing.assert_allclose(copy.last_logits(), llm.last_logits(), atol=1e-4)
        np.testing.assert_array_equal(copy.kv_state().positions, llm.kv_state().positions)


def test_quantized_v_takes_the_bytes_its_type_says(tiny_hd64):
    f16 = Llama(tiny_hd64, policy="h2o", budget=64, flash_attn=True)
    q8 = Llama(tiny_hd64, policy="h2o", budget=64, flash_attn=True, type_k="q8_0", type_v="q8_0")
    assert q8.stats()["kv_bytes"] == pytest.approx(f16.stats()["kv_bytes"] * 34 / 64, rel=1e-6)


def test_a_quantized_v_cache_without_flash_attention_is_refused(tiny_hd64):
    with pytest.raises(ValueError, match="needs flash attention, and flash_attn=False was asked for"):
        Llama(tiny_hd64, policy="h2o", budget=16, type_v="q8_0", flash_attn=False)
    assert Llama(tiny_hd64, policy="h2o", budget=16, type_v="q8_0").flash_attn  # "auto" turns it on for V
    llm = Llama(tiny_hd64, policy="keydiff", budget=16, flash_attn=True)
    with pytest.raises(ValueError, match="needs attention scores"):
        llm.set_policy("h2o", 16)  # keydiff exports no scores: h2o would rank by nothing
    llm.set_policy("local", 16)  # still usable
    assert llm.generate(llm.tokenize(TEXT)[:20], max_tokens=2) is not None
