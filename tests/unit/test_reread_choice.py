"""Which dropped text a question reads again (cpp/recall_text.h): windows of 64 tokens, scored by the question's
distinct tokens each holds, a token weighing BM25's idf over the windows (nothing from half of them on)."""
from h2o_local import _engine

COMMON, OTHER, RARE, RARER = 1, 2, 7, 8


def text(n_windows, placed):
    """n_windows windows of 64 tokens, all COMMON but for OTHER in every other window and `placed` {index: token}."""
    toks = [COMMON] * (64 * n_windows)
    for w in range(0, n_windows, 2):
        toks[64 * w + 5] = OTHER
    for i, t in placed.items():
        toks[i] = t
    return toks


def windows(chosen):
    return sorted({i // 64 for i in chosen})


def test_the_window_that_holds_the_questions_rare_token_is_read_again():
    chosen = _engine.reread_choice(text(10, {64 * 3 + 10: RARE}), [COMMON, RARE, OTHER], max_tokens=256)
    assert windows(chosen) == [3] and chosen == list(range(64 * 3, 64 * 4))  # the whole window, ascending


def test_a_token_in_half_the_windows_or_more_weighs_nothing():
    assert _engine.reread_choice(text(10, {}), [COMMON, OTHER], max_tokens=640) == []


def test_the_best_windows_first_while_they_fit_and_never_one_that_holds_nothing_weighed():
    toks = text(12, {64 * 2: RARE, 64 * 9: RARE, 64 * 9 + 1: RARER, 64 * 5: RARER})
    assert windows(_engine.reread_choice(toks, [RARE, RARER], max_tokens=64)) == [9]  # both rare tokens
    assert windows(_engine.reread_choice(toks, [RARE, RARER], max_tokens=1000)) == [2, 5, 9]
    assert _engine.reread_choice(toks, [RARE, RARER], max_tokens=63) == []  # no whole window fits


def test_nothing_to_read_without_text_question_or_room():
    assert _engine.reread_choice([], [RARE], max_tokens=64) == []
    assert _engine.reread_choice(text(4, {3: RARE}), [], max_tokens=64) == []
    assert _engine.reread_choice(text(4, {3: RARE}), [RARE], max_tokens=0) == []
