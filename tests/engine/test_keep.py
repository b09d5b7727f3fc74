"""A protected prefix (`keep`): the first tokens, or a chat's system message, are never evicted, inside the budget."""
import pytest

from h2o_local import Llama
from h2o_reference import H2OReference

TEXT = "Heavy hitters are the few tokens that receive most of the attention in a long sequence of text."
MORE = "Completely different words: quartz, zephyr, jigsaw, vortex, 1234567890, and a final question?"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("budget,heavy,sinks,keep", [(16, None, None, 5), (16, None, 2, 1), (16, None, 2, 12),
                                                    (12, 2, None, 6), (10, None, None, 9)])
def test_h2o_with_a_protected_prefix_keeps_what_the_reference_keeps(tiny_model, budget, heavy, sinks, keep):
    llm = Llama(tiny_model, policy="h2o", budget=budget, heavy=heavy, sinks=sinks, keep=keep, n_batch=256)
    ref = H2OReference(heavy=llm.heavy, recent=llm.recent, sinks=llm.sinks, keep=keep)
    llm.eval(llm.tokenize(TEXT))
    assert llm.kv_state().positions.tolist() == ref.step(*llm.last_scores())
    for t in llm.tokenize(MORE, add_bos=False) * 2:
        llm.eval([t])
        kept = llm.kv_state().positions.tolist()
        assert kept == ref.step(*llm.last_scores())
        assert kept[:keep] == list(range(keep)) and len(kept) == budget  # the prefix, inside the budget


@pytest.mark.parametrize("policy", ["local", "sink", "tova", "snapkv", "h2o_norm"])
def test_every_policy_keeps_the_prefix_within_its_budget(tiny_model, policy):
    llm = Llama(tiny_model, policy=policy, budget=12, keep=7, n_batch=256)
    llm.eval(llm.tokenize(TEXT + MORE))
    for t in llm.tokenize(MORE, add_bos=False):
        llm.eval([t])
        st = llm.kv_state()
        assert st.positions[:7].tolist() == list(range(7)) and st.n_cells == 12
        assert st.positions[-1] == st.n_seen - 1  # the newest token too


def test_keep_survives_the_bounded_prefill_and_generation(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, keep=6, n_batch=8)  # prompts are fed 8 tokens at a time, evicting as they go
    llm.generate(TEXT, max_tokens=20, temperature=0, ignore_eos=True)
    st = llm.kv_state()
    assert st.positions[:6].tolist() == list(range(6)) and st.n_evicted > 0 and st.n_cells == 16


def test_keep_with_position_rolling_keeps_the_prefix_at_the_bottom(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=12, keep=4, position_rolling=True, roll_interval=1, n_batch=256)
    llm.generate(TEXT, max_tokens=150, temperature=0, ignore_eos=True)  # past the trained context of 128
    st = llm.kv_state()
    assert st.positions.tolist() == list(range(12)) and st.n_seen > 128


def test_a_prefix_that_leaves_no_room_is_refused(tiny_model):
    for keep in (16, 17):
        with pytest.raises(ValueError, match="protected prefix"):
            Llama(tiny_model, policy="h2o", budget=16, keep=keep)
    with pytest.raises(ValueError):
        Llama(tiny_model, policy="h2o", budget=16, keep=-1)
    with pytest.raises(TypeError):
        Llama(tiny_model, policy="h2o", budget=16, keep=2.5)
    llm = Llama(tiny_model, policy="h2o", budget=16, keep=10, export_scores=True)
    with pytest.raises(ValueError, match="protected prefix"):
        llm.set_policy("h2o", 8)  # the prefix would not fit the new budget: refused, the old policy stays
    assert llm.budget == 16


def test_the_full_cache_accepts_keep_and_never_evicts(tiny_model):
    llm = Llama(tiny_model, keep=4)
    llm.generate(TEXT, max_tokens=8, temperature=0)
    assert llm.kv_state().n_evicted == 0


def test_keep_system_protects_the_system_message(tmp_path, caplog):
    from tiny_model import write_tiny_llama

    model = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=CHATML, n_ctx_train=1024))
    llm = Llama(model, policy="h2o", budget=120, keep="system", n_batch=256)
    system = "You are a lighthouse keeper."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": MORE}]
    tokens, n_keep = llm.chat_tokens(messages)
    system_tokens = llm.tokenize(f"<|im_start|>system\n{system}<|im_end|>\n", special=True)
    assert n_keep == len(system_tokens) and tokens[:n_keep] == system_tokens
    llm.create_chat_completion(messages, max_tokens=30, temperature=0)
    st = llm.kv_state()
    assert st.n_evicted > 0 and st.positions[:n_keep].tolist() == list(range(n_keep)) and st.n_cells <= 120
    # a chat without a system message protects nothing; one longer than half the budget has its first half of
    # the budget protected, the rest ranked by the policy, with a warning in the log
    assert llm.chat_tokens(messages[1:])[1] == 0
    long_chat = [{"role": "system", "content": MORE}, {"role": "user", "content": "hi"}]
    assert llm.chat_tokens(long_chat)[1] > 120
    with caplog.at_level("WARNING", logger="h2o_local"):
        llm.create_chat_completion(long_chat, max_tokens=3, temperature=0)
    assert llm.max_system_keep == 60 and llm.kv_state().n_keep == 60 and llm.kv_state().n_cells <= 120
    assert any("protects its first 60" in r.getMessage() for r in caplog.records)
    assert llm.create_chat_completion(messages, max_tokens=4)["choices"][0]["finish_reason"] == "length"


def test_a_snapshot_carries_its_prefix(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, keep=5, n_batch=256, export_scores=True)
    llm.eval(llm.tokenize(TEXT))
    snap = llm.save_state()
    llm.reset()
    assert llm.kv_state().n_keep == 0  # a reset sequence starts again with the Llama's keep... once it is used
    llm.load_state(snap)
    assert llm.kv_state().n_keep == 5
    small = Llama(tiny_model, policy="h2o", budget=4, n_batch=256)
    with pytest.raises(ValueError):
        small.load_state(snap)  # its prefix of 5 does not fit a budget of 4
