"""Where a probe ranks a needle's tokens, read from a full cache (no eviction): the diagnostic behind the probe's
scoring rule (docs/quality.md, "Probes, second round").

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


def pool(v: np.ndarray, width: int) -> np.ndarray:
    h = width // 2
    return np.array([v[max(0, i - h): i + h + 1].max() for i in range(len(v))])


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = experiment_parser("experiments.probe_ranking", __doc__)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--top", type=int, nargs="+", default=[150, 370])
    ap.add_argument("--threads", type=int, default=1)
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
        llm = Llama(model, n_ctx=len(h) + 256, export_scores=True, n_threads=args.threads)
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
            for rule, score in rules.items():
                for width in (1, 9, 17):
                    s = pool(score, width)
                    rank = np.empty(len(s), int)
                    rank[np.argsort(-s, kind="stable")] = np.arange(len(s))
                    for k in args.top:
                        shares.setdefault((name, rule, width, k), []).append(float(np.mean(rank[span] < k)))
    body = [[name, rule, w] + [f"{np.mean(shares[(name, rule, w, k)]):.2f}" for k in args.top]
            for (name, rule, w, k) in shares if k == args.top[0]]
    lines = [f"# Where a probe ranks a needle's digits ({Path(model).name}, {args.rows} rows, ~{args.context} tokens)",
             "", *table(["probe", "rule", "pool"] + [f"share in top {k}" for k in args.top], body)]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
