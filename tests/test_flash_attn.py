"""Flash attention: for the policies that need no attention scores (keydiff, local, sink, full), with quantized V
(which llama.cpp allows only with flash attention); refused, with the reason, for the scoring policies."""
import numpy as np
import pytest

from h2o_local import Llama
from tiny_model import write_tiny_llama

TEXT = "Flash attention forms no softmax, so only key-based and positional policies run with it. "


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


@pytest.mark.parametrize("policy", ["keydiff", "local", "sink"])
def test_policies_without_scores_evict_roll_and_snapshot_with_flash_attention(tiny_hd64, policy):
    kw = dict(policy=policy, budget=24, n_batch=32, flash_attn=True, type_k="q8_0", type_v="q8_0",
              position_rolling=True)
    llm = Llama(tiny_hd64, **kw)
    llm.eval(llm.tokenize(TEXT))
    st = llm.kv_state()
    assert st.n_cells == 24 and st.n_evicted > 0 and st.positions.tolist() == list(range(24))
    copy = Llama(tiny_hd64, **kw)
    copy.load_state(llm.save_state())
    for t in llm.tokenize(" and on", add_bos=False):
        llm.eval([t])
        copy.eval([t])
        np.testing.assert_allclose(copy.last_logits(), llm.last_logits(), atol=1e-4)


def test_quantized_v_takes_the_bytes_its_type_says(tiny_hd64):
    f16 = Llama(tiny_hd64, policy="local", budget=64, flash_attn=True)
    q8 = Llama(tiny_hd64, policy="local", budget=64, flash_attn=True, type_k="q8_0", type_v="q8_0")
    assert q8._engine.kv_bytes == pytest.approx(f16._engine.kv_bytes * 34 / 64, rel=1e-6)


def test_what_flash_attention_cannot_do_is_refused(tiny_hd64):
    with pytest.raises(ValueError, match="no attention scores"):
        Llama(tiny_hd64, policy="h2o", budget=16, flash_attn=True)                       # h2o reads the softmax
    with pytest.raises(ValueError, match="export_scores"):
        Llama(tiny_hd64, policy="local", budget=16, flash_attn=True, export_scores=True)
    with pytest.raises(ValueError, match="needs flash_attn=True"):
        Llama(tiny_hd64, policy="local", budget=16, type_v="q8_0")
    llm = Llama(tiny_hd64, policy="keydiff", budget=16, flash_attn=True)
    with pytest.raises(ValueError, match="flash attention"):
        llm.set_policy("h2o", 16)
    llm.set_policy("local", 16)  # still usable
    assert llm.generate(llm.tokenize(TEXT)[:20], max_tokens=2) is not None
