"""Recall: what the policy evicts goes to host memory (K and V of every layer, bit for bit) and each new prompt brings
back what its question ranks above the kept entries, within the budget (`Llama(recall=...)`, docs/recall.md)."""
import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.policies import resolve
from device_tolerance import assert_logits_close, assert_same_choice, assert_values_close, approximate
from engine_view import cell_bytes, entry_bytes, host_store_rows, next_position

PROMPT = ("the keeper of the lighthouse wrote a letter to the harbour master about the storm and the ships that "
          "came in late at night, and the bells that rang until the morning came over the water")
QUESTION = " and what did the keeper write about?"


def default_policy(budget):
    return resolve(None, budget)


def make(tiny_model, budget=24, recall=4096, **kwargs):
    return Llama(tiny_model, policy=default_policy(budget), n_batch=32, recall=recall, **kwargs)


def test_evicted_entries_go_to_host_memory_bit_for_bit(tiny_model):
    """Every evicted entry is in the host store, with the K and V bytes its cell held just before it left."""
    llm = make(tiny_model)
    size = entry_bytes(llm)
    tokens = llm.tokenize(PROMPT)
    llm.eval(tokens)
    st = llm.kv_state()
    host, blob = host_store_rows(llm, 0)
    assert st.n_cells <= 24 and len(host) == st.n_evicted == st.n_spilled == len(tokens) - st.n_cells
    assert sorted(list(host) + st.positions.tolist()) == list(range(len(tokens)))
    assert size > 0 and st.host_bytes == len(blob) == size * len(host)
    for step in range(30):  # generation evicts one entry per token: compare it with what its cell held
        resident = llm.kv_state().positions.tolist()
        held = cell_bytes(llm, 0, resident)
        before = {p: held[i * size:(i + 1) * size] for i, p in enumerate(resident)}
        n_host = len(host_store_rows(llm, 0)[0])
        llm.eval([40 + step % 50])
        host, blob = host_store_rows(llm, 0)
        assert len(host) == n_host + 1
        assert blob[-size:] == before[host[-1]], host[-1]


def test_with_room_for_everything_recall_gives_the_full_caches_logits(tiny_model):
    """Evict under a small budget, then raise the budget above everything: the next prompt brings every spilled
    entry back at its own position, bit for bit, and the logits are the full cache's."""
    full = Llama(tiny_model, policy="full", n_ctx=512, n_batch=32)
    tokens = full.tokenize(PROMPT)
    q = full.tokenize(QUESTION, add_bos=False)
    full.eval(tokens)
    full_bytes = cell_bytes(full, 0, list(range(len(tokens))))
    full.eval(q)
    expected = full.last_logits()

    llm = Llama(tiny_model, policy=default_policy(24), n_batch=32, n_ctx=512, recall=4096)
    llm.eval(tokens)
    assert llm.kv_state().n_evicted > 0
    llm.set_policy(default_policy(400))
    llm.eval(q)
    st = llm.kv_state()
    assert st.positions.tolist() == list(range(len(tokens) + len(q))) and st.n_recalled == len(tokens) - 24
    assert len(st.host_positions) == 0
    assert cell_bytes(llm, 0, list(range(len(tokens)))) == full_bytes
    got = llm.last_logits()
    assert_logits_close(got, expected, device=approximate(llm), cpu_atol=1e-4 * float(np.ptp(expected)))
    assert int(np.argmax(got)) == int(np.argmax(expected))


def test_recall_keeps_the_device_cache_within_its_cells_and_the_budget(tiny_model):
    llm = make(tiny_model, budget=16)
    rng = np.random.default_rng(1)
    for turn in range(6):
        piece = rng.integers(3, 250, size=int(rng.integers(2, 90))).tolist()
        llm.generate(piece, max_tokens=int(rng.integers(1, 12)), temperature=0, reset=False)
        st = llm.kv_state()
        assert st.n_cells <= 16 and st.peak_cells <= 16 + 32 + llm.probe_cells()
        # what the sequence saw is held on the device or in the host store, once, at its own position
        held = st.positions.tolist() + st.host_positions.tolist()
        assert len(held) == len(set(held)) and all(0 <= p < st.n_seen for p in held)


