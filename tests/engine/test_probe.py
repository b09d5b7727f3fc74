"""Probes (`probe="question" | "repeat" | "catalyst"`, labels `+qN`, `+repeat`, `+catalyst`): before a prompt's
eviction, tokens decoded after what the cache holds rank it by their attention over what the entry usually gets
(the lift, in the head where it is largest; the repeat probe's pieces keep the largest), then are removed. A probe must leave no trace, and it must keep exactly
what its ranking says: checked against the attention read independently from a full cache."""
import numpy as np
import pytest

from device_tolerance import assert_logits_close, assert_same_choice, assert_values_close, approximate
from h2o_local import H2O, TOVA, KeyDiff, Llama, SnapKV, _engine, policies
from h2o_local.policies import PythonRanked
from engine_view import position_range, probes_ride

PROMPT = list(range(5, 125))  # 120 tokens: pieces of 16 beside a budget of 24
BUDGET = 24


@pytest.mark.parametrize("policy", [TOVA(budget=BUDGET, probe="question", question=4),
                                    SnapKV(budget=BUDGET, query_window=4, probe="question", question=8),
                                    H2O(budget=BUDGET, probe="catalyst"), TOVA(budget=BUDGET, probe="repeat", pool=3)])
def test_a_probe_leaves_no_trace_in_a_bounded_prefill(tiny_model, policy):
    llm = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1)
    llm.eval(PROMPT)
    st = llm.kv_state()
    assert st.n_seen == len(PROMPT) and st.n_evicted == len(PROMPT) - BUDGET
    assert st.positions.max() == len(PROMPT) - 1 and len(st.positions) == BUDGET  # no probe position is held
    assert st.tokens.tolist() == [PROMPT[p] for p in st.positions]               # nor a probe token
    lo, hi = position_range(llm, 0)
    assert (lo, hi) == (st.positions.min(), st.positions.max())  # llama.cpp holds no probe cell either
    assert st.peak_cells <= BUDGET + 16 + llm.probe_cells(policy)
    assert (st.probe_scores[:-1] > 0).all()  # every prompt entry was probed
    # the next token goes on at the prompt's end
    llm.generate([], max_tokens=3, temperature=0, reset=False)
    assert llm.kv_state().n_seen == len(PROMPT) + 2


def test_the_probe_changes_what_a_piece_keeps(tiny_model):
    kept = []
    for policy in (TOVA(budget=BUDGET), TOVA(budget=BUDGET, probe="question", question=6)):
        llm = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1)
        llm.eval(PROMPT)
        kept.append(llm.kv_state().positions.tolist())
    assert kept[0] != kept[1]


def test_the_last_logits_are_the_prompt_s_own(tiny_model):
    """The probe's decodes do not leave their logits: after the prefill they are the prompt's last token's."""
    llm = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="catalyst"), n_batch=16, n_threads=1)
    llm.eval(PROMPT)
    probed = llm.last_logits().copy()
    full = Llama(tiny_model, n_ctx=256, n_threads=1)
    full.eval(PROMPT[:-BUDGET])  # the last piece's logits come from its own decode: only its context differs
    assert probed.shape == full.last_logits().shape
    again = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="catalyst"), n_batch=16, n_threads=1)
    again.eval(PROMPT)
    np.testing.assert_array_equal(again.last_logits(), probed)  # deterministic
    assert not np.array_equal(probed, _after_probe_logits(tiny_model))  # and not the probe's last token's


def _after_probe_logits(model):
    llm = Llama(model, n_ctx=256, n_threads=1)
    llm.eval(PROMPT + llm.tokenize(_engine.PROBE_TEXTS["catalyst"], add_bos=False))
    return llm.last_logits()


# --- what a probe keeps, against the attention read from a full cache ----------------------------------------------

def reference_probe_scores(model, probes):
    """Per prompt entry, from a full cache read independently: each probe's column sums over the prompt per probe
    query, over the entry's baseline (its attention per query so far, shrunk towards the head's mean by 128
    pseudo-queries, plus 5% of that mean), in the head where that lift is largest; the largest over probes."""
    best = np.zeros(len(PROMPT))
    for probe in probes:
        llm = Llama(model, n_ctx=512, export_scores=True, n_threads=1)
        llm.eval(PROMPT)
        st = llm.kv_state()
        per_query = st.head_scores / st.queries[:, None]
        mean = per_query.mean(axis=0)
        base = (st.head_scores + 128 * mean) / (st.queries[:, None] + 128) + 0.05 * mean
        llm.eval(probe)
        pos, sums = llm.last_scores()
        assert pos[: len(PROMPT)].tolist() == list(range(len(PROMPT)))
        best = np.maximum(best, (sums[: len(PROMPT)] / len(probe) / base).max(axis=1))
    return best


