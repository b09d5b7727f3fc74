"""The memory-capped mode: the largest batch whose KV cache fits a byte limit, for the full cache and a budget."""
import pytest

from h2o_local import Llama
from h2o_local.capacity import cells_needed, largest_batch, padded_cells


def test_cells_needed_full_cache_keeps_prompt_and_generation():
    assert cells_needed(4, prompt_tokens=512, max_tokens=512, budget=None, n_batch=128) == 4 * 1024


def test_cells_needed_bounded_keeps_budget_per_sequence_plus_one_batch():
    assert cells_needed(4, prompt_tokens=512, max_tokens=512, budget=100, n_batch=128) == 4 * 100 + 128


def test_largest_batch_counts_llama_cpp_rounding():
    per_cell = 1000
    limit = 4096 * per_cell
    assert largest_batch(limit, bytes_per_cell=per_cell, prompt_tokens=512, max_tokens=512, budget=None,
                         n_batch=128) == 4
    # 39 x 100 + 128 = 4028 cells -> 4096 allocated; 40 x 100 + 128 = 4128 -> 4352 > 4096
    assert largest_batch(limit, bytes_per_cell=per_cell, prompt_tokens=512, max_tokens=512, budget=100,
                         n_batch=128) == 39
    assert padded_cells(4028) == 4096 and padded_cells(4128) == 4352
    assert largest_batch(100, bytes_per_cell=per_cell, prompt_tokens=8, max_tokens=8, budget=None, n_batch=8) == 0


def test_for_kv_limit_gives_the_largest_batch_within_the_limit(tiny_model):
    per_cell = Llama(tiny_model, n_ctx=256).kv_bytes_per_cell
    limit = 2048 * per_cell + 100
    full = Llama.for_kv_limit(tiny_model, limit, prompt_tokens=100, max_tokens=100)
    h2o = Llama.for_kv_limit(tiny_model, limit, prompt_tokens=100, max_tokens=100, policy="h2o", budget=40, n_batch=64)
    assert full.n_seq_max == 10 and full.policy.name == "full"
    assert h2o.n_seq_max == 49 and h2o.policy.name == "h2o"
    for llm, budget in ((full, None), (h2o, 40)):
        assert llm.kv_state().kv_bytes <= limit
        bigger = Llama(tiny_model, policy="h2o" if budget else None, budget=budget, n_seq_max=llm.n_seq_max + 1, n_batch=llm.n_batch,
                       n_ctx=cells_needed(llm.n_seq_max + 1, prompt_tokens=100, max_tokens=100, budget=budget,
                                          n_batch=llm.n_batch))
        assert bigger.kv_state().kv_bytes > limit


def test_for_kv_limit_runs_its_batch_without_running_out_of_cells(tiny_model):
    per_cell = Llama(tiny_model, n_ctx=256).kv_bytes_per_cell
    llm = Llama.for_kv_limit(tiny_model, 512 * per_cell, prompt_tokens=40, max_tokens=24)
    prompts = [[(5 * i + j) % 200 + 3 for i in range(40)] for j in range(llm.n_seq_max)]
    llm.generate_batch(prompts, max_tokens=24, temperature=0, ignore_eos=True)
    assert llm.finish_reasons == ["length"] * llm.n_seq_max


def test_for_kv_limit_rejects_a_limit_too_small_for_one_sequence(tiny_model):
    with pytest.raises(ValueError, match="not even one sequence"):
        Llama.for_kv_limit(tiny_model, 1000, prompt_tokens=512, max_tokens=512)


def test_one_stream_per_sequence_pays_a_batch_and_the_rounding_per_sequence():
    # 8 x (100 + 128) = 1824 cells -> 2048, 256 per stream; 9 x 228 = 2052 -> 2304 / 9 = 256: 2304 cells
    assert cells_needed(8, prompt_tokens=512, max_tokens=512, budget=100, n_batch=128, kv_unified=False) == 8 * 228
    assert padded_cells(8 * 228, 8, kv_unified=False) == 2048
    assert padded_cells(9 * 228, 9, kv_unified=False) == 2304
    assert largest_batch(2048 * 1000, bytes_per_cell=1000, prompt_tokens=512, max_tokens=512, budget=100,
                         n_batch=128, kv_unified=False) == 8


def test_for_kv_limit_with_one_stream_per_sequence(tiny_model):
    per_cell = Llama(tiny_model, n_ctx=256).kv_bytes_per_cell
    limit = 2048 * per_cell
    llm = Llama.for_kv_limit(tiny_model, limit, prompt_tokens=100, max_tokens=100, budget=40, n_batch=64,
                             kv_unified=False)
    assert llm.n_seq_max == 8 and not llm.kv_unified  # 104 cells per stream, rounded up to 256
    assert llm.kv_state().kv_bytes <= limit
