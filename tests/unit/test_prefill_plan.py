"""How a feed is cut into decodes and where it evicts (cpp/prefill_plan.h), without a model: a pure function of
sizes, checked on examples and by the invariants it promises."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h2o_local import _engine


def plan(sizes, cells=None, *, capacity, budget=256, n_batch=512, query_window=0, kv_unified=False, defer=True,
         bounded=True):
    return _engine.plan_prefill(sizes, cells or {}, capacity, kv_unified, defer, bounded, budget, n_batch, query_window)


def test_a_prompt_that_fits_is_decoded_whole_in_batches_then_evicts_once():
    fits, steps = plan({0: 700}, capacity=768, query_window=1)
    assert fits
    assert [s[0] for s in steps] == [{0: (0, 512)}, {0: (512, 187)}, {0: (699, 1)}]  # the window on its own
    assert [s[1] for s in steps] == [[], [], [0]] and all(not s[2] for s in steps)


def test_a_long_prompt_is_cut_in_pieces_and_evicts_only_when_the_next_piece_needs_the_cells():
    fits, steps = plan({0: 2000}, capacity=256 + 512, budget=256, n_batch=512)
    assert not fits
    assert [s[0][0] for s in steps] == [(0, 512), (512, 512), (1024, 512), (1536, 464)]
    # 512 held: the next 512 do not fit beside them (768 cells) -> evict to 256; the last piece evicts at the end
    assert [s[2] for s in steps] == [[0], [0], [0], [0]]
    # 1,500 entries held: 500 fit beside them; then the rest of that piece, so that later pieces start at
    # multiples of n_batch counted from the prompt's start, as they would with nothing held
    fits, steps = plan({0: 1000}, capacity=2000, budget=256, n_batch=512, cells={0: 1500})
    assert not fits and [s[0][0] for s in steps] == [(0, 500), (500, 12), (512, 488)]
    assert [s[2] for s in steps] == [[0], [], [0]]


def test_the_end_of_a_prompt_is_ranked_with_its_window_not_cut_before_it():
    fits, steps = plan({0: 1100}, capacity=256 + 512, budget=256, n_batch=512, query_window=16)
    assert not fits
    assert [s[0][0] for s in steps] == [(0, 512), (512, 512), (1024, 60), (1084, 16)]
    assert [s[1] for s in steps] == [[], [], [], [0]]
    # the piece before the window is not evicted on its own (its cells suffice): it waits for the window's queries
    assert [s[2] for s in steps] == [[0], [0], [], [0]]


def test_sequences_are_cut_at_the_same_places_alone_or_together():
    # (a feed that fits is attended whole, where the chunking cannot change what is kept; this one does not fit)
    alone = [plan({s: n}, capacity=256 + 64, budget=256, n_batch=64)[1] for s, n in ((0, 1000), (1, 530))]
    fits, both = plan({0: 1000, 1: 530}, capacity=256 + 64, budget=256, n_batch=64)
    assert not fits
    for seq, steps in ((0, alone[0]), (1, alone[1])):
        assert [s[0][seq] for s in both if seq in s[0]] == [s[0][seq] for s in steps]


def test_the_full_cache_gets_no_plan_when_it_does_not_fit():
    assert plan({0: 900}, capacity=768, bounded=False) == (False, [])
    fits, steps = plan({0: 700}, capacity=768, bounded=False)
    assert fits and sum(s[0][0][1] for s in steps) == 700


def test_no_free_cell_is_a_logic_error_not_a_hang():
    with pytest.raises(RuntimeError, match="no KV cell is free"):
        plan({0: 10}, {1: 300}, capacity=300, budget=256, kv_unified=True, defer=False)


@settings(max_examples=300, deadline=None)
@given(sizes=st.dictionaries(st.integers(0, 3), st.integers(0, 3000), min_size=1, max_size=4),
       held=st.dictionaries(st.integers(0, 3), st.integers(0, 64), max_size=4),
       budget=st.integers(1, 128), n_batch=st.sampled_from([1, 7, 64, 512]), window=st.sampled_from([0, 1, 16]),
       unified=st.booleans())
def test_every_plan_feeds_each_token_once_in_order_and_never_overfills(sizes, held, budget, n_batch, window, unified):
    n_seq = 4
    capacity = (n_seq * budget if unified else budget) + n_batch
    cells = {s: min(h, budget) for s, h in held.items()}
    fits, steps = plan(sizes, cells, capacity=capacity, budget=budget, n_batch=n_batch, query_window=window,
                       kv_unified=unified, defer=not unified)
    fed = {s: 0 for s in sizes}
    now = {s: cells.get(s, 0) for s in set(sizes) | set(cells)}
    for chunk, windows, evict in steps:
        assert sum(n for _, n in chunk.values()) <= n_batch
        for seq, (off, n) in chunk.items():
            assert off == fed[seq] and n > 0  # in order, each token once
            fed[seq] += n
            now[seq] += n
        used = sum(now.values()) if unified else max(now.values())
        assert used <= capacity  # a decode never needs more cells than there are
        for seq in windows:  # a query window is the end of its prompt, whole
            assert fed[seq] == sizes[seq] and chunk[seq][1] == min(window, n_batch, sizes[seq])
        for seq in evict:
            now[seq] = min(now[seq], budget)
    assert fed == sizes
