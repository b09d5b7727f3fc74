"""Where a probe ranks a needle's tokens, read from a full cache (no eviction): the diagnostic behind the probe's
scoring rule (docs/quality-log.md, "Probes, second round").

    python -m experiments.probe_ranking --input-path ../shared/data/xsum_0shot_dev.jsonl --rows 8 \\
        --out results/quality/probe-ranking-smollm2.md

For each row of the suite's `single` task (experiments.longctx: its formats, about --context tokens), the prompt
(context + question) is fed to a full cache that exports scores; then a probe (the question part of the prompt, or
the catalyst text) is decoded after it and its column sums read. Each scoring rule ranks the prompt's entries; the
table gives the share of the needle's value tokens ranked within the top K (a needle is lost when its digits are),
mean over rows, for pools of 1, 9 and 17 entries (max over the entries centred on each). Rules: `raw max head` (the
probe's attention per query in the head that gives the most), `raw sum` (summed over heads), `lift` (per head, the
probe's attention per query over the entry's attention per query from the prompt's own queries + 1e-3, max over
heads; what the engine's probes rank by, cpp/policy.cpp observe_probe, with the baseline shrunk for young entries).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from h2o_local import Llama, _engine
from experiments.models import model_path
from .common import experiment_parser, table
from .longctx import build_prompt, context_text, haystack_sentences, make_task, row_format


def pool(v: np.ndarray, width: int, follow: int = 0) -> np.ndarray:
    """The engine's pool and follow (cpp/policy.cpp max_pool): the best of v[i - max(width/2, follow) .. i + width/2]."""
    h = width // 2
    back = max(h, follow)
    return np.array([v[max(0, i - back): i + h + 1].max() for i in range(len(v))])


POOLS = ((1, 0), (9, 0), (17, 0), (9, 12))  # (pool, follow)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = experiment_parser("experiments.probe_ranking", __doc__)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--top", type=int, nargs="+", default=[150, 370])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", action="store_true", help="also the repeat probe, decoded one query at a time (slow): "
                    "its attention summed over queries (what the export gives) and the largest over queries (KVzip)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    model = model_path(args.model)
    tok = Llama(model, budget=8, n_threads=args.threads)
    sentences = haystack_sentences(Path(args.input_path))
    shares = {}
    for row in range(args.rows):
        rng = random.Random(f"0/single/{row}")
        fmt = row_format(row)
        spec = make_task("single", rng, fmt)
        head, tail = build_prompt(tok, fmt, context_text(tok, spec, sentences, rng, args.context), *spec["turns"][0])
        h = tok.tokenize(head, add_bos=True, special=True)
        pieces = [tok.token_to_piece(x).decode(errors="replace") for x in h]
        starts = np.cumsum([0] + [len(p) for p in pieces])[:-1]
        value = spec["answers"][0][0]
        c = "".join(pieces).index(value)
        span = [i for i, s in enumerate(starts) if c <= s < c + len(value)]
        llm = Llama(model, n_ctx=2 * len(h) + 256, export_scores=True, n_threads=args.threads)
        llm.eval(h)
        st = llm.kv_state()
        base = st.head_scores / st.queries[:, None]
        snap = llm.save_state()
        probes = {"question": tok.tokenize(tail, add_bos=False, special=True),
                  "catalyst": tok.tokenize(_engine.PROBE_TEXTS["catalyst"], add_bos=False)}
        for name, probe in probes.items():
            llm.load_state(snap)
            llm.eval(probe)
            sums = llm.last_scores()[1][: len(h)] / len(probe)
            rules = {"raw max head": sums.max(1), "raw sum": sums.sum(1), "lift": (sums / (base + 1e-3)).max(1)}
            add_shares(shares, name, rules, span, args.top)
        if args.repeat:
            llm.load_state(snap)
            per_query = []
            for t in tok.tokenize(_engine.PROBE_TEXTS["repeat"], add_bos=False) + h[1:]:
                llm.eval([t])
                per_query.append(llm.last_scores()[1][: len(h)])
            q = np.stack(per_query)  # [queries, entries, heads]
            rules = {"sum over queries, raw max head": q.mean(0).max(1), "sum over queries, lift": (q.mean(0) / (base + 1e-3)).max(1),
                     "max over queries, raw max head": q.max(0).max(1), "max over queries, lift": (q.max(0) / (base + 1e-3)).max(1)}
            add_shares(shares, "repeat", rules, span, args.top)
        print(f"row {row} done", flush=True)
    body = [[name, rule, f"{w}" + (f" + follow {f}" if f else "")] + [f"{np.mean(shares[(name, rule, (w, f), k)]):.2f}"
                                                                    for k in args.top]
            for (name, rule, (w, f), k) in shares if k == args.top[0]]
    lines = [f"# Where a probe ranks a needle's digits ({Path(model).name}, {args.rows} rows, ~{args.context} tokens)",
             "", *table(["probe", "rule", "pool"] + [f"share in top {k}" for k in args.top], body)]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def add_shares(shares, name, rules, span, top) -> None:
    """The share of the needle's tokens (span) within the top k of each rule's pooled ranking."""
    for rule, score in rules.items():
        for width, follow in POOLS:
            s = pool(score, width, follow)
            rank = np.empty(len(s), int)
            rank[np.argsort(-s, kind="stable")] = np.arange(len(s))
            for k in top:
                shares.setdefault((name, rule, (width, follow), k), []).append(float(np.mean(rank[span] < k)))


if __name__ == "__main__":
    main()
