"""Bad input gets a clear Python exception and leaves the object usable; never a crash."""

import warnings

import pytest

from h2o_local import Llama, policies


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Llama(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("content", [b"", b"not a gguf at all" * 100, b"GGUF" + b"\xff" * 64])
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        Llama(str(path))


def test_truncated_gguf(tmp_path, tiny_model):
    data = open(tiny_model, "rb").read()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.gguf"):
        Llama(str(path))


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0), "budget"),
    (dict(budget=-5), "budget"),
    (dict(budget=10, heavy=11), "heavy"),
    (dict(budget=10, recent=11), "recent"),
    (dict(budget=10, sinks=4, recent=8), "sinks \\+ recent"),
    (dict(budget=10, heavy=5, recent=4), "equal budget"),
    (dict(budget=10, heavy=10), "recent"),
    (dict(budget=10, policy="sink", sinks=10), "newest token"),
    (dict(budget=10, policy="local", heavy=3), "local"),
    (dict(budget=10, policy="fancy"), "unknown policy"),
    (dict(policy="local"), "needs a budget"),
    (dict(budget=64, n_ctx=32), "n_ctx"),
])
def test_impossible_budget(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Llama(tiny_model, **kwargs)


def test_full_policy_prompt_larger_than_context_then_usable(tiny_model):
    llm = Llama(tiny_model, n_ctx=256)
    assert llm.n_ctx() == 256
    with pytest.raises(ValueError, match="cannot feed 259 tokens"):
        llm.generate(list(range(3, 259)) + [5, 6, 7], max_tokens=4)
    assert llm.kv_state().n_cells == 0  # nothing was fed, no silent truncation
    assert isinstance(llm.generate("Hello", max_tokens=4, temperature=0), str)


def test_full_policy_stops_at_the_end_of_the_context(tiny_model):
    llm = Llama(tiny_model, n_ctx=256)
    out = llm.create_completion(list(range(3, 243)), max_tokens=100, temperature=0)
    choice = out["choices"][0]
    if choice["finish_reason"] == "length":
        # every cell holds a token; the last sampled token needs none
        assert out["usage"]["total_tokens"] == 256 + 1
    assert llm.kv_state().n_cells <= 256


def test_a_bounded_cache_without_max_tokens_stops_after_the_trained_context(tiny_model_128):
    """A bounded cache never fills up: with no max_tokens and a model that never ends, generation stops after the
    model's trained context (128 tokens for the tiny model) instead of running for good."""
    import warnings

    llm = Llama(tiny_model_128, policy="h2o", budget=16)
    never_end = {t: -100.0 for t in llm.eog_tokens()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # positions pass the trained context on the way
        out = llm.create_completion("Hi", max_tokens=None, temperature=0, logit_bias=never_end)
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 128
        asked = llm.create_completion("Hi", max_tokens=200, logit_bias=never_end)  # a limit asked for is the limit
        assert asked["usage"]["completion_tokens"] == 200


def test_a_context_larger_than_the_machine_is_refused_before_it_is_allocated(tiny_model):
    """n_batch=2**30 once got the process killed by the system (parts of the context were allocated and touched);
    now the KV cells and logits it would need are compared with the machine's memory first."""
    with pytest.raises(ValueError, match="more than this machine's"):
        Llama(tiny_model, policy="h2o", budget=64, n_batch=2**30)
    with pytest.raises(ValueError, match="more than this machine's"):
        Llama(tiny_model, n_ctx=2**31 - 1)


def test_bad_token_ids_then_usable(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16)
    with pytest.raises(ValueError, match="token id"):
        llm.eval([5, 99999])
    with pytest.raises(ValueError, match="token id"):
        llm.eval([-1])
    llm.eval([5, 6, 7])
    assert llm.kv_state().positions.tolist() == [0, 1, 2]


def test_bad_sequence_id(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2)
    with pytest.raises(ValueError, match="seq_id"):
        llm.eval([5], seq_id=2)


def test_position_rolling_on_a_model_that_cannot_shift(tmp_path):
    """M-RoPE models (Qwen2-VL) cannot shift their KV positions: rolling is refused up front."""
    from tiny_model import write_tiny_qwen2vl

    path = write_tiny_qwen2vl(tmp_path / "tiny-qwen2vl.gguf")
    Llama(str(path), policy="h2o", budget=16)  # loads, and evicts without rolling
    with pytest.raises(ValueError, match="position_rolling"):
        Llama(str(path), policy="h2o", budget=16, position_rolling=True, roll_interval=1)


def test_empty_prompt_and_negative_max_tokens(tiny_model):
    """A negative max_tokens is llama-cpp-python's "no limit": generation runs to its end (here: ignore_eos needs a
    limit, so it is refused; without it, the model's end or the trained context)."""
    llm = Llama(tiny_model, policy="h2o", budget=16)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], max_tokens=3)
    with pytest.raises(ValueError, match="ignore_eos=True needs max_tokens"):
        llm.generate("Hi", max_tokens=-1, ignore_eos=True)
    unlimited = llm.create_completion("Hi", max_tokens=-1, temperature=0)
    assert unlimited == llm.create_completion("Hi", max_tokens=None, temperature=0) | {
        k: unlimited[k] for k in ("id", "created")}
    assert isinstance(llm.generate("Hi", max_tokens=2), str)


