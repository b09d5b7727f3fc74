"""Batched generation: several sequences decoded together, each with its own budget, scores and sampler."""
import pytest

from h2o_local import Llama

PROMPTS = ["Once upon a time", "The weather today is", "In the beginning there was", "Numbers: 1 2 3"]


def test_batch_equals_one_by_one_greedy(tiny_model):
    batched = Llama(tiny_model, budget=16, n_seq_max=4, n_batch=64)
    single = Llama(tiny_model, budget=16, n_batch=64)
    texts = batched.generate_batch(PROMPTS, max_tokens=24, temperature=0)
    assert texts == [single.generate(p, max_tokens=24, temperature=0) for p in PROMPTS]


def test_batch_sampling_follows_the_per_sequence_seeds(tiny_model):
    batched = Llama(tiny_model, budget=16, n_seq_max=2, n_batch=64)
    single = Llama(tiny_model, budget=16, n_batch=64)
    texts = batched.generate_batch(PROMPTS, max_tokens=20, temperature=0.9, seed=7)  # two waves of two
    assert texts == [single.generate(p, max_tokens=20, temperature=0.9, seed=7 + i) for i, p in enumerate(PROMPTS)]


def test_batch_stream_and_finish(tiny_model):
    llm = Llama(tiny_model, budget=16, n_seq_max=4, n_batch=64)
    pieces = {i: "" for i in range(len(PROMPTS))}
    ended = []
    for i, piece in llm.generate_batch(PROMPTS, max_tokens=10, temperature=0, stream=True):
        if piece is None:
            ended.append(i)
        else:
            pieces[i] += piece
    assert sorted(ended) == list(range(len(PROMPTS)))
    assert list(pieces.values()) == llm.generate_batch(PROMPTS, max_tokens=10, temperature=0)
    assert all(r in ("stop", "length") for r in llm.finish_reasons)


def test_batch_bounded_memory(tiny_model):
    llm = Llama(tiny_model, budget=16, n_seq_max=4, n_batch=32)
    llm.generate_batch(["x" * 200] * 4, max_tokens=30, temperature=0)
    assert llm.n_ctx() == 256  # 4 x 16 + 32 cells, rounded up by llama.cpp


def test_batch_rejects_empty_prompts(tiny_model):
    llm = Llama(tiny_model, budget=16, n_seq_max=2)
    with pytest.raises(ValueError, match="empty"):
        llm.generate_batch(["ok", []])
