"""A thinking model's reasoning told apart from its answer (`h2o_local.reasoning`), whole or streamed."""
from hypothesis import given, strategies as st

from h2o_local.reasoning import KNOWN_TAGS, Splitter, Thinking, ThinkTags, split, think_tags, thinking

THINK = ThinkTags("<think>", "</think>")


def test_the_reasoning_between_the_tags_and_the_answer_after_them():
    assert split("<think>\nWhy? Because.\n</think>\n\nIt is 4.", THINK) == ("\nWhy? Because.\n", "It is 4.")
    assert split("  <think>a</think>b", THINK) == ("a", "b")
    # the generation prompt opened the tags (DeepSeek-R1's distills): the answer starts inside them
    assert split("hmm</think>\n4", THINK, inside=True) == ("hmm", "4")
    # never closed (max_tokens cut it): all reasoning, no answer
    assert split("<think>still going", THINK) == ("still going", "")
    # no tags: no reasoning; tags later in the answer are the answer's
    assert split("4, written <think> as is", THINK) == (None, "4, written <think> as is")
    assert split("<thin", THINK) == (None, "<thin")
    assert split("", THINK) == (None, "")
    assert split("<think>x</think>", None) == (None, "<think>x</think>")


def test_each_template_family_names_its_tags():
    assert think_tags("{{ '<think>' }}...</think>") == THINK
    assert think_tags("<seed:think>...</seed:think>") == KNOWN_TAGS[1]
    assert think_tags("[THINK]...[/THINK]") == KNOWN_TAGS[2]
    assert think_tags("{% for m in messages %}{{ m.content }}{% endfor %}") is None and think_tags(None) is None


ANSWERS = st.sampled_from(["<think>\nplan: a < b </thin k> done\n</think>\n\nanswer <think>x</think>", "plain <",
                           "  <think></think>", "<think>unclosed </", "</think>closing only", "\n\n<thi"])


@given(ANSWERS, st.lists(st.integers(min_value=0, max_value=80), max_size=12), st.booleans())
def test_a_stream_cut_anywhere_splits_as_the_whole_answer(answer, cuts, inside):
    """Pieces of any sizes (a tag cut in two, one character at a time) give the whole answer's split."""
    s = Splitter(THINK, inside)
    reasoning, content = [], []
    at = 0
    for cut in sorted(set(c for c in cuts if c <= len(answer))) + [len(answer)]:
        r, c = s.feed(answer[at:cut])
        reasoning.append(r)
        content.append(c)
        at = cut
    r, c = s.end()
    whole = split(answer, THINK, inside)
    assert ("".join(reasoning + [r]) if s.thought else None, "".join(content + [c])) == whole


HARMONY = ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>commentary<|message|>"
           "Checking.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.")


def test_gpt_oss_channels_analysis_is_the_reasoning_the_rest_the_answer():
    harmony = Thinking(None)
    assert harmony.split(HARMONY) == ("Two and two.", "Checking.It is 4.")
    assert harmony.split("<|channel|>final<|message|>Just 4.") == (None, "Just 4.")
    assert harmony.split("<|channel|>analysis<|message|>cut sho") == ("cut sho", "")  # max_tokens
    assert harmony.split("No channels at all.") == (None, "No channels at all.")
    assert thinking("auto", "...<|channel|>...", "<|start|>assistant") == harmony
    assert thinking("none", "...<|channel|>...", "") is None


@given(st.lists(st.integers(min_value=0, max_value=len(HARMONY)), max_size=12))
def test_a_gpt_oss_stream_cut_anywhere_splits_as_the_whole_answer(cuts):
    s = Thinking(None).splitter()
    reasoning, content, at = [], [], 0
    for cut in sorted(set(cuts)) + [len(HARMONY)]:
        r, c = s.feed(HARMONY[at:cut])
        reasoning.append(r)
        content.append(c)
        at = cut
    r, c = s.end()
    assert ("".join(reasoning + [r]), "".join(content + [c])) == Thinking(None).split(HARMONY)