def question_baseline(model, n_q, **options):
    """A function of the entries the cache holds when a question is probed, giving [entry, head] for them: the
    attention each entry usually gets per query, the baseline a question's lift is measured against. It leaves out
    the prompt's last n_q tokens (its question window, decoded on their own), and is shrunk towards the head's mean
    over the held entries by 128 pseudo-queries, floored at 5% of that mean."""
    before = Llama(model, n_ctx=512, export_scores=True, n_threads=1, **options)
    before.eval(PROMPT[:-n_q])
    st0 = before.kv_state()
    full = Llama(model, n_ctx=512, export_scores=True, n_threads=1, **options)
    full.eval(PROMPT)
    queries = full.kv_state().queries
    per_query = np.zeros((len(PROMPT), st0.head_scores.shape[1]))
    per_query[:-n_q] = st0.head_scores / st0.queries[:, None]

    def base(entries):
        mean = per_query[entries].mean(axis=0)
        return (per_query[entries] * queries[entries, None] + 128 * mean) / (queries[entries, None] + 128) + 0.05 * mean

    return base


def reference_question_lift(model, n_q, question):
    """Per prompt entry, from a full cache read independently: `question`'s attention per query over the entry's
    baseline, in the head where that lift is largest."""
    full = Llama(model, n_ctx=512, export_scores=True, n_threads=1)
    full.eval(PROMPT)
    full.eval(question)
    sums = full.last_scores()[1][: len(PROMPT)] / len(question)
    return (sums / question_baseline(model, n_q)(list(range(len(PROMPT))))).max(axis=1)


def reference_keep(scores, sinks, recent, n_keep_total):
    """Indices kept: the first `sinks`, the last `recent`, and the best-scored of the rest (ties: the older)."""
    n = len(scores)
    middle = np.arange(sinks, n - recent)
    order = middle[np.argsort(-scores[middle], kind="stable")]
    heavy = n_keep_total - sinks - recent
    return sorted(set(range(sinks)) | set(range(n - recent, n)) | set(order[:heavy].tolist()))


def probe_tokens(llm, source):
    text = _engine.PROBE_TEXTS[source]
    if source == "catalyst":
        return [llm.tokenize(text, add_bos=False)]
    prefix = llm.tokenize(text, add_bos=False)
    return [prefix + PROMPT[a:a + 16] for a in range(0, len(PROMPT), 16)]  # the entries repeated, a batch at a time


@pytest.mark.parametrize("source", ["catalyst", "repeat"])
def test_a_probe_keeps_what_its_attention_ranks_first(tiny_model, source):
    policy = H2O(budget=BUDGET, sinks=2, probe=source)
    llm = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=16, n_threads=1)  # the prompt fits: probed at its end
    llm.eval(PROMPT)
    ref = reference_probe_scores(tiny_model, probe_tokens(llm, source))
    st = llm.kv_state()
    keep = reference_keep(ref, policy.sinks, policy.recent, BUDGET)
    assert_same_choice(st.positions, keep, ref, device=approximate(llm))
    assert_values_close(st.probe_scores, ref[st.positions], device=approximate(llm), cpu_rtol=1e-4, cpu_atol=1e-7)


def test_the_cache_after_a_probe_equals_the_same_ranking_given_directly(tiny_model):
    """The probe's cells, positions and logits are gone: a run ranked directly by the probe's reference scores
    (a Python scorer returning them, no probe decoded) holds the same entries and generates the same tokens."""
    probed = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="catalyst"), n_ctx=512, n_threads=1)
    probed.eval(PROMPT)
    ref = reference_probe_scores(tiny_model, probe_tokens(probed, "catalyst"))

    class Given(PythonRanked):
        name = "given"

        def rank(self, total, head, queries):
            return ref[: len(total)]

    direct = Llama(tiny_model, policy=Given(budget=BUDGET, heavy=BUDGET - 1, recent=1), n_ctx=512, n_threads=1)
    direct.eval(PROMPT)
    assert probed.kv_state().positions.tolist() == direct.kv_state().positions.tolist()
    assert_logits_close(probed.last_logits(), direct.last_logits(), device=approximate(probed), cpu_atol=1e-5,
                        cpu_rtol=1e-5)
    for llm in (probed, direct):  # what follows evicts nothing: only the caches' contents decide
        llm.set_policy("local", 100)
    a = probed.generate([], max_tokens=6, temperature=0, reset=False)
    b = direct.generate([], max_tokens=6, temperature=0, reset=False)
    assert a == b


