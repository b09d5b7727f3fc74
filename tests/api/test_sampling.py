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


def test_bad_penalties_and_bias_raise_and_leave_the_llama_usable(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=24, n_batch=32)
    before = llm.generate("abc", max_tokens=8, temperature=0)
    for kwargs, error in (({"repeat_penalty": 0}, ValueError), ({"frequency_penalty": float("nan")}, ValueError),
                          ({"penalty_last_n": -1}, ValueError), ({"logit_bias": {-1: 1.0}}, ValueError),
                          ({"logit_bias": {"x": 1.0}}, ValueError), ({"logit_bias": {3: "high"}}, ValueError),
                          ({"logit_bias": [1, 2]}, TypeError), ({"logit_bias": {10**6: 1.0}}, ValueError)):
        with pytest.raises(error):
            llm.generate("abc", max_tokens=8, temperature=0, **kwargs)
    assert llm.generate("abc", max_tokens=8, temperature=0) == before
    with pytest.raises(ValueError, match="model has"):
        llm.generate("abc", max_tokens=1, logit_bias={llm.n_vocab(): 1.0})
    assert SamplingParams(logit_bias={"12": 2}).logit_bias == {12: 2.0}