def test_a_question_brings_back_the_spilled_entries_it_ranks_above_the_kept_ones(tiny_model):
    """recall_for(question): the spilled entries come back beside the kept ones, the question probe ranks them all
    and the policy keeps its budget; what came back is counted, what lost went back to the store, nothing is lost
    and nothing is fed (the position of the next token stays)."""
    llm = make(tiny_model, budget=24)
    tokens = llm.tokenize(PROMPT)
    llm.eval(tokens)
    st0 = llm.kv_state()
    n = llm.recall_for(QUESTION)
    st = llm.kv_state()
    came_back = set(st.positions.tolist()) - set(st0.positions.tolist())
    assert n == st.n_recalled == len(came_back) > 0 and st.n_cells <= 24
    assert came_back <= set(st0.host_positions.tolist())
    assert sorted(st.positions.tolist() + st.host_positions.tolist()) == list(range(len(tokens)))
    assert st.n_seen == st0.n_seen and next_position(llm, 0) == len(tokens)
    # a question always finds the same entries from the same state (deterministic)
    other = make(tiny_model, budget=24)
    other.eval(tokens)
    other.recall_for(QUESTION)
    assert other.kv_state().positions.tolist() == st.positions.tolist()


def test_snapshots_and_session_bytes_carry_the_host_store(tiny_model):
    llm = make(tiny_model)
    llm.eval(llm.tokenize(PROMPT))
    snap = llm.save_state()
    st = llm.kv_state()
    assert snap.n_host == len(st.host_positions) > 0 and snap.nbytes > st.host_bytes
    again = type(snap).from_bytes(snap.to_bytes())
    other = make(tiny_model)
    other.load_state(again)
    assert other.kv_state().host_positions.tolist() == st.host_positions.tolist()
    assert host_store_rows(other, 0) == host_store_rows(llm, 0)
    q = llm.tokenize(QUESTION, add_bos=False)
    assert other.generate(q, max_tokens=6, temperature=0, reset=False) == \
        llm.generate(q, max_tokens=6, temperature=0, reset=False)


def host_values(llm):
    """What the store puts back: positions, and per entry its F16 values as float32 (the tiny model's cache is F16)."""
    positions, blob = host_store_rows(llm, 0)
    return list(positions), np.frombuffer(blob, dtype=np.float16).astype(np.float32).reshape(len(positions), -1)


def assert_within_q8_0_rounding(exact, rounded):
    """Each value within half a q8_0 step of its 32-value block (the block's largest magnitude / 127), plus the F16
    rounding of the block's scale and of the value itself."""
    a, b = exact.reshape(len(exact), -1, 32), rounded.reshape(len(rounded), -1, 32)
    amax = np.abs(a).max(axis=-1, keepdims=True)
    assert np.all(np.abs(a - b) <= amax / 127 / 2 + amax * 2e-3)
    assert not np.array_equal(a, b)  # rounded: not the same bytes


def test_a_q8_0_host_copy_keeps_about_half_the_bytes_and_puts_back_what_it_kept(tiny_model):
    """recall_type='q8_0': the store keeps ggml's q8_0 blocks of the F16 rows (34 bytes per 32 values); what comes
    back is the rows that dequantizing gives, each value within q8_0's rounding of the one that left, and a recalled
    cell holds exactly those bytes."""
    from h2o_local import _engine

    exact, q8 = make(tiny_model, n_ctx=512), make(tiny_model, recall_type="q8_0", n_ctx=512)
    tokens = exact.tokenize(PROMPT)
    exact.eval(tokens)
    q8.eval(tokens)
    size = entry_bytes(exact)
    n_host = len(q8.kv_state().host_positions)
    assert q8.host_entry_bytes == _engine.q8_0_entry_bytes(size) == size // 64 * 34 and exact.host_entry_bytes == size
    assert q8.kv_state().host_bytes == n_host * q8.host_entry_bytes and n_host > 0
    assert q8.kv_state().host_bytes / exact.kv_state().host_bytes == pytest.approx(34 / 64)
    positions, rows = host_values(q8)
    exact_positions, exact_rows = host_values(exact)
    assert positions == exact_positions  # the store's encoding does not change what is evicted
    assert_within_q8_0_rounding(exact_rows, rows)

    q8.set_policy(default_policy(400))  # room for everything: the next prompt brings every entry back
    q8.eval(q8.tokenize(QUESTION, add_bos=False))
    assert len(q8.kv_state().host_positions) == 0
    back = np.frombuffer(cell_bytes(q8, 0, positions), dtype=np.float16).astype(np.float32)
    np.testing.assert_array_equal(back.reshape(rows.shape), rows)