def test_compress_runs_a_query_agnostic_probe_and_snapshots_keep_its_scores(tiny_model):
    llm = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="catalyst"), n_ctx=512, n_threads=1)
    llm.set_policy(TOVA(budget=200, probe="catalyst"))  # nothing evicted yet; the probe's baseline accumulates
    llm.eval(PROMPT)
    llm.set_policy(TOVA(budget=BUDGET, probe="catalyst"))
    llm.compress()
    st = llm.kv_state()
    ref = reference_probe_scores(tiny_model, probe_tokens(llm, "catalyst"))
    assert st.positions.tolist() == reference_keep(ref, 0, 1, BUDGET)
    snap = llm.save_state()
    other = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="catalyst"), n_ctx=512, n_threads=1)
    other.load_state(type(snap).from_bytes(snap.to_bytes()))
    back = other.kv_state()
    assert back.tokens.tolist() == st.tokens.tolist()
    np.testing.assert_array_equal(back.probe_scores, st.probe_scores)


def test_the_repeat_probe_needs_room_and_says_so(tiny_model):
    llm = Llama(tiny_model, n_ctx=130, n_batch=16, export_scores=True, n_threads=1)
    llm.eval(PROMPT)
    llm.set_policy(TOVA(budget=BUDGET, probe="repeat"))
    with pytest.raises(ValueError, match="no room for the repeat probe"):
        llm.compress()
    assert llm.kv_state().n_cells == len(PROMPT)  # left as it was
    with pytest.raises(ValueError, match="probe"):  # a probe that can never fit is refused at once
        Llama(tiny_model, n_ctx=130, n_batch=128, export_scores=True, n_threads=1).set_policy(
            TOVA(budget=BUDGET, probe="repeat"))
    # and so is a Llama made with one whose cells cannot hold it (it failed at the first long prompt)
    with pytest.raises(ValueError, match="probe's .* cells leave no room in the context's 130 cells"):
        Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="repeat"), n_ctx=130, n_batch=128, n_threads=1)


