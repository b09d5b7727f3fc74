"""Never crash, never corrupt a session: misuse that used to crash or go silently wrong (issue 15)."""
import os
import signal
import threading
import time
import warnings

import pytest

from h2o_local import Llama
from h2o_local.text import TextAssembler


def test_one_llama_from_two_threads_is_serialized_not_crashed(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=32)
    outcomes = []

    def work(seed):
        for _ in range(15):
            try:
                outcomes.append(llm.generate("threads share one context", max_tokens=20, temperature=0.9, seed=seed))
            except RuntimeError as e:  # the other thread's generation took the context over
                assert "interrupted by another call" in str(e)
                outcomes.append(None)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 30 and any(isinstance(o, str) for o in outcomes)
    assert llm.generate("still usable", max_tokens=5, temperature=0) == llm.generate("still usable", max_tokens=5,
                                                                                    temperature=0)


def test_holding_a_llama_exclusively_ends_a_suspended_generation_and_serializes(tiny_model):
    """`Llama.exclusive()` (what a server's slots hold while they step): a generation left suspended cannot go on
    after it, and another thread's call waits until it is released."""
    llm = Llama(tiny_model, policy="h2o", budget=16, n_batch=32)
    stream = llm.generate("suspended here", max_tokens=20, temperature=0, stream=True)
    next(stream)
    order = []
    with llm.exclusive():
        other = threading.Thread(target=lambda: (llm.reset(), order.append("other")))
        other.start()
        other.join(timeout=0.5)
        order.append("held")
    other.join()
    assert order == ["held", "other"]
    with pytest.raises(RuntimeError, match="interrupted by another call"):
        next(stream)


def test_more_sequences_than_a_batch_holds(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=8, n_seq_max=40, n_batch=32)  # used to abort in llama.cpp
    texts = llm.generate_batch([f"prompt {i}" for i in range(40)], max_tokens=3, temperature=0)
    assert len(texts) == 40 and llm.finish_reasons.count(None) == 0


def test_snapshot_of_another_model_is_refused(tiny_model, tmp_path):
    from tiny_model import write_tiny_llama

    other = Llama(str(write_tiny_llama(tmp_path / "three-layers.gguf", n_layer=3)), policy="h2o", budget=64)
    other.eval(other.tokenize("a snapshot from a model with three layers"))
    snap = other.save_state()
    llm = Llama(tiny_model, policy="h2o", budget=64)
    llm.eval(llm.tokenize("what this sequence holds"))
    before = llm.kv_state().positions.tolist()
    with pytest.raises(ValueError, match="another model"):
        llm.load_state(snap)
    assert llm.kv_state().positions.tolist() == before  # unchanged, and usable
    assert isinstance(llm.generate("", reset=False, max_tokens=3), str)


def test_snapshot_larger_than_the_cache_is_refused(tiny_model):
    big = Llama(tiny_model, n_ctx=512)
    big.eval(list(range(3, 203)))
    small = Llama(tiny_model, policy="h2o", budget=16, n_batch=32)
    with pytest.raises(ValueError, match="only 48 cells are free"):
        small.load_state(big.save_state())
    assert small.generate("fine", max_tokens=3, temperature=0) is not None
    with pytest.raises(TypeError, match="save_state"):
        small.load_state(b"not a snapshot")


def test_breaking_out_of_a_stream_then_continuing_feeds_what_was_shown(tiny_model):
    llm = Llama(tiny_model, n_ctx=512)
    prompt = llm.tokenize("Once upon a time")
    shown = 0
    for _ in llm.generate_events(prompt, max_tokens=50, temperature=0):
        shown += 1
        if shown == 4:
            break
    assert llm.kv_state().n_seen == len(prompt) + 3  # the 4th token was shown, not fed
    more = llm.tokenize(" and then", add_bos=False)
    events = list(llm.generate_events(more, reset=False, max_tokens=1, temperature=0))
    assert llm.kv_state().n_seen == len(prompt) + 4 + len(more)  # fed first, then the new prompt
    assert events[-1].finish_reason == "length"


