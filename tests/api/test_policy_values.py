"""Policies as values: one registry in C++ and Python, validation and the budget split by the C++ rules."""
import pytest

from h2o_local import H2O, TOVA, Full, Llama, Local, SamplingParams, Sink, _engine, policies


def test_python_and_cpp_registries_name_the_same_policies():
    assert sorted(policies.REGISTRY) == _engine.policy_names() == [
        "full", "h2o", "h2o_headnorm", "h2o_maxhead", "h2o_norm", "keydiff", "local", "sink", "snapkv", "tova"]


@pytest.mark.parametrize("value,split,bounded,needs_scores", [
    (H2O(budget=128), (0, 64, 64), True, True),
    (H2O(budget=7), (0, 3, 4), True, True),
    (H2O(heavy=32, recent=96, sinks=4), (4, 32, 96), True, True),
    (H2O(budget=10, recent=3, sinks=2), (2, 5, 3), True, True),
    (Sink(budget=10), (4, 0, 6), True, False),
    (Sink(budget=10, sinks=2), (2, 0, 8), True, False),
    (Local(budget=16), (0, 0, 16), True, False),
    (Full(), (0, 0, 0), False, False),
])
def test_values_show_their_resolved_split(value, split, bounded, needs_scores):
    assert value.split == split and value.bounded is bounded and value.needs_scores is needs_scores
    if bounded:
        assert value.budget == sum(split)


def test_long_form_equals_short_form(tiny_model):
    assert H2O(heavy=64, recent=64) == H2O(budget=128) == policies.resolve("h2o", 128)
    assert policies.resolve("sink", 64) == Sink(64)
    assert policies.resolve(None) == Full()  # Llama(path) keeps everything
    for name in ("h2o", "tova", "sink"):  # a bounded policy without a budget would bound nothing: said, not done
        with pytest.raises(ValueError, match=f"policy '{name}' needs a budget"):
            policies.resolve(name)
    short = Llama(tiny_model, policy="sink", budget=12, n_batch=16)
    long = Llama(tiny_model, policy=Sink(budget=12), n_batch=16)
    assert short.policy == long.policy and (short.sinks, short.heavy, short.recent) == (4, 0, 8)
    for llm in (short, long):
        llm.eval(llm.tokenize("the same prompt for both forms of the same policy"))
    assert short.kv_state().positions.tolist() == long.kv_state().positions.tolist()


@pytest.mark.parametrize("make,error,match", [
    (lambda: H2O(budget=10, heavy=11), ValueError, "heavy"),
    (lambda: H2O(budget=10, heavy=5, recent=4), ValueError, "equal budget"),
    (lambda: H2O(), ValueError, "needs a budget"),
    (lambda: H2O(budget=3.7), TypeError, "budget must be an int"),
    (lambda: H2O(budget=True), TypeError, "budget must be an int"),
    (lambda: H2O(budget=10, heavy=-1), ValueError, "heavy must be >= 0"),
    (lambda: Sink(budget=10, sinks=10), ValueError, "newest token"),
    (lambda: Local(budget=0), ValueError, "budget"),
    (lambda: policies.resolve("fancy", 10), ValueError, "unknown policy"),
    (lambda: policies.resolve(H2O(budget=8), 16), ValueError, "inside the policy value"),
    (lambda: policies.resolve(42), TypeError, "policy must be"),
])
def test_bad_policies_are_refused_clearly(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_labels_round_trip():
    for label in ("full", "local-256", "sink-64", "h2o-128", "h2o-128+s4", "snapkv-256+w64", "tova-256+s4+r192",
                  "h2o-128+r100"):
        assert policies.parse(label).label == label
    assert policies.parse("tova-256+s4+r192") == TOVA(heavy=60, recent=192, sinks=4)
    assert TOVA(heavy=60, recent=192, sinks=4).label == "tova-256+s4+r192"
    assert TOVA(budget=256).label == "tova-256" and H2O(budget=128, recent=64).label == "h2o-128"
    with pytest.raises(ValueError, match="not a policy label"):
        policies.parse("h2o-lots")


def test_a_llama_takes_the_label_it_prints(tiny_model):
    llm = Llama(tiny_model, policy="tova-24+s4+r8", n_batch=32)
    assert llm.policy == TOVA(heavy=12, recent=8, sinks=4) and llm.policy.label == "tova-24+s4+r8"
    llm.set_policy("sink-12")
    assert llm.policy_of(0).label == "sink-12"
    with pytest.raises(ValueError, match="carries its budget"):
        Llama(tiny_model, policy="h2o-24", budget=48)
    with pytest.raises(ValueError, match="not a policy label"):
        Llama(tiny_model, policy="h2o-lots")


def test_a_llama_takes_a_policy_value_and_switches_to_another(tiny_model):
    llm = Llama(tiny_model, policy=H2O(heavy=4, recent=8), n_batch=32)
    assert llm.budget == 12 and isinstance(llm.policy, H2O)
    llm.eval(llm.tokenize("a prompt long enough to be cut down to the budget of twelve"))
    llm.set_policy(Local(budget=6))
    llm.compress()
    st = llm.kv_state()
    assert st.n_cells == 6 and st.positions.tolist() == list(range(st.n_seen - 6, st.n_seen))


def test_sampling_params_are_one_value_for_every_entry_point(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=24, n_batch=32)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    text = llm.generate("Once upon a time", sampling=params)
    assert text == llm.generate("Once upon a time", max_tokens=12, temperature=0.9, seed=5)
    out = llm.create_completion("Once upon a time", sampling=params)
    assert out["choices"][0]["text"] == text
    assert llm.generate_batch(["Once upon a time"], sampling=params) == [text]
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        llm.generate("x", temprature=0.5)
    assert SamplingParams(max_tokens=-1).max_tokens is None  # llama-cpp-python's -1: no limit
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=1.5)