def test_pool_ranks_an_entry_by_its_best_neighbour():
    total = [0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    args = (list(range(8)), total, np.zeros((8, 1), np.float32), [1] * 8)
    assert _engine.Policy("h2o", 3, heavy=2, recent=1).select(*args) == [2, 6, 7]
    # pooled over 3, entries 1, 2 and 3 all score 9: the two older are kept
    assert _engine.Policy("h2o", 3, heavy=2, recent=1, pool=3).select(*args) == [1, 2, 7]
    # with a probe, the probe's scores rank first and the policy's own scores break ties
    cpp = _engine.Policy("h2o", 3, heavy=2, recent=1, probe="catalyst")
    keep = cpp.select(list(range(6)), [5, 4, 3, 2, 1, 0], np.zeros((6, 1), np.float32), [1] * 6,
                      probe=[0.1, 0.1, 0.9, 0.2, 0.2, 0.0])
    assert keep == [2, 3, 5]


def test_follow_keeps_what_comes_after_a_found_entry():
    # a key at 1 that a probe found, its value at 3-5 (scored low), a distractor at 7
    total = [0.0, 9.0, 0.0, 0.1, 0.1, 0.1, 0.0, 2.0, 0.0, 0.0]
    args = (list(range(10)), total, np.zeros((10, 1), np.float32), [1] * 10)
    reference = lambda back, ahead: [max(total[max(0, i - back): i + ahead + 1]) for i in range(10)]
    for pool, follow in ((1, 4), (3, 4), (5, 1)):
        scored = reference(max(pool // 2, follow), pool // 2)
        expected = sorted(sorted(range(9), key=lambda i: (-scored[i], i))[:5]) + [9]
        assert _engine.Policy("h2o", 6, heavy=5, recent=1, pool=pool, follow=follow).select(*args) == expected
    # follow 4: the key and the four entries after it (its value) rank first
    assert _engine.Policy("h2o", 6, heavy=5, recent=1, follow=4).select(*args) == [1, 2, 3, 4, 5, 9]
    # centred pool 3 only: the value's last entries lose to the distractor's neighbours
    assert _engine.Policy("h2o", 6, heavy=5, recent=1, pool=3).select(*args) == [0, 1, 2, 6, 7, 9]


def test_block_keeps_whole_blocks_of_positions():
    """block=B: every entry ranks by the best (pooled) score of its block of B positions (position // B), so the
    heavy entries come in whole blocks; against a NumPy reference over random scores and positions with gaps."""
    rng = np.random.default_rng(1)
    for block, pool, follow in ((4, 1, 0), (4, 3, 2), (8, 1, 0), (3, 5, 0)):
        for _ in range(20):
            n, heavy = 30, 10
            positions = np.sort(rng.choice(80, size=n, replace=False)).tolist()
            total = rng.random(n).astype(np.float32)
            back, ahead = max(pool // 2, follow), pool // 2
            pooled = [max(total[max(0, i - back): i + ahead + 1]) for i in range(n)]
            blocked = [max(pooled[j] for j in range(n) if positions[j] // block == positions[i] // block)
                       for i in range(n)]
            expected = sorted(sorted(range(n - 1), key=lambda i: (-blocked[i], i))[:heavy]) + [n - 1]
            cpp = _engine.Policy("h2o", heavy + 1, heavy=heavy, recent=1, pool=pool, follow=follow, block=block)
            assert cpp.select(positions, total, np.zeros((n, 1), np.float32), [1] * n) == expected
    # a key found at 5 whose value runs to 11: follow 2 keeps 5-7, blocks of 4 keep 4-7 and 8-11 with it
    total = [0.0] * 16
    total[5], total[14] = 9.0, 1.0
    args = (list(range(16)), total, np.zeros((16, 1), np.float32), [1] * 16)
    assert _engine.Policy("h2o", 9, heavy=8, recent=1, follow=4, block=4).select(*args) == list(range(4, 12)) + [15]


def test_a_probe_share_leaves_the_rest_of_the_heavy_entries_to_the_scorer():
    """probe_share=P: round(P% of heavy) entries by the probe's ranking (the scorer's breaking ties), then the rest by
    the scorer's own ranking among the others; against a NumPy reference over random scores."""
    rng = np.random.default_rng(0)
    n, heavy, recent = 40, 12, 4
    for share in (0, 25, 50, 75, 100):
        for _ in range(20):
            total = rng.random(n).astype(np.float32)
            probe = (rng.random(n) + 0.01).astype(np.float32)
            probe[rng.random(n) < 0.1] = 0.0  # unjudged entries (generated tokens) rank first of all
            cand = range(n - recent)
            by_probe = sorted(cand, key=lambda i: (-(np.inf if probe[i] == 0 else probe[i]), -total[i], i))
            n_first = (heavy * share + 50) // 100
            first = by_probe[:n_first]
            rest = sorted((i for i in cand if i not in first), key=lambda i: (-total[i], i))[:heavy - n_first]
            expected = sorted(first + rest) + list(range(n - recent, n))
            cpp = _engine.Policy("tova", heavy + recent, heavy=heavy, recent=recent, probe="catalyst",
                                 probe_share=share)
            got = cpp.select(list(range(n)), total.tolist(), np.zeros((n, 1), np.float32), [1] * n, probe=probe.tolist())
            assert got == expected, share
    assert policies.parse("tova-256+q32+p9+f12+m50+r32") == TOVA(budget=256, probe="question", question=32, pool=9,
                                                                 follow=12, probe_share=50, recent=32)
    assert policies.parse("tova-256+q32+m50").label == "tova-256+q32+m50"
    with pytest.raises(ValueError, match="needs a probe"):
        TOVA(budget=64, probe_share=50)
    with pytest.raises(ValueError, match="percent"):
        TOVA(budget=64, probe="question", probe_share=101)


def test_labels_and_refusals():
    assert policies.parse("tova-256+s4+q16") == TOVA(budget=256, sinks=4, probe="question", question=16)
    assert TOVA(budget=256, sinks=4, probe="question", question=16).label == "tova-256+s4+q16"
    for label in ("tova-256+repeat", "snapkv-256+catalyst+p7", "h2o-128+p5", "tova-256+s4+q32+r192",
                  "tova-256+q32+p9+f12+r32"):
        assert policies.parse(label).label == label
    assert TOVA(budget=64, probe="question").question == _engine.DEFAULT_QUESTION_TOKENS
    with pytest.raises(ValueError, match="takes no probe"):
        policies.parse("local-64+q8")
    with pytest.raises(ValueError, match="takes no probe"):
        KeyDiff(budget=64, probe="repeat")
    with pytest.raises(ValueError, match="probe must be one of"):
        TOVA(budget=64, probe="summary")
    with pytest.raises(ValueError, match="needs probe='question'"):
        TOVA(budget=64, question=8)

    class Mean(PythonRanked):
        name = "mean"

    with pytest.raises(ValueError, match="takes no probe, pool, follow"):
        Mean(budget=64, probe="catalyst")


def test_the_question_probe_s_baseline_leaves_out_the_question(tiny_model):
    """A prompt that ends with its question: the question's tokens are decoded on their own and left out of the
    baseline (each entry's attention per query is that of the other queries), then re-decoded as the probe."""
    n_q = 8
    llm = Llama(tiny_model, policy=TOVA(budget=BUDGET, probe="question", question=n_q), n_ctx=512, n_threads=1)
    llm.eval(PROMPT)
    ref = reference_question_lift(tiny_model, n_q, PROMPT[-n_q:])
    st = llm.kv_state()
    keep = reference_keep(ref, 0, 1, BUDGET)
    assert_same_choice(st.positions, keep, ref, device=approximate(llm))
    assert_values_close(st.probe_scores, ref[st.positions], device=approximate(llm), cpu_rtol=1e-4, cpu_atol=1e-6)


@pytest.mark.parametrize("unified", [True, False])
def test_probes_in_a_batch_need_one_probe_s_cells_per_stream(tiny_model, unified):
    """Sequences of a batch are probed and evicted one at a time: the default context holds every budget, one batch
    and one probe (per stream), and a batch of long prompts feeds within it."""
    policy = TOVA(budget=BUDGET, recent=4, probe="repeat", pool=3)
    llm = Llama(tiny_model, policy=policy, n_seq_max=3, kv_unified=unified, n_batch=16, n_threads=1)
    llm.eval_batch({0: PROMPT, 1: PROMPT[::-1], 2: PROMPT[10:]})
    for seq in range(3):
        st = llm.kv_state(seq)
        assert st.n_cells == BUDGET and st.peak_cells <= BUDGET + 16 + llm.probe_cells(policy)
    assert len(llm.generate_batch([PROMPT, PROMPT[::-1], PROMPT[10:]], max_tokens=3, temperature=0)) == 3


def test_generation_runs_no_probe(tiny_model):
    """Single tokens (generation) are not probed: their entries stay unjudged, the prompt's probe scores stay."""
    llm = Llama(tiny_model, policy=TOVA(budget=BUDGET, recent=4, probe="catalyst"), n_batch=16, n_threads=1)
    llm.eval(PROMPT)
    before = dict(zip(llm.kv_state().positions.tolist(), llm.kv_state().probe_scores.tolist()))
    for t in (7, 8, 9):
        llm.eval([t])
    st = llm.kv_state()
    assert st.peak_cells <= BUDGET + 16 + llm.probe_cells()
    assert st.probe_scores[-3:].tolist() == [0.0, 0.0, 0.0]  # the three generated entries, kept and unjudged
    assert all(before[p] == s for p, s in zip(st.positions.tolist(), st.probe_scores.tolist()) if p in before)


def test_the_probes_run_and_their_time_are_counted(tiny_model):
    """One question probe per eviction while a prompt is read in chunks, none for generation or a probeless policy;
    their time (the benchmark's "time by part") is part of the prompt's, and is its chunks' where they ride with them
    (probe_rides)."""
    import time

    policy = TOVA(budget=BUDGET, recent=4, probe="question", question=8)
    llm = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1, probe_rides=False)
    t0 = time.perf_counter()
    llm.eval(PROMPT)
    elapsed = time.perf_counter() - t0
    st = llm.kv_state()
    n_chunks = -(-len(PROMPT) // 16)
    assert 1 <= st.n_probes <= n_chunks and 0.0 < st.probe_seconds < elapsed
    riding = Llama(tiny_model, policy=policy, n_batch=16, n_threads=1)
    riding.eval(PROMPT)
    assert riding.kv_state().n_probes == st.n_probes
    assert (riding.kv_state().probe_seconds == 0.0) == probes_ride(riding)
    for t in (7, 8, 9):
        llm.eval([t])
    assert llm.kv_state().n_probes == st.n_probes
    plain = Llama(tiny_model, policy="h2o", budget=BUDGET, n_batch=16, n_threads=1)
    plain.eval(PROMPT)
    assert plain.kv_state().n_probes == 0 and plain.kv_state().probe_seconds == 0.0


def test_the_last_answer_is_kept_before_what_a_new_prompts_probe_ranks():
    """The reply option: an entry marked as the last answer (`reply`, beside its probe score) ranks after the entries
    no probe has judged (the answer being generated) and before every judged one, whatever its lift; its lift still
    pools. A lift is never negative."""
    cpp = _engine.Policy("tova", 4, heavy=3, recent=1, probe="question", reply=1)
    probe = [0.9, 0.8, 0.01, 0.02, 0.7, 0.0, 0.5]
    marks = [False, False, True, True, False, False, False]
    args = (list(range(7)), [0.0] * 7, np.zeros((7, 1), np.float32), [1] * 7)
    assert cpp.select(*args, probe=probe, reply=marks) == [2, 3, 5, 6]  # the marked, the unjudged, the newest
    assert cpp.select(*args, probe=probe) == [0, 1, 5, 6]  # unmarked: 0.9 and 0.8 stay
    pooled = _engine.Policy("tova", 4, heavy=3, recent=1, probe="question", reply=1, pool=3)
    keep = pooled.select(*args, probe=[0.1, 0.1, 0.9, 0.1, 0.2, 0.1, 0.1], reply=[False, False, True] + [False] * 4)
    assert keep == [1, 2, 3, 6]  # its neighbours take its lift (0.9, before 0.2), not its mark
    with pytest.raises(ValueError, match="lift"):
        cpp.select(*args, probe=[-0.5] + probe[1:])


def test_handoff_gives_the_recent_window_to_what_the_question_finds_before_a_prompt():
    """The handoff option: ranking before a prompt of n tokens (recall), the recent window protects only recent - n
    of the newest entries (at least the newest), and the heavy part takes the rest; otherwise the split is the
    policy's. Without the option, the prompt's length changes nothing."""
    probe = [0.0, 0.9, 0.1, 0.8, 0.1, 0.7, 0.1, 0.1, 0.1, 0.1]  # entry 0: a sink; 7-9 the newest
    args = (list(range(10)), [0.0] * 10, np.zeros((10, 1), np.float32), [1] * 10)
    handoff = _engine.Policy("tova", 6, sinks=1, heavy=2, recent=3, probe="question", handoff=1)
    plain = _engine.Policy("tova", 6, sinks=1, heavy=2, recent=3, probe="question")
    assert handoff.select(*args, probe=probe) == plain.select(*args, probe=probe) == [0, 1, 3, 7, 8, 9]
    assert plain.select(*args, probe=probe, incoming=8) == [0, 1, 3, 7, 8, 9]
    assert handoff.select(*args, probe=probe, incoming=1) == [0, 1, 3, 5, 8, 9]
    assert handoff.select(*args, probe=probe, incoming=8) == [0, 1, 2, 3, 5, 9]  # the newest always stays
    assert handoff.option("handoff") == 1 and "+handoff" in handoff.label


def test_with_handoff_a_question_brings_back_more_of_what_it_ranks(tiny_model):
    """In a recall before a prompt, handoff lets what the question ranks take the recent window's place:
    more spilled entries come back than without it, and the prompt still ends as the recent window."""
    recalled = {}
    for handoff in (None, True):
        policy = TOVA(budget=48, sinks=4, recent=16, probe="question", question=8, handoff=handoff)
        llm = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=32, n_threads=1, recall=True)
        llm.eval([5 + (7*i) % 250 for i in range(200)])
        question = [5 + (11*i) % 250 for i in range(24)]
        llm.eval(question)
        st = llm.kv_state()
        assert st.positions[-16:].tolist() == list(range(200 + 24 - 16, 200 + 24))
        recalled[handoff] = st.n_recalled
    assert recalled[True] > recalled[None]  # the window's 15 places went to the question's choice


def test_a_conversation_keeps_its_last_exchange_when_the_next_question_is_probed(tiny_model):
    """Prompt, answer, next prompt: with reply the answer and the previous prompt's question (its last `question`
    tokens) survive the next prompt's evictions, marked (negative probe scores) until another answer follows; without
    it the probe ranks them like the rest."""
    context = [5 + (7*i) % 250 for i in range(160)]
    kept = {}
    for reply in (None, True):
        llm = Llama(tiny_model, policy=TOVA(budget=64, sinks=4, recent=8, probe="question", question=8, reply=reply),
                    n_ctx=512, n_batch=32, n_threads=1)
        llm.eval(context)
        answer_from = llm.kv_state().positions[-1] + 1
        for i in range(24):  # an answer, a token at a time
            llm.eval([5 + (3*i) % 250])
        before = llm.kv_state().positions
        held = int(((before >= answer_from - 8) & (before < answer_from + 24)).sum())  # the answer, and what is left
        assert held >= 24                                                              # of the question
        llm.eval([5 + (11*i) % 250 for i in range(40)])  # the next question, in two pieces
        st = llm.kv_state()
        exchange = (st.positions >= answer_from - 8) & (st.positions < answer_from + 24)
        kept[reply] = int(exchange.sum())
        if reply:
            assert kept[reply] == held and st.reply_marks[exchange].all()
            assert (st.probe_scores[~exchange] >= 0).all()
            for i in range(4):  # another answer: the first exchange is ranked as the rest again
                llm.eval([5 + (13*i) % 250])
            llm.eval([5 + (17*i) % 250 for i in range(20)])
            st = llm.kv_state()
            old = (st.positions >= answer_from - 8) & (st.positions < answer_from + 24)
            assert (st.probe_scores[old] > 0).all() and not st.reply_marks[old].any()
    assert kept[None] < kept[True]


@pytest.mark.parametrize("how", ["recall", "two prompts"])
def test_the_last_exchange_outlives_the_cells_moving_together(tiny_model, how):
    """Compaction (the kept cells moved together after a recall or a prompt that evicted) moves cells, not the
    conversation: the next question brought back spilled entries first (recall), or came in two prompts, and the
    answer with its question is still kept and marked."""
    policy = TOVA(budget=64, sinks=4, recent=8, probe="question", question=8, reply=True)
    llm = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=32, n_threads=1, recall=how == "recall")
    llm.eval([5 + (7*i) % 250 for i in range(160)])
    answer_from = llm.kv_state().positions[-1] + 1
    for i in range(24):
        llm.eval([5 + (3*i) % 250])
    before = llm.kv_state().positions
    held = int(((before >= answer_from - 8) & (before < answer_from + 24)).sum())  # the answer, what is left of the
    assert held >= 24                                                              # question
    question = [5 + (11*i) % 250 for i in range(40)]
    if how == "recall":
        llm.eval(question)
        assert llm.kv_state().n_recalled > 0
    else:
        llm.eval(question[:20])
        llm.eval(question[20:])
    st = llm.kv_state()
    exchange = (st.positions >= answer_from - 8) & (st.positions < answer_from + 24)
    # recall brings back the question's tokens generation had evicted: the whole exchange
    assert exchange.sum() == (32 if how == "recall" else held) and st.reply_marks[exchange].all()


def test_a_restored_conversation_still_keeps_its_last_answer(tiny_model):
    """A snapshot does not carry the mark: a sequence loaded from one takes its newest entries that no probe judged
    (the answer: generation runs no probe) as the last answer when the next prompt comes (the server's saved
    sessions)."""
    policy = TOVA(budget=64, sinks=4, recent=8, probe="question", question=8, reply=True)
    llm = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=32, n_threads=1)
    llm.eval([5 + (7*i) % 250 for i in range(160)])
    answer_from = llm.kv_state().positions[-1] + 1
    for i in range(24):
        llm.eval([5 + (3*i) % 250])
    restored = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=32, n_threads=1)
    restored.load_state(llm.save_state())
    for seq in (llm, restored):
        seq.eval([5 + (11*i) % 250 for i in range(40)])
    mine, theirs = llm.kv_state(), restored.kv_state()
    answer = (theirs.positions >= answer_from) & (theirs.positions < answer_from + 24)
    assert answer.sum() == 24 and theirs.reply_marks[answer].all()
    assert theirs.positions.tolist() == mine.positions.tolist()