def test_a_saved_store_loads_into_either_encoding(tiny_model):
    """A session's store keeps its entries as saved and is converted on load to the loading Llama's recall_type:
    q8_0 -> q8_0 unchanged, q8_0 -> rows (the dequantized rows), rows -> q8_0 (within q8_0's rounding)."""
    q8, exact = make(tiny_model, recall_type="q8_0"), make(tiny_model)
    tokens = q8.tokenize(PROMPT)
    q8.eval(tokens)
    exact.eval(tokens)
    saved_q8 = type(q8.save_state()).from_bytes(q8.save_state().to_bytes())
    saved_exact = type(exact.save_state()).from_bytes(exact.save_state().to_bytes())

    for recall_type, saved, expect in ((None, saved_q8, q8), ("q8_0", saved_q8, q8), ("q8_0", saved_exact, None)):
        other = make(tiny_model, recall_type=recall_type)
        other.load_state(saved)
        st = other.kv_state()
        assert st.host_bytes == len(st.host_positions) * other.host_entry_bytes > 0
        if expect is not None:
            assert host_store_rows(other, 0) == host_store_rows(expect, 0)
        else:
            assert_within_q8_0_rounding(host_values(exact)[1], host_values(other)[1])


def test_what_recall_cannot_do_is_refused_clearly(tiny_model):
    with pytest.raises(ValueError, match="recall_type must be None"):
        make(tiny_model, recall_type="q4_0")
    with pytest.raises(ValueError, match="recall_type 'q8_0' quantizes F16 rows; this cache keeps f32/f32"):
        make(tiny_model, recall_type="q8_0", kv_f32=True)
    with pytest.raises(ValueError, match="question probe"):
        Llama(tiny_model, policy="h2o", budget=24, recall=True)
    with pytest.raises(ValueError, match="question probe|per-head"):
        Llama(tiny_model, policy=resolve("h2o", 24, per_head=True), recall=True)
    llm = make(tiny_model)
    with pytest.raises(ValueError, match="question probe"):
        llm.set_policy("h2o", 24)
    assert llm.generate("still usable", max_tokens=3, temperature=0)
    with pytest.raises(ValueError):
        llm.set_recall(-1)
    llm.set_recall(False)
    llm.eval(llm.tokenize(PROMPT))
    assert llm.kv_state().n_spilled == 0 and len(llm.kv_state().host_positions) == 0


def test_a_sequence_takes_its_policy_and_recall_together_checked_once(tiny_model):
    """`configure(seq, policy=, recall=)`: a slot whose last conversation recalled can take a policy without a
    question probe and recall off in one call (each alone would be refused in one of the two orders); a combination
    that cannot recall is refused with nothing changed."""
    llm = make(tiny_model, n_seq_max=2, kv_unified=False)
    llm.configure(1, policy=default_policy(24), recall=True)
    plain = resolve("h2o", 24)
    with pytest.raises(ValueError, match="question probe"):
        llm.set_policy(plain, seq_id=1)  # recall stays on for the slot: refused
    with pytest.raises(ValueError, match="question probe"):
        llm.configure(1, policy=plain, recall=True)
    assert llm.policy_of(1).label == default_policy(24).label  # unchanged
    llm.configure(1, policy=plain, recall=False, keep=3)
    assert llm.policy_of(1).label == plain.label and llm.kv_state(1).n_keep == 3
    llm.eval(llm.tokenize(PROMPT), seq_id=1)
    st = llm.kv_state(1)
    assert st.n_evicted > 0 and st.n_spilled == 0 and st.positions.tolist()[:3] == [0, 1, 2]
    llm.configure(1)  # the Llama's own policy and recall again
    assert llm.policy_of(1).label == llm.policy.label