def test_chat_without_a_template(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16)
    with pytest.raises(ValueError, match="chat template"):
        llm.create_chat_completion([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(budget=3.7), TypeError, "budget must be an int"),
    (dict(budget=16, heavy=3.7), TypeError, "heavy must be an int"),
    (dict(budget=16, heavy=-2), ValueError, "heavy must be >= 0"),
    (dict(budget=16, policy="sink", sinks=-1), ValueError, "sinks must be >= 0"),
    (dict(budget=16, kv_unified="no"), TypeError, "kv_unified must be True or False"),
    (dict(budget=16, n_batch="64"), TypeError, "n_batch must be an int"),
])
def test_wrong_types_and_negative_splits_are_refused(tiny_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        Llama(tiny_model, **kwargs)


def test_sequence_ids_are_checked_everywhere(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2)
    for call in (lambda: llm.kv_state(2), lambda: llm.save_state(2), lambda: llm.last_logits(5),
                 lambda: llm.reset(-1), lambda: llm.compress(2)):
        with pytest.raises(ValueError, match="seq_id"):
            call()
    llm.eval([5, 6], seq_id=1)
    assert llm.kv_state(1).n_cells == 2


def test_batch_edge_cases(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2)
    with pytest.raises(TypeError, match="list of prompts"):
        llm.generate_batch("one string")
    assert llm.generate_batch(["abc", "def"], max_tokens=0) == ["", ""]  # no token at all, as generate does
    assert llm.finish_reasons == ["length", "length"]
    assert llm.generate("abc", max_tokens=0) == ""


def test_a_bad_gguf_keeps_llama_cpps_reason(tmp_path):
    import gguf
    import numpy as np

    from h2o_local import ModelInfo

    path = tmp_path / "no-tokenizer.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for load in (Llama, ModelInfo.load):
        with pytest.raises(ValueError, match="key not found in model: tokenizer.ggml.model"):
            load(str(path))


@pytest.mark.parametrize("call,error,match", [
    (lambda llm: llm.generate(123), TypeError, "expected a prompt"),
    (lambda llm: llm.eval_batch([1, 2]), TypeError, "eval_batch takes"),
    (lambda llm: llm.eval(["a"]), TypeError, "token ids must be ints"),
    (lambda llm: llm.tokenize(5), TypeError, "text must be str or bytes"),
    (lambda llm: llm.kv_state("0"), TypeError, "seq_id must be an int"),
    (lambda llm: llm.set_policy(3.5), TypeError, "policy must be"),
    (lambda llm: llm.generate("x", temperature="hot"), TypeError, "temperature must be a number"),
])
def test_wrong_types_give_one_line_errors(tiny_model, call, error, match):
    llm = Llama(tiny_model, policy="h2o", budget=16)
    with pytest.raises(error, match=match):
        call(llm)
    assert isinstance(llm.generate("still usable", max_tokens=2), str)


@pytest.mark.parametrize("call", [
    lambda llm: Llama(llm.model_path, policy="h2o", budget=2**31),
    lambda llm: Llama(llm.model_path, policy="h2o", budget=64, heavy=2**40, recent=0),
    lambda llm: Llama(llm.model_path, policy=policies.SnapKV(budget=64, query_window=2**35)),
    lambda llm: Llama(llm.model_path, n_batch=2**32),
    lambda llm: llm.set_policy("h2o", 2**31),
    lambda llm: llm.eval([1, 2**40]),
    lambda llm: llm.generate([2**31], max_tokens=1),
    lambda llm: llm.kv_state(seq_id=2**40),
    lambda llm: llm.generate("x", max_tokens=2**40),
    lambda llm: llm.tokenize("caf\udce9"),
    lambda llm: llm.token_to_piece(2**40),
    lambda llm: llm.is_eog(2**33),
    lambda llm: llm.detokenize([1, 2**35]),
    lambda llm: llm.generate("a lone \ud800 surrogate", max_tokens=1),
])
def test_values_beyond_the_cpp_seam_are_one_line_errors_not_signature_dumps(tiny_model, call):
    llm = Llama(tiny_model, policy="h2o", budget=32)
    with pytest.raises((ValueError, TypeError)) as e:
        call(llm)
    assert "incompatible function arguments" not in str(e.value) and "\n" not in str(e.value)
    assert llm.generate("still usable", max_tokens=2, temperature=0) is not None


@pytest.mark.parametrize("label", ["h2o-²", "h2o-٣", "h2o-64+s²", "h2o-99999999999", "sink-1e3", "h2o-64+w"])
def test_labels_take_ascii_digits_within_range(label):
    from h2o_local.policies import parse

    with pytest.raises(ValueError, match="not a policy label"):
        parse(label)


def test_a_recurrent_model_refuses_a_budget_and_reads_with_the_full_cache(tmp_path):
    """A recurrent state (Mamba, RWKV, hybrids) holds every token it read: a policy that evicts is a ValueError at once
    (it used to report evictions that never happened), on creation and on set_policy, and the full cache works."""
    from support.tiny_model import write_tiny_mamba

    path = str(write_tiny_mamba(tmp_path / "mamba.gguf"))
    for kwargs in ({"budget": 64}, {"policy": "local", "budget": 64}, {"policy": "h2o", "budget": 1000}):
        with pytest.raises(ValueError, match="recurrent state"):
            Llama(path, **kwargs)
    llm = Llama(path, n_ctx=512)
    prompt = [3 + i % 250 for i in range(200)]
    llm.eval(prompt)
    with pytest.raises(ValueError, match="recurrent state"):
        llm.set_policy("local", 64)
    assert llm.kv_state().n_seen == 200 and llm.kv_state().n_evicted == 0
    assert len(llm.generate([], max_tokens=4, temperature=0, reset=False, ignore_eos=True)) > 0


def test_a_bounded_policy_named_without_a_budget_is_refused_not_made_the_full_cache(tiny_model):
    for name in ("h2o", "tova", "sink"):
        with pytest.raises(ValueError, match=f"policy '{name}' needs a budget >= 1 .*none given"):
            Llama(tiny_model, policy=name, n_threads=1)
    assert Llama(tiny_model, n_threads=1).budget is None  # no policy at all: the full cache, as llama-cpp-python


def test_a_cache_larger_than_the_trained_context_warns_with_what_it_allocates(tiny_model_128):
    with pytest.warns(RuntimeWarning, match=r"budget=200 is larger than the model's trained context \(128 tokens\)"
                                             r".* allocates \d+ MiB"):
        Llama(tiny_model_128, budget=200, n_threads=1)
    with pytest.warns(RuntimeWarning, match=r"n_ctx=512 is larger than the model's trained context"):
        Llama(tiny_model_128, n_ctx=512, n_threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Llama(tiny_model_128, budget=100, n_threads=1)  # within it: nothing to say
        Llama(tiny_model_128, n_ctx=128, n_threads=1)


def test_gpu_layers_asked_of_a_build_without_a_gpu_warn_once(tiny_model, monkeypatch):
    from h2o_local import gpu_offload_supported

    monkeypatch.setattr("h2o_local.llama._WARNED", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Llama(tiny_model, n_gpu_layers=-1, n_threads=1)  # the default, "all": nothing to say on any build
        Llama(tiny_model, n_gpu_layers=8, n_threads=1)
        Llama(tiny_model, n_gpu_layers=8, n_threads=1)
    said = [str(w.message) for w in seen if "no GPU backend" in str(w.message)]
    if gpu_offload_supported():
        assert said == []
    else:
        assert len(said) == 1 and "n_gpu_layers=8: this build has no GPU backend" in said[0]
