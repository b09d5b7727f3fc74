"""`Llama.embed` / `create_embedding` (llama-cpp-python's): the model's last hidden states, pooled, from a context of
their own, so a generation's bounded cache is untouched (docs/embeddings.md)."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from device_tolerance import approximate, assert_logits_close, assert_values_close
from h2o_local import Llama
from h2o_local.embeddings import context_size

TEXT = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def llm(tiny_model_128):
    return Llama(tiny_model_128, budget=24, n_batch=32, n_threads=1)


def output_matrix(path: str) -> np.ndarray:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    return np.asarray(tensor.data, dtype=np.float64)  # [n_vocab, n_embd] (F32 in the tiny model)


def test_a_text_s_embedding_is_its_last_hidden_state_that_the_output_layer_turns_into_the_generation_s_logits(
        tiny_model):
    """Read another way: with pooling 'last', the vector times the GGUF's output matrix is the logits a full-cache
    generation reads after the same prompt; with pooling 'none' each row is that token's (on a device, at its
    tolerance: it multiplies in its own precision)."""
    full = Llama(tiny_model, policy="full", n_threads=1, pooling_type=0)
    tokens = full.tokenize(TEXT * 2)[:20]
    rows = np.asarray(full.embed(tokens), dtype=np.float64)
    assert rows.shape == (len(tokens), full.n_embd())
    full.eval(tokens)
    logits = full.last_logits()
    assert_logits_close(output_matrix(tiny_model) @ rows[-1], logits, device=approximate(full), cpu_atol=1e-4,
                        cpu_rtol=1e-4)
    last = Llama(tiny_model, policy="full", n_threads=1, pooling_type=3)
    assert_values_close(np.asarray(last.embed(tokens)), rows[-1], device=approximate(last), cpu_rtol=1e-5,
                        cpu_atol=1e-6)


def test_mean_cls_and_last_pooling_are_the_mean_first_and_last_of_the_per_token_rows(tiny_model):
    none = Llama(tiny_model, n_threads=1, pooling_type=0)
    tokens = none.tokenize(TEXT)[:24]
    rows = np.asarray(none.embed(tokens))
    for pooling, expected in ((1, rows.mean(axis=0)), (2, rows[0]), (3, rows[-1])):
        got = np.asarray(Llama(tiny_model, n_threads=1, pooling_type=pooling).embed(tokens))
        assert_values_close(got, expected, device=approximate(none), cpu_rtol=1e-5, cpu_atol=1e-6)


def test_the_default_pooling_is_the_mean_for_a_model_that_names_none(llm):
    assert llm.pooling_type() == 1


def test_an_input_s_vector_does_not_depend_on_what_was_embedded_before_it(llm):
    alone = llm.embed("hello world")
    together = llm.embed(["a first, longer text to fill the context " * 2, "hello world"])
    assert together[1] == alone  # bit for bit: the context is cleared before each input
    assert together[0] != alone and len(alone) == llm.n_embd()


def test_embedding_leaves_the_generation_s_cache_and_its_continuation_as_they_were(tiny_model):
    plain = Llama(tiny_model, budget=24, n_batch=32, n_threads=1)
    mixed = Llama(tiny_model, budget=24, n_batch=32, n_threads=1)
    a = plain.generate(TEXT, max_tokens=6, temperature=0)
    b = mixed.generate(TEXT, max_tokens=6, temperature=0)
    before = mixed.kv_state()
    mixed.embed(["something else entirely", TEXT])
    assert list(mixed.kv_state().positions) == list(before.positions)
    assert mixed.generate(" and", max_tokens=6, temperature=0, reset=False) == \
        plain.generate(" and", max_tokens=6, temperature=0, reset=False)
    assert a == b


def test_an_input_is_read_whole_up_to_n_batch_or_512_tokens_within_the_trained_context(llm):
    assert llm.embedding_max_tokens == 128  # n_batch 32, raised to 512, held to the tiny model's trained 128
    # n_batch, trained context -> tokens
    assert [context_size(*a) for a in ((128, 8192), (1024, 8192), (1024, 0), (4096, 2048))] == [512, 1024, 1024, 2048]


def test_longer_inputs_are_cut_there_or_refused(llm):
    limit = llm.embedding_max_tokens
    tokens = llm.tokenize(TEXT * 4)
    assert len(tokens) > limit
    assert llm.embed(tokens) == llm.embed(tokens[:limit])
    vectors, n = llm.embed([tokens, "hi"], return_count=True)
    assert n == limit + len(llm.tokenize("hi")) and len(vectors) == 2
    with pytest.raises(ValueError, match=f"more than the {limit}"):
        llm.embed(tokens, truncate=False)


def test_normalize_gives_vectors_of_length_one(llm):
    v = llm.embed("hello world", normalize=True)
    assert math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-6)
    raw = np.asarray(llm.embed("hello world"))
    np.testing.assert_allclose(v, raw / np.linalg.norm(raw), rtol=1e-6)


def test_create_embedding_answers_openai_s_shape(llm):
    out = llm.create_embedding(["one", "two"], model="m")
    assert out["object"] == "list" and out["model"] == "m"
    assert [d["index"] for d in out["data"]] == [0, 1] and all(d["object"] == "embedding" for d in out["data"])
    assert out["data"][1]["embedding"] == llm.embed("two")
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == \
        len(llm.tokenize("one")) + len(llm.tokenize("two"))
    assert llm.create_embedding("one")["data"][0]["embedding"] == llm.embed("one")


def test_bad_inputs_are_clear_errors_and_leave_the_llama_usable(tiny_model):
    llm = Llama(tiny_model, budget=24, n_batch=32, n_threads=1)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="out of range"):
        llm.embed([10**6])
    for bad in (None, 3, [1.5], [["a"]], {"a": 1}):
        with pytest.raises(TypeError):
            llm.embed(bad)
    assert llm.embed([]) == []
    assert len(llm.embed("still works")) == llm.n_embd()
    for bad in (4, 7, -2, True, "mean"):
        with pytest.raises(ValueError, match="pooling_type"):
            Llama(tiny_model, budget=24, n_threads=1, pooling_type=bad)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.embed("after close")


def test_llama_cpp_python_s_embedding_true_makes_the_same_llama(tiny_model):
    a = Llama(tiny_model, budget=24, n_batch=32, n_threads=1, embedding=True)
    b = Llama(tiny_model, budget=24, n_batch=32, n_threads=1)
    assert a.embed(TEXT) == b.embed(TEXT)
    assert a.generate(TEXT, max_tokens=4, temperature=0) == b.generate(TEXT, max_tokens=4, temperature=0)


def test_a_dropped_llama_is_freed_at_once_after_embedding_too(tiny_model):
    """No reference cycle: dropping a Llama frees its model and contexts (and an RPC server's connection) then, not
    whenever the garbage collector runs."""
    import gc
    import weakref

    gc.disable()
    try:
        for use in (lambda llm: None, lambda llm: llm.embed("hello")):
            llm = Llama(tiny_model, budget=24, n_threads=1)
            use(llm)
            ref = weakref.ref(llm)
            del llm
            assert ref() is None
    finally:
        gc.enable()
