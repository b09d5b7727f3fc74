"""XSum summarization quality vs KV budget: H2O vs a local window vs the full cache (the llama-recipes H2O table).

    python -m experiments.summarization --input-path ../shared/data/xsum.jsonl \\
        --output-path results/quality/xsum-smollm2.jsonl --budgets 64 128 256 512 1024 full --policies h2o local \\
        --sample-num 100 --seeds 0 1 2 --greedy

Faithful to the reference run (llama-recipes run_summarization.py): the prompt is the row's `article` without BOS,
temperature 0.3, top_p 1, top_k off, 64 new tokens, the text cut at the first `###`, ROUGE-1/2/L F1 from the PyPI
package `rouge` averaged over samples. Also Google's `rouge-score` and greedy decoding. Unlike the reference we do
not drop the last character when `###` is absent.

Every policy and budget attends the whole prompt first and compresses after it (the reference mode), so the prompt
is prefilled once per row and every setting branches from a snapshot of it (policies that score a prompt by its last
queries, tova and snapkv, prefill it again under their own rule). Per-sample results go to the output
jsonl as they come, and a rerun skips what is there (resume).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from h2o_local import Llama
from h2o_local.policies import REGISTRY, H2O, parse
from experiments.models import model_path
from .common import JsonlRecords, experiment_parser, save_figure

GEN = dict(max_tokens=64, top_p=1.0, top_k=0, min_p=0.0, stop=["###"])


def rouge_scores(hyp: str, ref: str) -> Dict[str, float]:
    from rouge import Rouge
    from rouge_score import rouge_scorer

    out: Dict[str, float] = {}
    if hyp.strip():
        s = Rouge().get_scores(hyp, ref)[0]
        out.update({"rouge1": s["rouge-1"]["f"], "rouge2": s["rouge-2"]["f"], "rougeL": s["rouge-l"]["f"]})
    else:  # the rouge package raises on an empty hypothesis
        out.update({"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0})
    g = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True).score(ref, hyp)
    out.update({f"g_{k}": v.fmeasure for k, v in g.items()})
    return out


def settings(policies: List[str], budgets: List[str]) -> List[Tuple[str, Optional[int]]]:
    """(policy, budget) of every setting: `full` and each policy at each budget, as the result records name them
    (a policy may carry label suffixes: `h2o+ph` is per-head H2O)."""
    out = [("full", None)] if "full" in budgets else []
    for p in policies:
        for b in budgets:
            if b != "full":
                policy_value(p, int(b))  # checked now, not after an hour of other settings
                out.append((p, int(b)))
    return out


def policy_value(policy: str, budget: int):
    """`h2o` at 64 -> H2O(budget=64); `h2o+ph` at 64 -> the label h2o-64+ph."""
    name, plus, suffixes = policy.partition("+")
    return parse(f"{name}-{budget}{plus}{suffixes}")


def decodings(seeds: List[int], greedy: bool) -> List[Tuple[str, Optional[int]]]:
    return ([("greedy", None)] if greedy else []) + [(f"seed{s}", s) for s in seeds]


def rows_and_records(args) -> Tuple[List[dict], JsonlRecords]:
    """The first `--sample-num` rows, and the output's records keyed by (row, policy, budget, decoding)."""
    rows = [json.loads(line) for line in open(args.input_path)][: args.sample_num]
    return rows, JsonlRecords(Path(args.output_path), key=lambda r: (r["row"], r["policy"], r["budget"], r["decoding"]))