def test_a_call_on_another_sequence_keeps_the_shown_token_of_sequence_0(tiny_model):
    """The token a generation showed and did not feed belongs to sequence 0's session: eval, compress, reset, save
    and load on sequence 1 (and a policy switch) leave it to be fed when sequence 0 goes on."""
    llm = Llama(tiny_model, policy="h2o", budget=64, n_seq_max=2)
    prompt = llm.tokenize("Once upon a time")
    list(llm.generate_events(prompt, max_tokens=3, temperature=0))
    assert llm.kv_state(0).n_seen == len(prompt) + 2  # the 3rd token was shown, not fed
    llm.eval(llm.tokenize("other"), seq_id=1)
    llm.compress(1)
    llm.load_state(llm.save_state(1), seq_id=1)
    llm.set_policy("h2o", 64)
    llm.reset(1)
    list(llm.generate_events([], reset=False, max_tokens=0, temperature=0))
    assert llm.kv_state(0).n_seen == len(prompt) + 3


def test_two_streams_used_alternately_do_not_share_the_context(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=32, n_batch=32)
    a = llm.generate("first story", max_tokens=20, stream=True, temperature=0)
    b = llm.generate("second story", max_tokens=20, stream=True, temperature=0)
    next(a)
    next(b)  # b resets the context for itself
    with pytest.raises(RuntimeError, match="interrupted"):
        next(a)
    assert "".join(b) is not None


def test_a_cut_character_is_dropped_not_replaced():
    text = TextAssembler()
    assert text.push("né".encode()) == "né"
    assert text.push("\u20ac".encode()[:2]) == ""  # two of the euro sign's three bytes
    assert text.flush() == ""                      # no U+FFFD at the end


def test_ctrl_c_stops_a_long_prefill_between_chunks(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=8, n_batch=8)
    tokens = list(range(3, 259)) * 1000  # 256,000 tokens in 32,000 chunks: seconds on any machine, stopped at 0.3 s
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        llm.eval(tokens)
    timer.join()
    assert llm.kv_state().n_seen < len(tokens)  # stopped part-way, between chunks
    assert time.perf_counter() - t0 < 30
    assert llm.kv_state().n_cells <= 8 + 8
    llm.reset()
    assert isinstance(llm.generate("usable again", max_tokens=3), str)


def test_generation_past_the_trained_context_warns_once_without_rolling(tiny_model_128):
    llm = Llama(tiny_model_128, policy="h2o", budget=16, n_batch=32, position_rolling=False)
    with pytest.warns(RuntimeWarning, match="trained context"):
        llm.generate("x" * 100, max_tokens=60, temperature=0.9, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.generate("x" * 100, max_tokens=60, temperature=0.9, seed=1)
    for rolling in ({}, {"roll_interval": 1}):  # rolling when needed (the default), or at every eviction
        llm = Llama(tiny_model_128, policy="h2o", budget=16, n_batch=32, **rolling)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            llm.generate("x" * 100, max_tokens=60, temperature=0.9, seed=1)


@pytest.mark.parametrize("kv_unified", [False, True])
def test_the_full_cache_ends_only_the_sequence_whose_room_is_gone(tiny_model, kv_unified):
    """Policy full, two sequences of different prompt lengths: the longer fills its stream (or, unified, the shared
    cache) first and ends with "length"; the other goes on. No error for either."""
    llm = Llama(tiny_model, n_ctx=256, n_seq_max=2, kv_unified=kv_unified, n_threads=1)
    long_prompt, short_prompt = list(range(5, 5 + 100)), [1, 2, 3]
    texts = llm.generate_batch([long_prompt, short_prompt], max_tokens=200, temperature=0, ignore_eos=True)
    assert llm.finish_reasons[0] == "length" and all(isinstance(t, str) for t in texts)
    if not kv_unified:  # its own stream of 128 cells: the short one fills it later, and generates more
        assert llm.finish_reasons[1] == "length" and len(llm.tokenize(texts[1], add_bos=False)) > 0


def test_close_frees_the_llama_and_later_calls_say_so(tiny_model):
    """llama-cpp-python's close() and `with Llama(...) as llm:`: a running stream stops at its next step, and every
    later call raises RuntimeError instead of touching freed memory."""
    llm = Llama(tiny_model, policy="h2o", budget=16)
    stream = llm.create_completion("Hello", max_tokens=50, stream=True)
    next(stream)
    llm.close()
    with pytest.raises(RuntimeError, match="interrupted"):
        next(stream)
    for call in (lambda: llm.create_completion("Hi", max_tokens=2), lambda: llm.eval([5]), lambda: llm.kv_state(),
                 lambda: llm.tokenize("x")):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    llm.close()  # twice is fine
    with Llama(tiny_model, policy="h2o", budget=16) as scoped:
        assert isinstance(scoped.generate("Hi", max_tokens=2), str)
    with pytest.raises(RuntimeError, match="closed"):
        scoped.generate("Hi", max_tokens=2)
