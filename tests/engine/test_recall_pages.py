"""Recall's page choice (the policy option recall_pages, docs/recall.md "Choosing the pages"): past a few pages of
host entries, a new prompt's question is probed once for its queries, every host entry is lifted by those queries
read against the kept and the stored keys on the host (every third layer from the second), over its own baseline,
and only the best blocks of 32 neighbouring entries (recall_pages pages, at least the budget's worth) play the page
tournament."""
import numpy as np

from h2o_local import TOVA, Llama
from device_tolerance import approximate, assert_same_choice

BLOCK = 32


def ranking_layers(n_layer):
    return [il for il in range(n_layer) if n_layer < 3 or il % 3 == 1]


def host_order(reference, tokens, n, kept, host, n_q, base):
    """The host entries in the order their blocks' best lift ranks them (members ascending within a block), from a
    NumPy forward pass: the question's queries see the kept entries only; each host entry's attention from them in a
    cache holding the kept and every host entry, per query, over its baseline, in its best head."""
    visible = np.ones((len(tokens), len(tokens)), dtype=bool)
    visible[n:, :n] = False
    visible[n:, kept] = True
    queries = reference.queries(tokens, visible)
    keys = reference.keys(tokens[:n])
    cols = list(kept) + list(host)
    sums = 0
    for il in ranking_layers(len(queries)):
        q = queries[il][n:n + n_q]                                    # [token, head, dim]
        k = np.repeat(keys[il][cols], q.shape[1] // keys[il].shape[1], axis=1)  # [entry, head, dim]
        logits = np.einsum("thd,ehd->hte", q, k) / np.sqrt(q.shape[-1])
        p = np.exp(logits - logits.max(-1, keepdims=True))
        sums = sums + (p / p.sum(-1, keepdims=True)).sum(axis=1)[:, len(kept):].T  # [host entry, head]
    lift = (sums / n_q / base(list(host))).max(axis=1)
    blocks = sorted({p // BLOCK for p in host})
    best = {b: max(lift[i] for i, p in enumerate(host) if p // BLOCK == b) for b in blocks}
    order = sorted(blocks, key=lambda b: -best[b])
    return [p for b in order for p in sorted(p for p in host if p // BLOCK == b)], order, best


def test_a_recall_past_its_pages_probes_the_blocks_its_queries_rank_first(tiny_model):
    """Host entries of several blocks, room for one page of 16 beside the kept ones, recall_pages=2: the question's
    queries lift the host entries; the best blocks' entries, 32 of them (two pages), play the tournament of
    test_recall's reference, best first, and the cache ends with the same entries. The blocks ranked last never come
    back."""
    from attention_reference import LlamaReference
    from test_probe import BUDGET, PROMPT, question_baseline
    from test_recall import page_tournament

    n_q, page = 8, 16
    question = list(range(130, 130 + n_q))
    policy = TOVA(budget=BUDGET, probe="question", question=n_q, recall_pages=2)
    whole = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=512, n_threads=1, recall=1000, kv_f32=True)
    whole.eval(PROMPT)
    paged = Llama(tiny_model, policy=policy, n_ctx=512, n_batch=page, n_threads=1, recall=1000, kv_f32=True)
    paged.load_state(whole.save_state())
    kept = paged.kv_state().positions.tolist()
    host = sorted(paged.kv_state().host_positions.tolist())
    everything = sorted(kept + host)
    assert len(host) > 4 * page and len({p // BLOCK for p in host}) >= 3
    paged.recall_for(question)

    reference = LlamaReference(tiny_model)
    n = len(PROMPT)
    tokens = PROMPT + question
    base = question_baseline(tiny_model, n_q, kv_f32=True)
    order, blocks, best = host_order(reference, tokens, n, kept, host, n_q, base)
    assert blocks != sorted(blocks)  # the conversation's order would probe other blocks
    assert len({round(v, 5) for v in best.values()}) == len(best)  # no tie decides the order
    candidates = order[:2 * page]
    kept, last_round = page_tournament(reference, tokens, n, kept, candidates, page, n_q, base, BUDGET)

    st = paged.kv_state()
    assert_same_choice(st.positions, kept, last_round, device=approximate(paged))
    never = set(host) - set(candidates)
    assert never and not never & set(st.positions.tolist())
    # the candidates left the store at once and the losers came back: every entry is kept or stored, once
    assert sorted(st.positions.tolist() + st.host_positions.tolist()) == everything


def test_every_page_is_probed_with_recall_pages_0_or_room_for_everything(tiny_model):
    """recall_pages=0 plays every page (what came before the digests); so does a budget that can hold every host
    entry: both bring back what an exhaustive tournament does, which the digests' choice may not."""
    from test_probe import PROMPT

    question = list(range(130, 138))

    def after_recall(recall_pages, budget):
        llm = Llama(tiny_model, policy=TOVA(budget=24, probe="question", question=8, recall_pages=recall_pages),
                    n_ctx=512, n_batch=16, n_threads=1, recall=1000)
        llm.eval(PROMPT)
        if budget != 24:
            llm.set_policy(TOVA(budget=budget, probe="question", question=8, recall_pages=recall_pages))
        llm.recall_for(question)
        st = llm.kv_state()
        return st.positions.tolist(), st.n_probes

    every, probes_every = after_recall(0, 24)
    chosen, probes_chosen = after_recall(2, 24)
    assert probes_chosen < probes_every  # the question's probe for its queries, then two pages, not all of them
    assert after_recall(2, 200)[0] == after_recall(0, 200)[0] == list(range(len(PROMPT)))


def test_a_q8_0_host_copy_is_not_ranked_on_the_host_every_page_is_probed(tiny_model):
    """The ranking reads the store's own F16 or F32 rows; a q8_0 copy is probed page by page, as before."""
    from test_probe import PROMPT

    def probes(recall_pages, recall_type):
        llm = Llama(tiny_model, policy=TOVA(budget=24, probe="question", question=8, recall_pages=recall_pages),
                    n_ctx=512, n_batch=16, n_threads=1, recall=1000, recall_type=recall_type)
        llm.eval(PROMPT)
        before = llm.kv_state().n_probes
        llm.recall_for(list(range(130, 138)))
        return llm.kv_state().n_probes - before, llm.kv_state().positions.tolist()

    assert probes(2, "q8_0") == probes(0, "q8_0")
    assert probes(2, None)[0] < probes(0, None)[0]
