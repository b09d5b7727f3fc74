"""Streaming past the trained context: perplexity over one long text for full, local, sink, h2o and h2o + rolling.

    python -m experiments.streaming --input-path ../shared/data/xsum_0shot_dev.jsonl \\
        --tokens 32768 --budgets 256 1024 --output results/quality/streaming-smollm2

The articles are concatenated into one stream and fed in chunks of `--chunk` tokens (one forward pass each, then
eviction) with every token's logits kept: the negative log-likelihood of token t comes from the logits after token
t-1. `full` gets a context of the model's trained length and stops when it is full. Writes OUT.json (per-window
perplexities), OUT.md (a table) and OUT.png (running perplexity vs tokens seen).

`--reference-window W` adds `full-wW`: each span read by the full cache after the W tokens before it, afresh (the
text's own difficulty, with the same context everywhere past W), and a second table: each setting's perplexity
divided by it, span by span, so that a span of hard text is not taken for the cache's loss.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from h2o_local import Llama
from experiments.models import model_path
from h2o_local import ModelInfo
from .common import experiment_parser, parse_setting, save_figure


def stream_tokens(llm: Llama, path: str, n: int) -> List[int]:
    text = "\n\n".join(json.loads(line)["article"] for line in open(path))
    tokens = llm.tokenize(text, add_bos=False)
    if len(tokens) < n + 1:
        raise SystemExit(f"{path} gives only {len(tokens)} tokens")
    return tokens[: n + 1]


def nll_run(model: str, tokens: List[int], setting, chunk: int, threads) -> np.ndarray:
    """NLL (nats) of tokens[1:], NaN where the setting could not go on. Each chunk is a prompt: with +recall, what
    the cache evicted comes back for it as for a chat's turn."""
    policy = setting.policy
    if policy == "full":
        llm = Llama(model, n_ctx=ModelInfo.load(model).n_ctx_train, n_batch=chunk, n_threads=threads)
    else:
        llm = Llama(model, **{"n_batch": chunk, **setting.llama_kwargs()}, n_threads=threads)
    nll = np.full(len(tokens) - 1, np.nan)
    prev = None  # logits after the last token of the previous chunk
    t0 = time.time()
    for start in range(0, len(tokens) - 1, chunk):
        piece = tokens[start: min(start + chunk, len(tokens) - 1)]
        if policy == "full" and llm.kv_state().n_cells + len(piece) > llm.n_ctx():
            break
        rows = llm.eval(piece, logits_all=True)
        logits = rows if prev is None else np.vstack([prev[None, :], rows])
        targets = tokens[start + (0 if prev is not None else 1): start + len(piece) + 1]
        logits = logits[: len(targets)]
        lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        vals = lse - logits[np.arange(len(targets)), targets]
        first = start if prev is not None else start + 1
        nll[first - 1: first - 1 + len(vals)] = vals
        prev = rows[-1]
        done = start + len(piece)
        print(f"\r  {done}/{len(tokens) - 1} tokens, {done / (time.time() - t0):.0f} tok/s   ", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return nll


def span_change(ratios: List, windows: List[int], span: int, n_train: int) -> str:
    """The geometric mean of the ratios of the spans past 3x the trained context over that of the spans inside it,
    as a change in percent ('-' where a span of either is missing)."""
    inside = [q for q, w in zip(ratios, windows) if compared_span(w, span, n_train) and w < n_train]
    past = [q for q, w in zip(ratios, windows) if compared_span(w, span, n_train) and w >= n_train]
    if not inside or not past or None in inside or None in past:
        return "-"
    change = math.exp(np.mean(np.log(past)) - np.mean(np.log(inside)))
    return f"{(change - 1) * 100:+.1f}%"


def compared_span(w: int, span: int, n_train: int) -> bool:
    """Whether the span at w is one the comparison reads: inside the trained context, or past 3x it."""
    return w + span <= n_train or w >= 3 * n_train


def windowed_full_nll(model: str, tokens: List[int], window: int, span: int, threads) -> np.ndarray:
    """NLL (nats) of tokens[1:]: each span of `span` tokens that the comparison reads (compared_span) by a full cache
    right after the `window` tokens before it (fewer at the start), a fresh sequence per span; NaN elsewhere."""
    llm = Llama(model, n_ctx=window + span + 64, n_batch=512, n_threads=threads)
    n_train = llm.n_ctx_train()
    nll = np.full(len(tokens) - 1, np.nan)
    for w in range(0, len(tokens) - 1, span):
        if not compared_span(w, span, n_train):
            continue
        llm.reset()
        piece = tokens[w: min(w + span, len(tokens) - 1)]
        if w > 0:
            llm.eval(tokens[max(0, w - window): w])
            prev = llm.last_logits()[None, :]
            logits = np.vstack([prev, llm.eval(piece, logits_all=True)])
            targets, first = tokens[w: w + len(piece) + 1], w
        else:
            logits, targets, first = llm.eval(piece, logits_all=True), tokens[1: len(piece) + 1], 1
        logits = logits[: len(targets)]
        lse = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        nll[first - 1: first - 1 + len(targets)] = lse - logits[np.arange(len(targets)), targets]
        print(f"\r  {w + len(piece)}/{len(tokens) - 1} tokens   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return nll


def main(argv=None) -> int:
    ap = experiment_parser("experiments.streaming", __doc__)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--ppl-span", type=int, default=1024, help="tokens per perplexity column in the table")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--settings", nargs="+", help="setting labels to run instead of full and, per budget, local, "
                    "sink, h2o and h2o+roll (+roll0: rolling only near the trained context, the library's default)")
    ap.add_argument("--reference-window", type=int, help="also read each span with the full cache after the W tokens "
                    "before it (full-wW), and divide each setting's perplexity by it")
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args(argv)

    model = model_path(args.model)
    tokens = stream_tokens(Llama(model, n_ctx=256), args.input_path, args.tokens)
    runs = [parse_setting(s) for s in args.settings] if args.settings else \
        [parse_setting("full")] + [parse_setting(f"{p}-{b}{extra}") for b in args.budgets
                                   for p, extra in (("local", ""), ("sink", ""), ("h2o", ""), ("h2o", "+roll"))]
    # each run's NLL kept as it finishes (OUT.nll.json): a stopped run goes on from the next
    saved = args.output.with_suffix(".nll.json")
    results: Dict[str, List[float]] = json.loads(saved.read_text()) if saved.exists() else {}
    reference = f"full-w{args.reference_window}" if args.reference_window else None
    for label in [s.label for s in runs] + ([reference] if reference else []):
        if label in results:
            continue
        print(f"{label}:", file=sys.stderr)
        if label == reference:
            nll = windowed_full_nll(model, tokens, args.reference_window, args.ppl_span, args.threads)
        else:
            nll = nll_run(model, tokens, next(s for s in runs if s.label == label), args.chunk, args.threads)
        results[label] = [None if math.isnan(v) else v for v in nll.tolist()]
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(results))
    results = {k: [math.nan if v is None else v for v in vals] for k, vals in results.items()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    n_train = ModelInfo.load(model).n_ctx_train
    windows = list(range(0, args.tokens, args.ppl_span))

    def ppl(vals):
        v = np.asarray(vals, dtype=float)
        return float(math.exp(np.mean(v))) if len(v) and not np.isnan(v).any() else None

    table = {name: [ppl(v[w: w + args.ppl_span]) for w in windows] for name, v in results.items()}
    args.output.with_suffix(".json").write_text(json.dumps({"model": model, "tokens": args.tokens,
                                                            "chunk": args.chunk, "ppl_span": args.ppl_span,
                                                            "n_ctx_train": n_train, "ppl_per_window": table}))
    lines = [f"Perplexity per span of {args.ppl_span} tokens (model trained context {n_train}); '-' = stopped.", "",
             "| setting | " + " | ".join(f"{w // 1024}k" if w % 1024 == 0 else str(w) for w in windows) + " |",
             "|---|" + "---|" * len(windows)]
    for name, vals in table.items():
        lines.append(f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals) + " |")
    if reference:
        lines += ["", f"Each setting's perplexity divided by {reference}'s, span by span (1.00: as the full cache reads "
                  f"that text after the {args.reference_window} tokens before it); the last column, the geometric "
                  f"mean of the spans past 3x the trained context over that of the spans inside it.", "",
                  "| setting | " + " | ".join(f"{w // 1024}k" if w % 1024 == 0 else str(w) for w in windows) +
                  " | past 3x / inside |", "|---|" + "---|" * (len(windows) + 1)]
        for name, vals in table.items():
            if name == reference:
                continue
            ratios = [None if v is None or r is None else v / r for v, r in zip(vals, table[reference])]
            lines.append(f"| {name} | " + " | ".join("-" if q is None else f"{q:.2f}" for q in ratios) + " | " +
                         span_change(ratios, windows, args.ppl_span, n_train) + " |")
    args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 5))
        for name, vals in results.items():
            v = np.asarray(vals)
            ok = ~np.isnan(v)
            cum = np.exp(np.cumsum(np.where(ok, v, 0)) / np.maximum(np.cumsum(ok), 1))
            x = np.arange(1, len(v) + 1)
            ax.plot(x[ok], cum[ok], label=name, linestyle="--" if "local" in name or "sink" in name else "-")
        ax.axvline(n_train, color="k", linewidth=0.8)
        ax.text(n_train, ax.get_ylim()[1], " trained context", va="top")
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("running perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, args.output.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
