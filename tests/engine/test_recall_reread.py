"""Recall's dropped text (the policy option reread, docs/recall.md "Past the store's cap"): past its cap the host
store drops the K and V of the oldest text but keeps its tokens; a later question's rarer tokens find the windows of
that text which hold them, those are decoded again after the kept entries, and recall ranks them with the rest of the
store, so a chat longer than any store can still bring back what it was told."""
import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.policies import resolve
from device_tolerance import approximate, assert_values_close
from engine_view import cell_bytes, next_position
from tiny_model import write_tiny_llama

WORDS = ("the keeper of the lighthouse wrote a letter to the harbour master about the storm and ships that came "
         "late at night and bells rang").split()
FACT = " zq7319xj "  # bytes the filler never holds: the byte vocabulary's rare tokens
QUESTION = " what is zq7319xj?"
CAP = 40


def story(n_words=300, fact_at=200):
    filler = " ".join(np.random.default_rng(0).choice(WORDS, n_words))
    return filler[:fact_at] + FACT + filler[fact_at:]


def make(model, budget=24, **options):
    return Llama(model, policy=resolve(None, budget, **options), n_batch=128, n_ctx=1024, recall=CAP)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """Trained on 256 tokens: a story of 1,500 rolls (its kept entries renumbered)."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("reread") / "short.gguf", n_ctx_train=256))


def fed(llm):
    tokens = list(llm.tokenize(story()))
    llm.eval(tokens)
    return tokens


def test_the_store_keeps_the_text_it_drops_in_the_conversations_order(tiny_model):
    llm = make(tiny_model)
    tokens = fed(llm)
    st = llm.kv_state()
    held = set(st.origins.tolist()) | set(st.host_origins.tolist())
    assert len(st.host_origins) == CAP and st.n_dropped == len(tokens) - st.n_cells - CAP
    assert st.text_origins.tolist() == [o for o in range(len(tokens)) if o not in held]
    assert max(st.text_origins) < min(st.host_origins)  # the oldest text went first


def layer0_rows(llm, positions):
    """Each cell's first layer K and V (its K row, then its V row, in llama_kv_entries_get's order): they depend on
    the token and its position only, never on what came before."""
    rows = np.frombuffer(cell_bytes(llm, 0, positions), dtype=np.float16).reshape(len(positions), -1)
    return rows[:, :rows.shape[1] // 2].astype(np.float32)  # two layers of the same width: the first half


@pytest.mark.parametrize("rolls", [False, True], ids=["at own positions", "renumbered"])
def test_with_room_for_everything_the_question_reads_its_windows_again_at_the_right_positions(
        tiny_model, short_model, rolls):
    """The question's rare bytes are in the dropped text; with a budget above everything, everything the store
    holds comes back, and so do the windows of 64 that hold the question's rarer tokens (only they: the rest stays
    text). Every cell's first-layer K and V are its token's at its position, as a full cache computes them: the
    reread keys were rotated for where they are (their own place when the sequence never rolled; the renumbered one
    when it did)."""
    model = short_model if rolls else tiny_model
    llm = make(model)
    tokens = fed(llm)
    st0 = llm.kv_state()
    assert bool((st0.positions != st0.origins).any()) == rolls
    fact = list(llm.tokenize(FACT.strip(), add_bos=False))
    at = next(a for a in range(len(tokens)) if tokens[a:a + len(fact)] == fact)
    assert set(range(at, at + len(fact))) <= set(st0.text_origins.tolist())

    llm.set_policy(resolve(None, 400))
    llm.recall_for(QUESTION)
    st = llm.kv_state()
    back = set(st0.text_origins.tolist()) - set(st.text_origins.tolist())
    assert set(range(at, at + len(fact))) <= back <= set(st.origins.tolist())
    assert 0 < len(back) <= 256 and len(st.host_origins) == 0  # at most reread's 256 tokens, the store emptied
    assert sorted(st.origins.tolist() + st.text_origins.tolist()) == list(range(len(tokens)))
    assert st.n_seen == len(tokens) and st.tokens.tolist() == [tokens[o] for o in st.origins]

    full = Llama(model, policy="full", n_ctx=2048, n_batch=128)
    if rolls:  # renumbered 0..n-1 in the conversation's order: a full cache of those tokens holds the same places
        assert st.positions.tolist() == list(range(st.n_cells))
        full.eval(st.tokens.tolist())
    else:
        assert st.positions.tolist() == st.origins.tolist()
        full.eval(tokens)
    positions = st.positions.tolist()
    got, expected = layer0_rows(llm, positions), layer0_rows(full, positions)
    # a key rotated more than once (decoded at the end, then shifted to its place) is rounded to F16 each time: a few
    # of F16's steps at the row's magnitude; a key rotated for another position is off by the magnitude itself
    step = 2.0 ** -10 * float(np.abs(expected).max())
    assert_values_close(got, expected, device=approximate(llm), cpu_rtol=0, cpu_atol=4 * step)


def test_with_reread_0_what_the_cap_dropped_stays_forgotten(tiny_model):
    llm = make(tiny_model, reread=0)
    fed(llm)
    st0 = llm.kv_state()
    llm.set_policy(resolve(None, 400, reread=0))
    llm.recall_for(QUESTION)
    st = llm.kv_state()
    assert st.text_origins.tolist() == st0.text_origins.tolist()
    assert set(st.origins.tolist()) == set(st0.origins.tolist()) | set(st0.host_origins.tolist())


def test_a_question_of_common_tokens_reads_nothing_again(tiny_model):
    """A token in half the windows or more weighs nothing: a question of the text's commonest bytes (a byte
    vocabulary: spaces and e's) finds no window (with room for everything, any window read again would stay)."""
    llm = make(tiny_model)
    fed(llm)
    st0 = llm.kv_state()
    llm.set_policy(resolve(None, 400))
    llm.recall_for(" e e")
    st = llm.kv_state()
    assert st.text_origins.tolist() == st0.text_origins.tolist()
    assert set(st.origins.tolist()) == set(st0.origins.tolist()) | set(st0.host_origins.tolist())


