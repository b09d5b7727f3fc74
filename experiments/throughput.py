"""Throughput of batched generation: the full cache vs H2O at the same batch size and at the same KV memory.

    python -m experiments.throughput --input-path ../shared/data/xsum_0shot_dev.jsonl \\
        --lengths 512:512 1024:1024 --batch-sizes 1 2 4 8 16 --policies full h2o-20% h2o-128 h2o-256 \\
        --kv-limit-batch 4 --peer --quality 8 --output results/speed/throughput-smollm2

The paper's setting scaled down: prompts of exactly P tokens (an XSum article cut to fit, then the instruction)
and exactly G generated tokens (end-of-generation tokens banned), greedy. `h2o-20%` is the paper's budget: 20% of
the prompt, half heavy hitters and half recent tokens; `h2o-128` a fixed budget. For each length:

- same batch size: each policy at every batch size, one `Llama.generate_batch` call (one llama_decode per step);
- same KV memory: the limit is the full cache's at `--kv-limit-batch` sequences, and each policy runs the largest
  batch that fits in it (`Llama.for_kv_limit`);
- `--peer`: llama-cpp-python as users run it today, one sequence after another with the full cache;
- `--quality N`: N prompts summarized (temperature 0.3, 64 tokens, cut at `###`) batched and one by one with the
  same seeds; the texts and their ROUGE against the reference summaries are compared.

Throughput = generated tokens / wall time of the whole batch (prefill included); latency = wall time until a
sequence's last token (all sequences of a batch end at the same step here). Every measurement is appended to
OUT.jsonl (a rerun skips what is there); OUT.md and OUT.png/OUT-memory.png are written from it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from h2o_local.capacity import cells_needed, padded_cells
from h2o_local import Llama
from experiments.models import model_path
from h2o_local import ModelInfo
from .common import JsonlRecords, experiment_parser, parse_setting, save_figure

PREFIX = "###\nArticle: "
SUFFIX = "\n\nSummarize the above article in 1 sentence.\n"
SUMMARY = dict(temperature=0.3, top_p=1.0, top_k=0, min_p=0.0, max_tokens=64, stop=["###"])


def fixed_length_prompts(llm: Llama, path: str, prompt_tokens: int, n: int) -> List[Tuple[List[int], str]]:
    """n prompts of exactly prompt_tokens tokens (no BOS), with their reference summaries: the articles long
    enough, cut to fit between the prefix and the instruction."""
    head = llm.tokenize(PREFIX, add_bos=False)
    tail = llm.tokenize(SUFFIX, add_bos=False)
    room = prompt_tokens - len(head) - len(tail)
    out = []
    for line in open(path):
        row = json.loads(line)
        body = row["article"]
        body = body[len(PREFIX):] if body.startswith(PREFIX) else body
        body = body[: body.rfind(SUFFIX)] if SUFFIX in body else body
        toks = llm.tokenize(body, add_bos=False)
        if len(toks) >= room:
            out.append((head + toks[:room] + tail, row["summary_gt"]))
            if len(out) == n:
                return out
    raise SystemExit(f"{path} has only {len(out)} articles of {room}+ tokens; {n} are needed")


def parse_policy(spec: str, prompt_tokens: int) -> Tuple[str, Optional[int]]:
    """'full' -> (full, None); 'h2o-20%' -> 20% of the prompt; 'h2o-128' -> 128 entries (also local-/sink-)."""
    setting = parse_setting(spec)
    return setting.policy, setting.budget_for(prompt_tokens)


def make_llama(model: str, spec: str, prompt_tokens: int, max_tokens: int, n_seq: int, args) -> Llama:
    policy, budget = parse_policy(spec, prompt_tokens)
    n_ctx = cells_needed(n_seq, prompt_tokens=prompt_tokens, max_tokens=max_tokens, budget=budget, n_batch=args.n_batch,
                         kv_unified=args.kv_unified)
    return Llama(model, policy=policy, budget=budget, n_ctx=n_ctx, n_batch=args.n_batch, n_seq_max=n_seq,
                 kv_unified=args.kv_unified, n_threads=args.threads)


def time_batch(llm: Llama, prompts: List[List[int]], max_tokens: int) -> Dict[str, Any]:
    """Run one batch to exactly max_tokens per sequence, greedy; wall time, time to first token, latencies."""
    t0 = time.perf_counter()
    first = None
    ends: Dict[int, float] = {}
    for i, piece in llm.generate_batch(prompts, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True):
        now = time.perf_counter() - t0
        if first is None:
            first = now
        if piece is None:
            ends[i] = now
    wall = time.perf_counter() - t0
    n_gen = len(prompts) * max_tokens
    return {"wall_s": wall, "ttft_s": first, "tok_s": n_gen / wall,
            "decode_tok_s": len(prompts) * (max_tokens - 1) / (wall - first),
            "latency_s": sum(ends.values()) / len(ends), "latency_max_s": max(ends.values()),
            "kv_bytes": llm.kv_state().kv_bytes, "kv_cells": llm.n_ctx(),
            "finish": sorted(set(llm.finish_reasons))}


def run_peer(model: str, prompts: List[List[int]], max_tokens: int, banned: List[int], args) -> Dict[str, Any]:
    """llama-cpp-python, one sequence after another, full cache, its defaults otherwise."""
    import llama_cpp

    prompt_tokens = len(prompts[0])
    llm = llama_cpp.Llama(model, n_ctx=prompt_tokens + max_tokens + 16, n_batch=args.n_batch, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    bias = {t: float("-inf") for t in banned}
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.create_completion(p, max_tokens=max_tokens, temperature=0, logit_bias=bias)
        times.append(time.perf_counter() - t0)
        if out["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"llama-cpp-python generated {out['usage']['completion_tokens']} tokens")
    per_seq = sum(times) / len(times)
    kv = llm.n_ctx() * llama_cpp.llama_model_n_layer(llm.model) * llama_cpp.llama_model_n_head_kv(llm.model) * \
        (llama_cpp.llama_model_n_embd(llm.model) // llama_cpp.llama_model_n_head(llm.model)) * 2 * 2
    return {"per_seq_s": per_seq, "tok_s": max_tokens / per_seq, "kv_bytes": kv, "n_measured": len(prompts),
            "version": llama_cpp.__version__}


def quality_check(model: str, spec: str, rows: List[Tuple[List[int], str]], max_prompt: int, args) -> Dict[str, Any]:
    """Summaries batched vs one by one (same seeds): identical texts, and ROUGE of both against the references."""
    from rouge import Rouge

    prompts = [p for p, _ in rows]
    refs = [r for _, r in rows]
    batched = make_llama(model, spec, max_prompt, SUMMARY["max_tokens"], len(prompts), args)
    got = batched.generate_batch(prompts, seed=args.seed, **SUMMARY)
    single = make_llama(model, spec, max_prompt, SUMMARY["max_tokens"], 1, args)
    alone = [single.generate(p, seed=args.seed + i, **SUMMARY) for i, p in enumerate(prompts)]

    def rouge(texts):
        scores = [Rouge().get_scores(t.strip() or ".", r)[0] for t, r in zip(texts, refs)]
        return {k: sum(s[k]["f"] for s in scores) / len(scores) for k in ("rouge-1", "rouge-2", "rouge-l")}

    return {"n": len(prompts), "identical": sum(a == b for a, b in zip(got, alone)),
            "rouge_batched": rouge(got), "rouge_single": rouge(alone), "batched": got, "single": alone}


def main(argv=None) -> int:
    ap = experiment_parser("experiments.throughput", __doc__)
    ap.add_argument("--lengths", nargs="+", default=["512:512", "1024:1024"], help="PROMPT:GENERATED tokens")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--policies", nargs="+", default=["full", "h2o-20%", "h2o-128", "h2o-256"])
    ap.add_argument("--kv-limit-batch", type=int, default=4,
                    help="KV memory limit = the full cache of this many sequences; 0: skip the capped comparison")
    ap.add_argument("--max-batch", type=int, default=64, help="cap on the memory-capped batch (run time)")
    ap.add_argument("--peer", action="store_true", help="also llama-cpp-python, sequences one after another")
    ap.add_argument("--peer-seqs", type=int, default=2, help="sequences timed for llama-cpp-python")
    ap.add_argument("--quality", type=int, default=0, help="prompts for the batched-vs-single summary check")
    ap.add_argument("--n-batch", type=int, default=128)
    ap.add_argument("--kv-unified", action="store_true",
                    help="one cell space for all sequences (each attends all cells, masked) instead of a stream each")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args(argv)

    model = model_path(args.model)
    records = JsonlRecords(args.output.with_suffix(".jsonl"))
    done = records.done
    probe = Llama(model, n_ctx=256)
    per_cell = ModelInfo.load(model).kv_bytes_per_cell
    banned = probe.eog_tokens()

    def record(key: str, **fields) -> None:
        fields.update(key=key, model=os.path.basename(model), threads=args.threads, n_batch=args.n_batch,
                      kv_unified=args.kv_unified)
        records.add(fields)
        print(f"{key}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
                                     if k in ("tok_s", "decode_tok_s", "latency_s", "kv_bytes", "batch", "identical")),
              file=sys.stderr, flush=True)

    for spec_len in args.lengths:
        P, G = (int(x) for x in spec_len.split(":"))
        limit = padded_cells(args.kv_limit_batch * (P + G), args.kv_limit_batch, args.kv_unified) * per_cell \
            if args.kv_limit_batch else 0
        capped = {}
        for spec in args.policies:
            if limit:
                policy, budget = parse_policy(spec, P)
                llm = Llama.for_kv_limit(model, limit, prompt_tokens=P, max_tokens=G, budget=budget,
                                         policy=policy, n_batch=args.n_batch, kv_unified=args.kv_unified)
                capped[spec] = min(llm.n_seq_max, args.max_batch)
                del llm
        n_prompts = max(args.batch_sizes + list(capped.values()) + [args.quality, args.peer_seqs])
        rows = fixed_length_prompts(probe, args.input_path, P, n_prompts)
        prompts = [p for p, _ in rows]

        for B in args.batch_sizes:
            for spec in args.policies:
                key = f"{P}+{G}/{spec}/batch{B}"
                if key not in done:
                    llm = make_llama(model, spec, P, G, B, args)
                    record(key, kind="batch", prompt=P, gen=G, policy=spec, batch=B, **time_batch(llm, prompts[:B], G))
                    del llm
        for spec, B in capped.items():
            key = f"{P}+{G}/{spec}/capped"
            if key not in done:
                llm = make_llama(model, spec, P, G, B, args)
                record(key, kind="capped", prompt=P, gen=G, policy=spec, batch=B, kv_limit=limit,
                       **time_batch(llm, prompts[:B], G))
                del llm
        if args.peer and f"{P}+{G}/llama-cpp-python" not in done:
            record(f"{P}+{G}/llama-cpp-python", kind="peer", prompt=P, gen=G, policy="llama-cpp-python", batch=1,
                   **run_peer(model, prompts[: args.peer_seqs], G, banned, args))
        if args.quality:
            for spec in args.policies:
                key = f"{P}+{G}/{spec}/quality"
                if key not in done:
                    record(key, kind="quality", prompt=P, policy=spec, batch=args.quality,
                           **quality_check(model, spec, rows[: args.quality], P, args))

    write_report(records.rows, args.output)
    return 0


def write_report(records: List[Dict[str, Any]], output: Path) -> None:
    lengths = sorted({(r["prompt"], r["gen"]) for r in records if "gen" in r})
    lines = []
    for P, G in lengths:
        rs = [r for r in records if r.get("prompt") == P and r.get("gen") == G]
        batch = [r for r in rs if r["kind"] == "batch"]
        peer = next((r for r in rs if r["kind"] == "peer"), None)
        sizes = sorted({r["batch"] for r in batch})
        specs = list(dict.fromkeys(r["policy"] for r in batch))
        lines += [f"### {P} prompt + {G} generated tokens", "",
                  "Same batch size: throughput, generated tokens/s over the whole batch (latency until the batch's "
                  "last token, s)", "",
                  "| policy | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for spec in specs:
            cells = []
            for b in sizes:
                r = next((r for r in batch if r["policy"] == spec and r["batch"] == b), None)
                cells.append("-" if r is None else f"{r['tok_s']:.1f} ({r['latency_max_s']:.1f})")
            lines.append(f"| {spec} | " + " | ".join(cells) + " |")
        if peer:
            lines.append("| llama-cpp-python, one after another | " + " | ".join(
                f"{peer['tok_s']:.1f} ({b * peer['per_seq_s']:.1f})" for b in sizes) + " |")
        capped = [r for r in rs if r["kind"] == "capped"]
        if capped:
            limit = capped[0]["kv_limit"]
            lines += ["", f"Same KV memory ({limit / 2**20:.1f} MiB): each policy's largest batch", "",
                      "| policy | batch | KV allocated (MiB) | tokens/s | decode tokens/s | latency (s) | vs full |",
                      "|---|---|---|---|---|---|---|"]
            full = next((r for r in capped if r["policy"] == "full"), None)
            for r in capped:
                ratio = f"{r['tok_s'] / full['tok_s']:.2f}x" if full else "-"
                lines.append(f"| {r['policy']} | {r['batch']} | {r['kv_bytes'] / 2**20:.1f} | {r['tok_s']:.1f} | "
                             f"{r['decode_tok_s']:.1f} | {r['latency_max_s']:.1f} | {ratio} |")
            if peer:
                ratio = f"{peer['tok_s'] / full['tok_s']:.2f}x" if full else "-"
                lines.append(f"| llama-cpp-python | 1 | {peer['kv_bytes'] / 2**20:.1f} | {peer['tok_s']:.1f} | - | "
                             f"{peer['per_seq_s']:.1f} | {ratio} |")
        lines.append("")
    quality = [r for r in records if r["kind"] == "quality"]
    if quality:
        lines += ["### Batched vs one by one (same seeds)", "",
                  "| prompt | policy | batch | identical texts | ROUGE-2 batched | ROUGE-2 one by one | "
                  "ROUGE-1 batched | ROUGE-1 one by one |", "|---|---|---|---|---|---|---|---|"]
        for r in quality:
            lines.append(f"| {r['prompt']} | {r['policy']} | {r['batch']} | {r['identical']}/{r['n']} | "
                         f"{r['rouge_batched']['rouge-2']:.4f} | {r['rouge_single']['rouge-2']:.4f} | "
                         f"{r['rouge_batched']['rouge-1']:.4f} | {r['rouge_single']['rouge-1']:.4f} |")
        lines.append("")
    output.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(records, lengths, output)


def plot(records: List[Dict[str, Any]], lengths, output: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    if not lengths:
        return
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, (P, G) in zip(axes[0], lengths):
        rs = [r for r in records if r.get("prompt") == P and r.get("gen") == G]
        for spec in dict.fromkeys(r["policy"] for r in rs if r["kind"] == "batch"):
            pts = sorted((r["batch"], r["tok_s"]) for r in rs if r["kind"] == "batch" and r["policy"] == spec)
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=spec)
        peer = next((r for r in rs if r["kind"] == "peer"), None)
        if peer:
            ax.axhline(peer["tok_s"], color="k", linestyle=":", label="llama-cpp-python (sequential)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{P} + {G} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, output.with_suffix(".png"))

    capped = [(P, G) for P, G in lengths
              if any(r["kind"] == "capped" and r["prompt"] == P and r["gen"] == G for r in records)]
    if not capped:
        return
    fig, axes = plt.subplots(1, len(capped), figsize=(6 * len(capped), 4.5), squeeze=False)
    for ax, (P, G) in zip(axes[0], capped):
        rs = [r for r in records if r.get("prompt") == P and r.get("gen") == G and r["kind"] in ("capped", "peer")]
        names = [r["policy"] + ("" if r["kind"] == "peer" else f"\nbatch {r['batch']}") for r in rs]
        ax.bar(range(len(rs)), [r["tok_s"] for r in rs], color=["C%d" % i for i in range(len(rs))])
        ax.set_xticks(range(len(rs)), names, fontsize=8)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{P} + {G} tokens, KV limit {rs[0].get('kv_limit', 0) / 2**20:.0f} MiB")
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, output.parent / (output.name + "-memory.png"))


if __name__ == "__main__":
    sys.exit(main())