def test_the_store_cap_drops_the_oldest_text_first(tiny_model):
    llm = make(tiny_model, budget=16, recall=20)
    tokens = llm.tokenize(PROMPT)
    llm.eval(tokens)
    st = llm.kv_state()
    assert len(st.host_positions) == 20 and st.n_dropped == len(tokens) - 16 - 20
    evicted = sorted(set(range(len(tokens))) - set(st.positions.tolist()))
    assert sorted(st.host_positions.tolist()) == evicted[-20:]


# ------------------------------------------------------------------------------------------ where a conversation lives
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tiny_model import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("recall") / "chat.gguf", chat_template=CHATML,
                                n_ctx_train=4096))


def test_a_chat_session_recalls_and_its_file_carries_the_store(chat_model, tmp_path):
    from h2o_local.chat_session import ChatSession

    def session():
        llm = Llama(chat_model, policy=default_policy(48), n_threads=1, keep="system", recall=True)
        return ChatSession(llm, system="You are tiny.", max_tokens=12, temperature=0)

    s = session()
    "".join(s.send(PROMPT))
    stats = s.stats()
    assert stats["host_entries"] > 0 and stats["kv_entries"] <= 48 and stats["host_bytes"] > 0
    s.save(tmp_path / "chat.session")
    expected = "".join(s.send(QUESTION))
    other = session()
    other.load(tmp_path / "chat.session")
    assert other.stats()["host_entries"] == stats["host_entries"]
    assert "".join(other.send(QUESTION)) == expected
    assert other.stats()["recalled"] == s.stats()["recalled"]


def test_the_cli_takes_recall_and_the_server_reports_the_store(chat_model):
    import argparse

    from h2o_local.cli.common import add_model_args, load_llama

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    llm = load_llama(ap, ap.parse_args(["--model", chat_model, "--budget", "48", "--recall", "500"]))
    assert llm.recall == 500
    assert load_llama(ap, ap.parse_args(["--model", chat_model, "--budget", "48", "--recall"])).recall == 4096
    q8 = load_llama(ap, ap.parse_args(["--model", chat_model, "--budget", "48", "--recall", "--recall-type", "q8_0"]))
    assert q8.recall_type == "q8_0" and q8.host_entry_bytes < entry_bytes(q8)
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", chat_model, "--recall-type", "q4_0"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", chat_model, "--recall", "-3"])

    from h2o_local.server import create_app, serve_in_background
    import openai

    llm = Llama(chat_model, policy=default_policy(48), n_seq_max=2, kv_unified=False, n_threads=1, keep="system",
                recall=True)
    with serve_in_background(create_app(llm, model_id="tiny")) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": PROMPT}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        kv = first.usage.model_extra["kv_cache"]
        assert kv["host"] > 0 and kv["kept"] <= 48
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": QUESTION}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 0  # the saved conversation (and its store) went on
        assert second.usage.model_extra["kv_cache"]["kept"] <= 48


# ------------------------------------------------------------------------------------------ a long random session
from hypothesis import settings as h_settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402