def test_a_reread_step_keeps_the_budget_the_cap_and_the_next_position(tiny_model):
    llm = make(tiny_model)
    tokens = fed(llm)
    st0 = llm.kv_state()
    llm.recall_for(QUESTION)
    st = llm.kv_state()
    assert st.n_cells <= 24 and len(st.host_origins) <= CAP and next_position(llm, 0) == len(tokens)
    held = st.origins.tolist() + st.host_origins.tolist() + st.text_origins.tolist()
    assert sorted(held) == list(range(len(tokens)))  # every token once: kept, stored or text
    # what the question read again and the policy did not keep is dropped again, older than the text: merged in order
    assert st.text_origins.tolist() == sorted(st.text_origins.tolist()) != st0.text_origins.tolist()
    assert st.n_recalled > st0.n_recalled


def test_snapshots_carry_the_text_and_a_truncation_forgets_what_follows(tiny_model):
    """A loaded snapshot reads the same windows again (with room for everything, the same entries come back: a
    budget's ranking may differ in its last bits, as the cells of a loaded cache lie in another order) and a
    truncation keeps only the text before its point."""
    llm = make(tiny_model)
    tokens = fed(llm)
    text = llm.kv_state().text_origins.tolist()
    snap = llm.save_state()
    other = make(tiny_model)
    other.load_state(type(snap).from_bytes(snap.to_bytes()))
    assert other.kv_state().text_origins.tolist() == text
    for each in (llm, other):
        each.set_policy(resolve(None, 400))
        each.recall_for(QUESTION)
    assert other.kv_state().origins.tolist() == llm.kv_state().origins.tolist()
    assert other.kv_state().text_origins.tolist() == llm.kv_state().text_origins.tolist() != text

    text = llm.kv_state().text_origins.tolist()
    cut = text[len(text) // 2]
    llm.truncate(cut)
    st = llm.kv_state()
    assert st.text_origins.tolist() == [o for o in text if o < cut] and st.n_seen == cut < len(tokens)


def test_a_chat_sessions_stats_count_the_dropped_text(tmp_path):
    from h2o_local.chat_session import ChatSession

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=chatml, n_ctx_train=4096))
    chat = ChatSession(make(model), max_tokens=4, temperature=0, recall=CAP)
    assert chat.stats()["dropped_text_tokens"] == 0
    "".join(chat.send(story()))
    dropped = chat.stats()["dropped_text_tokens"]
    assert dropped == len(chat.llm.kv_state().text_origins) > 0
