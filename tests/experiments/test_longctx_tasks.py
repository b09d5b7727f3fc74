"""experiments/longctx.py: every task hides its answers in its context, and scoring counts whole words."""
import random
from collections import Counter

import pytest

from experiments.longctx import TASKS, WORDS, make_task, row_format, score


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("row", range(8))
def test_every_answer_is_in_the_task(task, row):
    fmt = row_format(row)
    spec = make_task(task, random.Random(f"0/{task}/{row}"), fmt)
    text = spec.get("context", " ".join(spec.get("needles", [])))
    assert len(spec["turns"]) == len(spec["answers"]) >= 1
    for expected in spec["answers"]:
        assert expected is None or all(e in text for e in expected)  # None: a turn that is not scored (a summary)


def test_row_formats_are_a_balanced_half_fraction():
    formats = [row_format(r) for r in range(8)]
    for factor in ("wording", "prefix", "template", "before"):
        assert sum(f[factor] for f in formats) == 4
    assert len({tuple(f.values()) for f in formats}) == 8


def test_common_words_are_the_ten_most_frequent():
    spec = make_task("cwe", random.Random(3), row_format(0))
    counts = Counter(line.split(". ", 1)[1] for line in spec["context"].splitlines())
    assert len(counts) == len(WORDS)
    assert {w for w, _ in counts.most_common(10)} == set(spec["answers"][0])
    assert counts.most_common(11)[-1][1] < counts.most_common(10)[-1][1]


def test_frequent_words_are_the_three_most_frequent():
    spec = make_task("fwe", random.Random(5), row_format(1))
    counts = Counter(spec["context"].split())
    top = counts.most_common(4)
    assert [w for w, _ in top[:3]] == spec["answers"][0]
    assert top[2][1] > top[3][1]


def test_score_counts_whole_words_and_substrings_of_numbers():
    assert score("tigers and a lion", ["tiger"]) == 0.0
    assert score("Tiger, apple.", ["apple", "tiger"]) == 0.5  # case matters: the list's own spelling
    assert score("the code is 4709378.", ["4709378"]) == 1.0
    assert score("The value is 8c00e044", ["8c00e044"]) == 1.0
