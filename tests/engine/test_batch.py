"""Batched generation: several sequences decoded together, each with its own budget, scores and sampler."""
import pytest

from h2o_local import Llama
from device_tolerance import CPU_BACKEND as CPU

# the batch-against-alone tests run on the CPU backend, whose results do not depend on a batch's size: a GPU's
# matrix products round differently by batch size (CUDA: prefill column sums up to 8.8% of an entry apart), so that
# a sampled or near-tied token forks there; what batching decides is the same logic on any backend
PROMPTS = ["Once upon a time", "The weather today is", "In the beginning there was", "Numbers: 1 2 3"]


def test_batch_equals_one_by_one_greedy(tiny_model):
    batched = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=4, n_batch=64, **CPU)
    single = Llama(tiny_model, policy="h2o", budget=16, n_batch=64, **CPU)
    texts = batched.generate_batch(PROMPTS, max_tokens=24, temperature=0)
    assert texts == [single.generate(p, max_tokens=24, temperature=0) for p in PROMPTS]


def test_batch_sampling_follows_the_per_sequence_seeds(tiny_model):
    batched = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2, n_batch=64, **CPU)
    single = Llama(tiny_model, policy="h2o", budget=16, n_batch=64, **CPU)
    texts = batched.generate_batch(PROMPTS, max_tokens=20, temperature=0.9, seed=7)  # two waves of two
    assert texts == [single.generate(p, max_tokens=20, temperature=0.9, seed=7 + i) for i, p in enumerate(PROMPTS)]


def test_batch_stream_and_finish(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=4, n_batch=64)
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
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=4, n_batch=32)
    stream = llm.generate_batch(["x" * 200] * 4, max_tokens=30, temperature=0, stream=True)
    most = 0
    for _ in stream:
        most = max(most, llm.stats()["cells_used"])
    assert llm.n_ctx() == 4 * 16 + 32
    assert most == 4 * 16  # between steps every sequence holds exactly its budget
    assert all(llm.kv_state(s).peak_cells <= 16 + 32 for s in range(4) if llm.kv_state(s).n_seen)


def test_batch_rejects_empty_prompts(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=2)
    with pytest.raises(ValueError, match="empty"):
        llm.generate_batch(["ok", []])


def test_long_prompts_are_fed_at_the_same_boundaries_alone_or_batched(tiny_model):
    # prompts longer than budget + n_batch, of lengths that are not multiples of n_batch: the bounded prefill cuts
    # each sequence at multiples of n_batch from its own start, so batching does not change what is evicted when
    prompts = [[(7 * i + j) % 200 + 3 for i in range(n)] for j, n in enumerate((150, 203, 97))]
    batched = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=3, n_batch=32, **CPU)
    single = Llama(tiny_model, policy="h2o", budget=16, n_batch=32, **CPU)
    texts = batched.generate_batch(prompts, max_tokens=12, temperature=0, stream=True)
    kept = {}
    for i, piece in texts:
        if i not in kept:  # the first piece comes right after the prefill
            kept[i] = batched.kv_state(i).positions.tolist()
    for i, p in enumerate(prompts):
        single.reset()
        single.eval(p)
        assert single.kv_state().positions.tolist() == kept[i]
        assert single.kv_state().peak_cells <= 16 + 32


def test_ignore_eos_runs_every_sequence_to_max_tokens(tiny_model):
    llm = Llama(tiny_model, policy="h2o", budget=16, n_seq_max=4, n_batch=64)
    llm.generate_batch(PROMPTS, max_tokens=150, temperature=50.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    assert "stop" in llm.finish_reasons  # near-uniform sampling over the small vocabulary meets an end token
    seen = [0] * len(PROMPTS)
    for i, piece in llm.generate_batch(PROMPTS, max_tokens=150, temperature=50.0, top_k=0, top_p=1.0, min_p=0.0,
                                       seed=3, ignore_eos=True, stream=True):
        seen[i] = llm.kv_state(i).n_seen  # at the end event too (the last piece may be empty: a cut character)
    assert llm.finish_reasons == ["length"] * len(PROMPTS)
    # the sequence ends before the 150th token would be fed
    assert seen == [len(llm.tokenize(p)) + 150 - 1 for p in PROMPTS]


@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_one_stream_per_sequence_gives_the_single_sequence_results(tiny_model, policy):
    budget = 16 if policy == "h2o" else None
    streams = Llama(tiny_model, policy=policy, budget=budget, n_seq_max=4, n_batch=32, kv_unified=False,
                    n_ctx=0 if budget else 4 * 256, **CPU)
    single = Llama(tiny_model, policy=policy, budget=budget, n_batch=32, n_ctx=0 if budget else 256, **CPU)
    prompts = PROMPTS + [[(7 * i) % 200 + 3 for i in range(90)]]  # 5 prompts: a second wave
    texts = streams.generate_batch(prompts, max_tokens=24, temperature=0)
    assert texts == [single.generate(p, max_tokens=24, temperature=0) for p in prompts]
    if budget:
        assert streams.n_ctx() == 4 * (16 + 32)  # a budget and a batch per stream


def test_a_stream_holds_only_its_share_of_the_context(tiny_model):
    llm = Llama(tiny_model, n_seq_max=2, n_ctx=2 * 256, kv_unified=False)
    llm.eval([5] * 200, seq_id=0)
    with pytest.raises(ValueError, match="never evicts"):
        llm.eval([5] * 100, seq_id=0)  # 300 > 256 cells of stream 0, though stream 1 is empty
    llm.eval([5] * 250, seq_id=1)
    assert llm.kv_state(0).n_seen == 200 and llm.kv_state(1).n_seen == 250