class RecallSession(RuleBasedStateMachine):
    """Prompts, answers, questions, saves and loads in any order: the device never holds more than the budget (and
    one batch and the probe while it reads), and every position seen is on the device or in the host store, once."""

    model = None
    recall_type = None
    BUDGET, CAP = 16, 60

    def __init__(self):
        super().__init__()
        self.llm = Llama(self.model, policy=default_policy(self.BUDGET), n_batch=32, recall=self.CAP, n_threads=1,
                         recall_type=self.recall_type)
        self.saved = []

    @rule(tokens=st.lists(st.integers(3, 255), min_size=1, max_size=70))
    def prompt(self, tokens):
        self.llm.eval(tokens)

    @rule(n=st.integers(1, 8))
    def answer(self, n):
        if self.llm.kv_state().n_seen:  # an answer needs a prompt before it
            self.llm.generate([], max_tokens=n, temperature=0, reset=False)

    @rule(tokens=st.lists(st.integers(3, 255), min_size=1, max_size=20))
    def ask(self, tokens):
        if self.llm.kv_state().n_seen:
            self.llm.recall_for(tokens)

    @rule()
    def save(self):
        self.saved.append(type(self.llm.save_state()).from_bytes(self.llm.save_state().to_bytes()))

    @rule(data=st.data())
    def load(self, data):
        if self.saved:
            self.llm.load_state(data.draw(st.sampled_from(self.saved)))

    @invariant()
    def bounded(self):
        s = self.llm.kv_state()
        assert s.n_cells <= self.BUDGET and s.peak_cells <= self.BUDGET + 32 + self.llm.probe_cells()
        held = s.positions.tolist() + s.host_positions.tolist()
        assert len(held) == len(set(held)) and all(0 <= p < s.n_seen for p in held)
        assert len(s.host_positions) <= self.CAP
        assert s.host_bytes == len(s.host_positions) * self.llm.host_entry_bytes


@pytest.mark.parametrize("recall_type", [None, "q8_0"])
def test_a_long_random_session_stays_bounded(tiny_model, recall_type):
    RecallSession.model = tiny_model
    RecallSession.recall_type = recall_type
    run = RecallSession.TestCase
    run.settings = h_settings(max_examples=15, stateful_step_count=25, deadline=None, derandomize=True)
    run().runTest()


def test_a_server_conversation_chooses_recall_for_itself(chat_model):
    from h2o_local.server import create_app, serve_in_background
    import httpx

    llm = Llama(chat_model, policy=default_policy(48), n_seq_max=2, kv_unified=False, n_threads=1)
    with serve_in_background(create_app(llm, model_id="tiny")) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
        plain = httpx.post(url, json=body, timeout=60).json()["usage"]["kv_cache"]
        assert "host" not in plain  # the server does not recall
        mine = httpx.post(url, json={**body, "kv_cache": {"recall": True}}, timeout=60).json()["usage"]["kv_cache"]
        assert mine["host"] > 0 and mine["kept"] <= 48
        refused = httpx.post(url, json={**body, "kv_cache": {"recall": True, "policy": "sink"}}, timeout=60)
        assert refused.status_code == 400 and "question probe" in refused.json()["error"]["message"]
    llm = Llama(chat_model, policy=default_policy(48), n_seq_max=2, kv_unified=False, n_threads=1, recall=True)
    with serve_in_background(create_app(llm, model_id="tiny")) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        on = httpx.post(url, json=body, timeout=60).json()["usage"]["kv_cache"]
        assert on["host"] > 0
        sink = httpx.post(url, json={**body, "kv_cache": {"policy": "sink"}}, timeout=60)  # cannot recall: served
        assert sink.status_code == 200 and "host" not in sink.json()["usage"]["kv_cache"]
        off = httpx.post(url, json={**body, "kv_cache": {"recall": False}}, timeout=60).json()["usage"]["kv_cache"]
        assert "host" not in off