def run(args) -> None:
    rows, records = rows_and_records(args)
    n_resumed = len(records.done)
    model = model_path(args.model)
    # one context big enough for the whole prompt: every setting starts from the attended prompt
    llm = Llama(model, budget=args.n_ctx - args.n_batch, n_ctx=args.n_ctx, n_batch=args.n_batch,
                n_threads=args.threads, seed=0)
    todo_settings = settings(args.policies, args.budgets)
    todo_dec = decodings(args.seeds, args.greedy)
    total = len(rows) * len(todo_settings) * len(todo_dec)
    n_done, t0 = n_resumed, time.time()
    for i, row in enumerate(rows):
        if i < args.first_row:
            continue
        pending = [(p, b, d, s) for p, b in todo_settings for d, s in todo_dec if (i, p, b, d) not in records.done]
        if not pending:
            continue
        tokens = llm.tokenize(row["article"], add_bos=args.add_bos)
        if len(tokens) + GEN["max_tokens"] > args.n_ctx:
            raise SystemExit(f"row {i}: {len(tokens)} prompt tokens do not fit n_ctx={args.n_ctx}")
        snaps: Dict[bool, Any] = {}  # the attended prompt, scored per token or per layer and KV head
        for policy, budget, dec, seed in pending:
            value = policy_value(policy, budget) if budget is not None else parse("full")
            per_head = bool(getattr(value, "per_head", None))
            if value.query_window:
                # a prompt scored by its last queries must be fed under that policy (its window decoded alone)
                llm.reset()
                llm.set_policy(value)
                llm.eval(tokens)
                snaps.clear()  # the sequence was fed under another policy
            else:
                if per_head not in snaps:
                    llm.reset()
                    llm.set_policy(H2O(budget=args.n_ctx - args.n_batch, per_head=per_head or None))
                    llm.eval(tokens)
                    snaps[per_head] = llm.save_state()
                llm.reset()
                llm.set_policy(H2O(budget=args.n_ctx - args.n_batch, per_head=per_head or None))
                llm.load_state(snaps[per_head])
                llm.set_policy(value)
                llm.compress()
            temperature = 0.0 if seed is None else float(row.get("temperature", 0.3))
            text = llm.generate([], max_tokens=GEN["max_tokens"], temperature=temperature, top_p=GEN["top_p"],
                                top_k=GEN["top_k"], min_p=GEN["min_p"], stop=row.get("stop", GEN["stop"]),
                                seed=seed, reset=False)
            st = llm.kv_state()
            rec = {"row": i, "policy": policy, "budget": budget, "decoding": dec, "prompt_tokens": len(tokens),
                   "output": text, "summary_gt": row["summary_gt"], "n_evicted": st.n_evicted,
                   **rouge_scores(text, row["summary_gt"])}
            records.add(rec)
            n_done += 1
            rate = (time.time() - t0) / max(1, n_done - n_resumed)
            print(f"\r[{n_done}/{total}] row {i} {policy}-{budget} {dec}: R2 {rec['rouge2']:.3f} "
                  f"(eta {rate * (total - n_done) / 60:.0f} min)   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def _complete_rows(recs: List[dict]) -> List[dict]:
    """Only rows that every setting finished: a stopped run must not compare settings over different rows."""
    per_row: Dict[int, int] = {}
    for r in recs:
        per_row[r["row"]] = per_row.get(r["row"], 0) + 1
    full_count = max(per_row.values(), default=0)
    return [r for r in recs if per_row[r["row"]] == full_count]


def _full_policy(policy: str) -> str:
    """The full-cache setting a policy is compared with: its own implementation's (perhead.py writes `hf-full`)."""
    return "hf-full" if policy.startswith("hf-") else "full"


def summarize(*paths: Path) -> str:
    """Markdown tables (ROUGE-2, ROUGE-1, ROUGE-L) of one or more result files, over the rows all of them finished."""
    per_file = [_complete_rows([json.loads(line) for line in open(p)]) for p in paths]
    common = set.intersection(*({r["row"] for r in recs} for recs in per_file))
    recs = [r for recs in per_file for r in recs if r["row"] in common]
    groups: Dict[Tuple[str, Any, str], List[dict]] = {}
    for r in recs:
        groups.setdefault((r["policy"], r["budget"], r["decoding"]), []).append(r)
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None})
    policies = list(dict.fromkeys(r["policy"] for r in recs if r["budget"] is not None))
    lines = [f"Rows: {len(common)}. Cells: mean F1 over rows; sampled = mean over seeds ± their standard deviation.",
             ""]
    for metric, title in (("rouge2", "ROUGE-2 (rouge package)"), ("g_rouge2", "ROUGE-2 (rouge-score)"),
                          ("rouge1", "ROUGE-1 (rouge package)"), ("rougeL", "ROUGE-L (rouge package)")):
        lines += [f"### {title}", "", "| policy | decoding | " + " | ".join(map(str, budgets)) + " | full |",
                  "|---|---|" + "---|" * (len(budgets) + 1)]
        for decoding in ("greedy", "sampled"):
            for p in policies:
                cells = [_cell(groups, p, b, decoding, metric) for b in budgets]
                cells.append(_cell(groups, _full_policy(p), None, decoding, metric))
                if any(c != "-" for c in cells[:-1]):
                    lines.append(f"| {p} | {decoding} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Agreement with the full cache (greedy)", "",
              "ROUGE-L F1 (rouge-score) of each greedy summary against the same implementation's full-cache greedy "
              "summary of the row (1 = the same text), mean ± standard error over rows. Less noisy than ROUGE against the "
              "reference summary.", "",
              "| policy | " + " | ".join(map(str, budgets)) + " |", "|---|" + "---|" * len(budgets)]
    for p in policies:
        cells = [_agreement(groups, p, b) for b in budgets]
        if any(c != "-" for c in cells):
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    pairs = [(a, b) for a, b in (("h2o", "local"), ("hf-h2o-first", "h2o"), ("hf-h2o-sum", "h2o"), ("h2o+ph", "h2o"),
                                 ("hf-h2o-sum", "h2o+ph"))
             if a in policies and b in policies]
    if pairs:
        lines += ["", "### Paired differences", "",
                  "Mean over rows of (A - B) ± its standard error over rows; sampled: each row's mean over seeds "
                  "first. A difference beyond about two standard errors is unlikely to be row noise.", "",
                  "| A - B | metric | decoding | " + " | ".join(map(str, budgets)) + " |",
                  "|---|---|---|" + "---|" * len(budgets)]
        for a, b in pairs:
            for metric in ("rouge2", "rouge1"):
                for decoding in ("greedy", "sampled"):
                    cells = [_paired(recs, a, b, x, decoding, metric) for x in budgets]
                    if any(c != "-" for c in cells):
                        lines.append(f"| {a} - {b} | {metric} | {decoding} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _paired(recs, a: str, b: str, budget: int, decoding: str, metric: str) -> str:
    def per_row(policy: str) -> Dict[int, float]:
        vals: Dict[int, List[float]] = {}
        for r in recs:
            if r["policy"] == policy and r["budget"] == budget and (r["decoding"] == "greedy") == (decoding == "greedy"):
                vals.setdefault(r["row"], []).append(r[metric])
        return {row: statistics.mean(v) for row, v in vals.items()}

    x, y = per_row(a), per_row(b)
    diffs = [x[r] - y[r] for r in x if r in y]
    if len(diffs) < 2:
        return "-"
    return f"{statistics.mean(diffs):+.4f} ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.4f}"


def _agreement(groups, policy: str, budget: int) -> str:
    from rouge_score import rouge_scorer

    full = {r["row"]: r["output"] for r in groups.get((_full_policy(policy), None, "greedy"), [])}
    recs = [r for r in groups.get((policy, budget, "greedy"), []) if r["row"] in full]
    if not recs:
        return "-"
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    vals = [scorer.score(full[r["row"]], r["output"])["rougeL"].fmeasure for r in recs]
    se = statistics.stdev(vals) / len(vals) ** 0.5 if len(vals) > 1 else 0.0
    return f"{statistics.mean(vals):.3f} ± {se:.3f}"


def plot(paths: List[Path], out_png: Path, title: str) -> None:
    """ROUGE-1 and ROUGE-2 vs KV budget, one line per policy and decoding, the full cache as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_file = [_complete_rows([json.loads(line) for line in open(p)]) for p in paths]
    common = set.intersection(*({r["row"] for r in recs} for recs in per_file))
    recs = [r for recs in per_file for r in recs if r["row"] in common]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("rouge2", "rouge1")):
        for i, policy in enumerate(dict.fromkeys(r["policy"] for r in recs if r["budget"] is not None)):
            for decoding, style in (("greedy", "--"), ("sampled", "-")):
                pts = sorted((b, _mean(recs, policy, b, decoding, metric))
                             for b in {r["budget"] for r in recs if r["policy"] == policy})
                pts = [(b, v) for b, v in pts if v is not None]
                if pts:
                    ax.plot([b for b, _ in pts], [v for _, v in pts], style, marker="o", color=f"C{i}",
                            label=f"{policy} {decoding}")
        for j, full in enumerate(dict.fromkeys(r["policy"] for r in recs if r["budget"] is None)):
            for decoding, style in (("greedy", ":"), ("sampled", "-.")):
                v = _mean(recs, full, None, decoding, metric)
                if v is not None:
                    ax.axhline(v, color="black" if j == 0 else "grey", linestyle=style, label=f"{full} {decoding}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel(f"{metric.upper()} F1 (rouge package)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: {len(common)} rows of XSum 5-shot")
    save_figure(fig, out_png)


def _mean(recs, policy, budget, decoding, metric) -> Optional[float]:
    """Mean over rows (sampled: over every seed's samples) of one setting, None when it did not run."""
    vals = [r[metric] for r in recs if r["policy"] == policy and r["budget"] == budget
            and (r["decoding"] == "greedy") == (decoding == "greedy")]
    return statistics.mean(vals) if vals else None


def _cell(groups, policy, budget, decoding, metric) -> str:
    if decoding == "greedy":
        rs = groups.get((policy, budget, "greedy"))
        return "-" if not rs else f"{statistics.mean(r[metric] for r in rs):.4f}"
    per_seed = [statistics.mean(r[metric] for r in rs) for (p, b, d), rs in groups.items()
                if p == policy and b == budget and d.startswith("seed")]
    if not per_seed:
        return "-"
    sd = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
    return f"{statistics.mean(per_seed):.4f} ± {sd:.4f}"


def main(argv=None) -> int:
    ap = experiment_parser("experiments.summarization", __doc__)
    ap.add_argument("--output-path", required=True)
    ap.add_argument("--budgets", nargs="+", default=["64", "128", "256", "512", "1024", "full"])
    ap.add_argument("--policies", nargs="+", default=["h2o", "local"],
                    help=f"policy names ({', '.join(sorted(set(REGISTRY) - {'full'}))}), with label suffixes if any "
                         "(h2o+ph: per-head H2O)")
    ap.add_argument("--sample-num", type=int, default=100)
    ap.add_argument("--first-row", type=int, default=0,
                    help="start at this row (a second process on another core can take the last rows)")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--greedy", action="store_true", help="also decode greedily")
    ap.add_argument("--n-ctx", type=int, default=4096, help="KV cells: the longest prompt + 64 must fit")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--add-bos", action="store_true",
                    help="prepend BOS to the prompt (the reference's prompts have none; a base model like Gemma 3 "
                         "needs it)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--also", nargs="*", default=[],
                    help="more result files (e.g. perhead.py's) for the same tables, over the rows all finished")
    ap.add_argument("--plot", metavar="PNG", help="also draw ROUGE vs budget")
    ap.add_argument("--title", default="SmolLM2-135M-Instruct", help="the plot's title (the model)")
    args = ap.parse_args(argv)
    if not args.summary_only:
        run(args)
    paths = [Path(args.output_path), *map(Path, args.also)]
    print(summarize(*paths))
    if args.plot:
        plot(paths, Path(args.plot), args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
