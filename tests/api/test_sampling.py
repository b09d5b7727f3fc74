"""Penalties and logit bias: llama.cpp's samplers, checked against the formula in NumPy on the model's own logits."""
import numpy as np
import pytest

from h2o_local import Llama, SamplingParams


def penalized_argmax(logits: np.ndarray, history, last_n: int, repeat: float, freq: float, present: float,
                     bias=None) -> int:
    """llama.cpp's penalties (llama_sampler_init_penalties) and logit bias, then greedy."""
    out = logits.astype(np.float64).copy()
    for token, b in (bias or {}).items():
        out[token] += b
    recent = list(history)[-last_n:] if last_n else []
    for token in set(recent):
        count = recent.count(token)
        out[token] = out[token] * repeat if out[token] <= 0 else out[token] / repeat
        out[token] -= count * freq + present
    return int(np.argmax(out))


@pytest.mark.parametrize("repeat, freq, present, last_n", [(1.3, 0.0, 0.0, 64), (1.0, 0.7, 0.4, 64),
                                                          (1.5, 0.5, 0.5, 6)])
def test_penalties_equal_the_formula_step_by_step(tiny_model, repeat, freq, present, last_n):
    llm = Llama(tiny_model, n_batch=32)
    prompt = llm.tokenize("the the the cat sat on the mat")
    params = dict(max_tokens=16, temperature=0, repeat_penalty=repeat, frequency_penalty=freq,
                  presence_penalty=present, penalty_last_n=last_n)
    got = [e.token for e in llm.generate_events(prompt, **params) if e.token is not None]
    ref = Llama(tiny_model, n_batch=32)
    history, want = list(prompt), []
    ref.eval(prompt)
    for _ in range(len(got)):
        token = penalized_argmax(ref.last_logits(), history, last_n, repeat, freq, present)
        want.append(token)
        history.append(token)
        ref.eval([token])
    assert got == want
    plain = [e.token for e in llm.generate_events(prompt, max_tokens=16, temperature=0) if e.token is not None]
    assert plain != got  # the penalties changed something on this repetitive prompt


def test_logit_bias_pushes_and_bans_tokens(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=24, n_batch=32)
    prompt = llm.tokenize("Once upon a time")
    plain = [e.token for e in llm.generate_events(prompt, max_tokens=6, temperature=0) if e.token is not None]
    favourite = 7 if plain[0] != 7 else 8
    forced = [e.token for e in llm.generate_events(prompt, max_tokens=4, temperature=0.8, seed=1,
                                                   logit_bias={favourite: 100.0}) if e.token is not None]
    assert forced == [favourite] * 4
    banned = [e.token for e in llm.generate_events(prompt, max_tokens=6, temperature=0,
                                                   logit_bias={str(plain[0]): float("-inf")}) if e.token is not None]
    assert banned[0] != plain[0] and plain[0] not in banned


def test_bad_penalties_bias_and_stops_raise_and_leave_the_llama_usable(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=24, n_batch=32)
    before = llm.generate("abc", max_tokens=8, temperature=0)
    for kwargs, error in (({"repeat_penalty": 0}, ValueError), ({"frequency_penalty": float("nan")}, ValueError),
                          ({"penalty_last_n": -1}, ValueError), ({"logit_bias": {-1: 1.0}}, ValueError),
                          ({"logit_bias": {"x": 1.0}}, ValueError), ({"logit_bias": {3: "high"}}, ValueError),
                          ({"logit_bias": [1, 2]}, TypeError), ({"logit_bias": {10**6: 1.0}}, ValueError),
                          ({"stop": 5}, TypeError), ({"stop": ["a", 5]}, TypeError), ({"stop": {"a"}}, TypeError)):
        with pytest.raises(error):
            llm.generate("abc", max_tokens=8, temperature=0, **kwargs)
    assert llm.generate("abc", max_tokens=8, temperature=0) == before
    with pytest.raises(ValueError, match="model has"):
        llm.generate("abc", max_tokens=1, logit_bias={llm.n_vocab(): 1.0})
    assert SamplingParams(logit_bias={"12": 2}).logit_bias == {12: 2.0}