def test_recall_ranks_what_comes_back_as_an_independent_numpy_reference_does(tiny_model):
    """With room for one page, recall puts every spilled entry back (bit for bit: the prompt fitted, so its K and V
    are a full cache's), ranks all entries by the new question's lift over each entry's baseline, and the policy keeps
    its budget. The same ranking computed from a full cache's attention, read independently (tests/engine/test_probe.py's
    rule), chooses the same entries with the same probe scores."""
    from h2o_local import TOVA

    from test_probe import BUDGET, PROMPT, reference_keep, reference_question_lift

    n_q = 8
    question = list(range(130, 130 + n_q))
    llm = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="question", question=n_q), n_ctx=512, n_batch=512,
                n_threads=1, recall=1000)
    llm.eval(PROMPT)  # fits: decoded whole (its last n_q tokens on their own), probed, then evicted to the budget
    assert len(llm.kv_state().host_positions) == len(PROMPT) - BUDGET
    kept_before = llm.kv_state().positions.tolist()
    assert llm.recall_for(question) > 0

    ref = reference_question_lift(tiny_model, n_q, question)

    st = llm.kv_state()
    keep = reference_keep(ref, 0, 1, BUDGET)
    assert st.positions.tolist() == keep != kept_before  # the question chose other entries than the prompt's did
    assert_values_close(st.probe_scores, ref[keep], device=approximate(llm), cpu_rtol=1e-4, cpu_atol=1e-6)
    assert sorted(st.host_positions.tolist()) == sorted(set(range(len(PROMPT))) - set(keep))


def page_tournament(reference, tokens, n, kept, waiting, page, n_q, base, budget):
    """The recall step's tournament in NumPy: `waiting` (host positions, in the order they are probed) a page at a
    time beside the kept entries; the question's attention over just those entries relative to each entry's baseline
    ranks them and the budget keeps the best (the policy's sinks 0, recent 1). The kept positions after the last
    page, and that round's lifts by position (-inf elsewhere: a device may swap a near tie there)."""
    from test_probe import reference_keep

    for a in range(0, len(waiting), page):
        entries = sorted(set(kept) | set(waiting[a:a + page]))
        visible = np.ones((len(tokens), len(tokens)), dtype=bool)
        visible[n:, :n] = False
        visible[n:, entries] = True
        sums = sum(p[:, n:, :n].sum(axis=1) for p in reference.attention(tokens, visible)).T / n_q
        lift = (sums[entries] / base(entries)).max(axis=1)
        kept = [entries[i] for i in reference_keep(lift, 0, 1, budget)]
    last_round = np.full(n, -np.inf)
    last_round[entries] = lift
    return kept, last_round


def test_a_recall_over_many_pages_equals_a_numpy_reference_of_its_page_tournament(tiny_model):
    """With room for one page of 16 entries beside the kept ones, the spilled entries come back a page at a time, in
    position order: each page is ranked together with what the earlier pages left, by the question's attention over
    just those entries (a NumPy forward pass whose question sees only them) relative to each entry's baseline, and the
    policy keeps its budget. The reference plays the same tournament (each entry's baseline shrunk towards the mean of
    the entries held in its round) and ends with the same entries and scores."""
    from attention_reference import LlamaReference
    from h2o_local import TOVA

    from test_probe import BUDGET, PROMPT, question_baseline

    n_q, page = 8, 16
    question = list(range(130, 130 + n_q))
    policy = TOVA(budget=BUDGET, probe="question", question=n_q, recall_pages=0)  # every page
    whole = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=512, n_threads=1, recall=1000, kv_f32=True)
    whole.eval(PROMPT)  # decoded whole: every entry's K and V are a full cache's, as the reference computes them
    paged = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=page, n_threads=1, recall=1000, kv_f32=True)
    paged.load_state(whole.save_state())
    kept = paged.kv_state().positions.tolist()
    waiting = sorted(paged.kv_state().host_positions.tolist())
    assert len(waiting) > 4 * page
    paged.recall_for(question)

    base = question_baseline(tiny_model, n_q, kv_f32=True)
    reference = LlamaReference(tiny_model)
    n = len(PROMPT)
    tokens = PROMPT + question
    kept, last_round = page_tournament(reference, tokens, n, kept, waiting, page, n_q, base, BUDGET)

    st = paged.kv_state()
    assert_same_choice(st.positions, kept, last_round, device=approximate(paged))
    assert_values_close(st.probe_scores, last_round[st.positions], device=approximate(paged), cpu_rtol=1e-4,
                        cpu_atol=1e-6)
    assert sorted(st.host_positions.tolist()) == sorted(set(range(n)) - set(st.positions.tolist()))
    assert st.n_recalled == len(set(st.positions.tolist()) - set(whole.kv_state().positions.tolist())) > 0
