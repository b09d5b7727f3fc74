"""A decode step under eviction reuses llama.cpp's compute graph, as the full cache's steps do: eviction changes
which cells hold what, not the graph's shape, so the graph is not built again at every token, and a CUDA build can
replay it (CUDA graphs) instead of launching it op by op (issue 51: decode at the roofline). Rolling positions
with `roll_interval=1` shifts the keys at every step, a graph of its own each time: half the decode speed on the CPU
(SmolLM2, h2o-64: 64 against 126 tok/s), the price docs/semantics.md gives for it."""
import pytest

import h2o_local
from h2o_local import Llama

PROMPT = [3 + (7 * i) % 250 for i in range(70)]


@pytest.mark.parametrize("kw", [dict(policy="full"), dict(policy="h2o", budget=32), dict(budget=32),
                                dict(policy="local", budget=32), dict(policy="h2o-32+ph"),
                                dict(policy="h2o", budget=32, flash_attn=True),
                                dict(policy="h2o", budget=32, position_rolling=True, roll_interval=64)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_decode_step_after_the_first_reuses_the_graph(tiny_model, kw):
    if kw.get("flash_attn") and any(d.name.startswith("Vulkan") for d in h2o_local.devices()):
        pytest.skip("optional: llama.cpp's flash-attention shader crashes Mesa's lavapipe at random (docs/gpu.md)")
    llm = Llama(tiny_model, n_ctx=256, **kw)
    llm.eval(PROMPT)
    before = llm.stats()
    tokens = [t for t in (ev.token for ev in llm.generate_events([], reset=False, max_tokens=40, temperature=0,
                                                                   ignore_eos=True)) if t is not None]
    assert len(tokens) == 40
    after = llm.stats()
    steps = after["decodes"] - before["decodes"]
    # the first step after the prompt builds it; a K shift (rolling) runs a graph of its own, once per roll_interval
    rebuilt = 1 + (2 if llm.position_rolling else 0)
    assert steps >= 39 and after["graphs_reused"] - before["graphs_reused"] >= steps - rebuilt
    if llm.budget is not None:
        assert llm.kv_state().n_evicted > 0