def typical_token(logits: np.ndarray) -> int:
    """Locally typical sampling's first candidate (llama_sampler_init_typical): the token whose surprise, -log p, is
    closest to the distribution's entropy; with a tiny typical_p it is the only one kept."""
    x = logits.astype(np.float64)
    logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    entropy = -(np.exp(logp) * logp).sum()
    return int(np.argmin(np.abs(-logp - entropy)))


def draws(llm, prompt, seeds, **params):
    return [[e.token for e in llm.generate_events(prompt, max_tokens=12, seed=s, **params) if e.token is not None]
            for s in seeds]


def test_typical_p_keeps_the_tokens_whose_surprise_is_closest_to_the_entropy(tiny_model):
    """With a tiny typical_p only the most typical token is left, whatever the seed: the one the formula picks from
    the model's own logits at every step (the other cuts off, so that typical_p sees the whole vocabulary)."""
    llm = Llama(tiny_model, n_batch=32)
    prompt = llm.tokenize("Once upon a time")
    params = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1e-6)
    got = draws(llm, prompt, (1, 2, 3), **params)
    assert got[0] == got[1] == got[2]
    ref = Llama(tiny_model, n_batch=32)
    ref.eval(prompt)
    want = []
    for _ in range(len(got[0])):
        want.append(typical_token(ref.last_logits()))
        ref.eval([want[-1]])
    assert got[0] == want
    greedy = draws(llm, prompt, (1,), temperature=0)[0]
    assert want != greedy  # the most typical token is not the most likely one here: the check can tell them apart
    # typical_p=1 is off: the same draws as without it
    assert draws(llm, prompt, (5,), temperature=1.0, typical_p=1.0) == draws(llm, prompt, (5,), temperature=1.0)


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_steers_the_surprise(tiny_model, mode):
    """Mirostat with a target surprise near 0 keeps only the most likely token (version 2 truncates at a surprise
    of 2 tau; version 1 estimates a top-k from the surprise): greedy text whatever the seed. With a large target
    version 2 draws freely, so the seed matters, and the same seed draws the same. (Version 1 assumes Zipf-like
    probabilities; this random model's are nearly flat, so its estimated top-k stays 1: greedy at any target here.
    On SmolLM2 it draws seed-dependent text at tau 5.)"""
    llm = Llama(tiny_model, n_batch=32)
    prompt = llm.tokenize("Once upon a time")
    greedy = draws(llm, prompt, (1,), temperature=0)[0]
    assert draws(llm, prompt, (1, 2, 3), temperature=1.0, mirostat_mode=mode, mirostat_tau=1e-4) == [greedy] * 3
    if mode == 2:
        free = draws(llm, prompt, (1, 1, 2, 3), temperature=1.0, mirostat_mode=mode, mirostat_tau=30.0)
        assert free[0] == free[1] and len({tuple(x) for x in free}) > 1
        assert free[0] != draws(llm, prompt, (1,), temperature=1.0)[0]  # its own draw, not the default chain's


@pytest.mark.parametrize("kwargs, error", [({"typical_p": 0}, ValueError), ({"typical_p": 1.5}, ValueError),
                                           ({"mirostat_mode": 3}, ValueError), ({"mirostat_mode": True}, TypeError),
                                           ({"mirostat_tau": 0}, ValueError), ({"mirostat_eta": float("inf")}, ValueError)])
def test_bad_typical_and_mirostat_values_raise(tiny_model, kwargs, error):
    llm = Llama(tiny_model, policy="h2o", budget=24, n_batch=32)
    with pytest.raises(error):
        llm.generate("abc", max_tokens=2, **kwargs)
    assert llm.generate("abc", max_tokens=2, temperature=0)