def test_the_default_policy_is_the_suites_winner_and_h2o_stays_by_name(tiny_model):
    from h2o_local.policies import TOVA

    llm = Llama(tiny_model, budget=64)
    assert llm.policy == TOVA(budget=64, sinks=4, probe="question", pool=9, follow=12, recent=32, reply=True)
    assert llm.policy.label == "tova-64+s4+q32+p9+f12+r32+reply" and policies.parse(llm.policy.label) == llm.policy
    assert isinstance(Llama(tiny_model).policy, policies.Full)  # no budget: the full cache, as before
    assert Llama(tiny_model, policy="h2o", budget=64).policy == policies.H2O(budget=64)  # heavy 32, recent 32
    # fields given override the default's; small budgets keep a recent window of half the budget
    assert policies.resolve(None, 64, recent=8).recent == 8
    assert policies.resolve(None, 64, probe="catalyst").probe == "catalyst"
    assert policies.resolve(None, 64, sinks=0) == TOVA(budget=64, probe="question", pool=9, follow=12, recent=32,
                                                       reply=True)
    assert policies.resolve(None, 64, reply=False).reply is None  # an option of the default turned off
    assert policies.resolve(None, 64, per_head=True).reply is None  # no probe, so no last exchange to keep
    for budget in (1, 2, 3, 8, 40):
        sinks, recent = min(4, budget // 8), max(1, min(32, budget // 2))  # the default's split (C++'s to choose)
        assert policies.resolve(None, budget).split == (sinks, budget - sinks - recent, recent)
        small = Llama(tiny_model, budget=budget, n_batch=16)
        small.generate("a prompt longer than every one of these budgets", max_tokens=6, temperature=0)
        assert small.kv_state().n_cells <= budget


def test_every_option_row_gives_a_field_a_label_suffix_a_cli_flag_and_a_checked_range():
    """An option is one C++ field and one row (cpp/policy_config.cpp): its faces come from the row."""
    import argparse
    import dataclasses

    from h2o_local.cli.common import add_model_args
    from h2o_local.policies import OPTIONS, Scored

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    fields = {f.name for f in dataclasses.fields(Scored)}
    for o in OPTIONS:
        name = o["name"]
        value = True if o["flag"] else min(max(o["minimum"], 2), o["maximum"])
        assert name in fields, name
        flag = ["--" + name.replace("_", "-")] + ([] if o["flag"] else [str(value)])
        assert getattr(ap.parse_args(flag), name) == value
        policy = TOVA(budget=64, probe=None if name == "per_head" else "question", **{name: value})
        assert getattr(policy, name) == value
        suffix = o["suffix"] + ("" if o["flag"] else str(value))
        assert "+" + suffix in policy.label and policies.parse(policy.label) == policy
        assert policies.suffix_fields(suffix) == {name: value}
        assert getattr(policies.resolve("tova", 64), name) is None  # left out: shown as None, runs as `unset`
        if not o["flag"] and o["minimum"] > 0:
            with pytest.raises(ValueError, match=f"{name} must be >= {o['minimum']}"):
                TOVA(budget=64, probe="question", **{name: o["minimum"] - 1})
        with pytest.raises(ValueError, match=f"ranks nothing: it takes no {name}"):
            policies.resolve("sink", 64, **{name: value})
