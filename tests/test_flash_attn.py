"""Flash attention: every policy runs with it. Flash attention forms no softmax, so the patch computes KQ and its
softmax beside the flash kernel (no V product) for the score export; its sums equal the non-flash export's to
rounding. A quantized V cache (which llama.cpp allows only with flash attention) works with every policy."""
import numpy as np
import pytest

from h2o_local import Llama
from tiny_model import write_tiny_llama

TEXT = ("Flash attention forms no softmax, so the scores come from a pass of their own beside it, and every policy "
        "runs with it, the heavy hitters included. ")


@pytest.fixture(scope="module")
def tiny_hd64(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("fa") / "tiny-hd64.gguf", n_embd=256))


def test_the_full_cache_with_flash_attention_computes_the_same_logits_to_rounding(tiny_hd64):
    """Flash attention (its F16 products on the CPU) moves the logits less than storing the cache in F16 does
    (measured 0.22 against 0.39 on a scale of 15)."""
    tokens = Llama(tiny_hd64, n_ctx=256).tokenize(TEXT)[:100]
    exact = Llama(tiny_hd64, n_ctx=256, kv_f32=True).eval(tokens, logits_all=True)
    flash = Llama(tiny_hd64, n_ctx=256, kv_f32=True, flash_attn=True).eval(tokens, logits_all=True)
    f16 = Llama(tiny_hd64, n_ctx=256).eval(tokens, logits_all=True)
    assert np.abs(flash - exact).max() <= np.abs(f16 - exact).max()
    assert (flash.argmax(1) == exact.argmax(1)).mean() >= 0.95


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("fa1") / "tiny-1layer.gguf", n_embd=256, n_layer=1))


@pytest.mark.parametrize("kv_f32", [True, False])
def test_scores_with_flash_attention_equal_the_non_flash_export(one_layer, kv_f32):
    """One layer, so that both paths score the same queries and keys: the same sums per position and head, for a
    prompt and then for single tokens. (With more layers the queries of the later ones differ by flash attention's
    rounding of the earlier ones' outputs; the policies' choices are compared below.)"""
    kw = dict(n_ctx=256, kv_f32=kv_f32, export_scores=True)
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
              position_rolling=True)
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
    assert q8._engine.kv_bytes == pytest.approx(f16._engine.kv_bytes * 34 / 64, rel=1e-6)


def test_a_quantized_v_cache_without_flash_attention_is_refused(tiny_hd64):
    with pytest.raises(ValueError, match="needs flash_attn=True"):
        Llama(tiny_hd64, policy="h2o", budget=16, type_v="q8_0")
    llm = Llama(tiny_hd64, policy="keydiff", budget=16, flash_attn=True)
    with pytest.raises(ValueError, match="needs attention scores"):
        llm.set_policy("h2o", 16)  # keydiff exports no scores: h2o would rank by nothing
    llm.set_policy("local", 16)  # still usable
    assert llm.generate(llm.tokenize(TEXT)[:20], max_tokens=2) is not None
