"""Benchmark: prompt and decode speed and KV memory vs context depth, score-export and rolling overhead, and the
decode roofline, side by side with llama.cpp's own API in this build ("llama.cpp", cpp/plain_run.h: nothing of ours
around it) and llama-cpp-python (unpatched, where installed) on the same model, threads and batch size.

    pip install ".[bench]"
    python -m benchmarks.bench --depths 512 2048 8192 --budgets 128 256 512 1024 --repeats 3 --out results/speed/bench

Every setting runs in its own subprocess (peak resident memory is per process), after a warm-up on its own prompt
(`--warmup-tokens`: a device loads its kernels on first use), and the settings of one depth run interleaved, repeat
after repeat, so that machine noise spreads over all of them; medians are reported.
Writes OUT.json (every measurement), OUT.md (tables) and OUT.png (decode speed and KV memory vs depth).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from experiments.common import parse_setting, save_figure

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_TEXT = REPO_ROOT.parent / "shared" / "data" / "xsum_0shot_dev.jsonl"


# ---------------------------------------------------------------------------------------------- one measurement
def _text() -> str:
    if SHARED_TEXT.is_file():
        with open(SHARED_TEXT) as f:
            return "\n".join(json.loads(line)["article"] for line in f)
    words = "the lighthouse keeper wrote a long letter about the sea and the ships that passed at night".split()
    return " ".join(words[(i * 7) % len(words)] for i in range(200_000))


def depth_prompt(tokenize, depth: int) -> List[int]:
    tokens = tokenize(_text())
    while len(tokens) < depth:
        tokens = tokens + tokens
    return tokens[:depth]


def _peak_rss() -> int:
    """Peak resident bytes of this process (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def warmup_tokens(cfg: Dict[str, Any]) -> int:
    """Tokens of the prompt read (and one step decoded) before the timed run, then forgotten: cfg's "warmup_tokens",
    or by default (-1) four chunks and, in a bounded cache, two past its budget, so that its evictions and probes run
    too. A GPU loads each kernel on its first use (cuBLAS picks its own on a shape's first call): a cold run times that
    loading, which a chat pays once per process; llama-bench warms up the same way."""
    n = cfg.get("warmup_tokens", -1)
    if n < 0:
        n = max(4 * cfg["n_batch"], (cfg.get("budget") or 0) + 2 * cfg["n_batch"])
    return min(n, cfg["depth"])


def measure(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Warm up (warmup_tokens), then prefill `depth` tokens and decode `decode_tokens` greedily one by one; time both."""
    depth, n_dec, n_batch, threads = cfg["depth"], cfg["decode_tokens"], cfg["n_batch"], cfg["threads"]
    n_warm = warmup_tokens(cfg)
    if cfg["runner"] == "llama_cpp":
        import llama_cpp

        # the same layers on the same device as ours (llama-cpp-python's own default is 0: the CPU)
        llm = llama_cpp.Llama(cfg["model"], n_ctx=depth + n_dec + 16, n_batch=n_batch, n_ubatch=n_batch,
                              n_threads=threads, n_threads_batch=threads, flash_attn=cfg.get("flash_attn", False),
                              n_gpu_layers=cfg.get("n_gpu_layers", 0), verbose=False)
        prompt = depth_prompt(lambda t: llm.tokenize(t.encode(), add_bos=False), depth)
        n_vocab = llm.n_vocab()
        if n_warm:
            llm.eval(prompt[:n_warm] + prompt[:1])
            llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t_prefill = time.perf_counter() - t0
        steps = []
        for _ in range(n_dec):
            # its eval keeps no logits (its sampler reads them from the context): read them there, without a copy
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
            t0 = time.perf_counter()
            llm.eval([tok])
            steps.append(time.perf_counter() - t0)
        # llama-cpp-python has no call for it: F16 K and V of every layer, the same cells as ours
        m = llm.model
        head_dim = llama_cpp.llama_model_n_embd(m) // llama_cpp.llama_model_n_head(m)
        kv_cells = llm.n_ctx()
        kv_bytes = kv_cells * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m) * head_dim * 2 * 2
        cells = llm.n_tokens
        model_bytes = llama_cpp.llama_model_size(m)
        evict_us = head_moves = prefill_parts = None
    elif cfg["runner"] == "plain":
        from h2o_local import Llama, ModelInfo, _engine

        vocab = Llama(cfg["model"], policy="full", n_ctx=64, n_gpu_layers=0)
        prompt = depth_prompt(lambda t: vocab.tokenize(t, add_bos=False), depth)
        del vocab
        run = _engine.plain_run(cfg["model"], prompt, n_dec, n_gpu_layers=cfg.get("n_gpu_layers", 0),
                                flash_attn=cfg.get("flash_attn", False), n_batch=n_batch, n_threads=threads,
                                warmup_tokens=n_warm)
        t_prefill, steps = run["prefill_s"], run["step_s"]
        info = ModelInfo.load(cfg["model"])
        kv_cells = cells = run["n_ctx"]
        kv_bytes = kv_cells * info.kv_bytes_per_cell
        model_bytes = run["model_bytes"]
        evict_us = head_moves = prefill_parts = None
    else:
        from h2o_local import Llama

        setting = parse_setting(cfg["name"])
        kwargs = setting.llama_kwargs()
        n_ctx = depth + n_dec + 16 if setting.budget is None or setting.after_full else 0
        if setting.after_full:  # the whole prompt in the full cache (scores exported), then compressed to the policy
            kwargs.update(policy="full", export_scores=True)
        kwargs.setdefault("n_batch", n_batch)
        llm = Llama(cfg["model"], **kwargs, n_ctx=n_ctx, n_threads=threads,
                    n_gpu_layers=cfg.get("n_gpu_layers", 0))
        prompt = depth_prompt(lambda t: llm.tokenize(t, add_bos=False), depth)
        if n_warm:
            llm.eval(prompt[:n_warm])
            llm.eval(prompt[:1])
            llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        if setting.after_full:
            llm.set_policy(setting.policy_value())
            llm.compress()
        t_prefill = time.perf_counter() - t0
        before = llm.kv_state()
        # where the prompt's time went: the probes' decodes, the evictions (choice and removal), the prompt's own
        # decodes (the device's work and the wait for it), compaction; the rest is the host's bookkeeping
        prefill_parts = {"probe_s": before.probe_seconds, "evict_s": before.evict_seconds, "n_probes": before.n_probes,
                         "decode_s": before.decode_seconds, "compact_s": before.compact_seconds}
        steps = []
        for _ in range(n_dec):
            tok = int(np.argmax(llm.last_logits()))
            t0 = time.perf_counter()
            llm.eval([tok])
            steps.append(time.perf_counter() - t0)
        st = llm.kv_state()
        evict_us = (st.evict_seconds - before.evict_seconds) / n_dec * 1e6
        head_moves = (st.n_head_moves - before.n_head_moves) / n_dec
        kv_bytes = st.kv_bytes
        kv_cells = st.kv_cells
        cells = st.n_cells
        model_bytes = llm.info.model_bytes
    return {
        "prefill_tok_s": depth / t_prefill,
        "decode_tok_s": 1.0 / statistics.median(steps),
        "decode_mean_tok_s": len(steps) / sum(steps),  # counts what only some steps pay (a K shift every n tokens)
        "kv_bytes": kv_bytes,
        "kv_cells": kv_cells,
        "cells_in_use": cells,
        "model_bytes": model_bytes,
        "peak_rss": _peak_rss(),
        "evict_us_per_step": evict_us,     # eviction's own time per decode step (choice, moves, removal)
        "head_moves_per_step": head_moves,  # per-head cells: K/V slices moved per decode step
        "prefill_s": t_prefill,
        "prefill_parts": prefill_parts,     # seconds of the prompt's time in probes and evictions (ours only)
    }


# ---------------------------------------------------------------------------------------------- the whole run
def memory_bandwidth(size_mib: int = 512, repeats: int = 5, device: bool = False) -> Tuple[float, str]:
    """Bytes/s of a large array copy (read + write), the best of a few runs, and whose: with `device`, the first CUDA
    GPU's (the weights' memory when every layer is offloaded) through PyTorch where it is installed, else the host's."""
    if device:
        try:
            import torch

            if torch.cuda.is_available():
                x = torch.ones(size_mib * 2**20 // 4, device="cuda")
                y = torch.empty_like(x)
                best = 0.0
                for _ in range(repeats + 1):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    y.copy_(x)
                    end.record()
                    torch.cuda.synchronize()
                    best = max(best, 2 * x.numel() * 4 / (start.elapsed_time(end) / 1e3))
                del x, y
                torch.cuda.empty_cache()  # the runs are processes of their own: leave them the memory
                return best, torch.cuda.get_device_name(0)
        except ImportError:
            pass
    a = np.ones(size_mib * 2**20 // 8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t0))
    return best, "the host"


def settings(budgets: List[int], peer: bool, labels: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Every setting by its label (experiments.common.parse_setting; by default full, local, sink, h2o and h2o with
    rolling at each budget), and llama-cpp-python as the peer."""
    if not labels:
        labels = ["full", "full+scores"]
        for b in budgets:
            labels += [f"local-{b}", f"sink-{b}", f"h2o-{b}", f"h2o-{b}+roll", f"h2o-{b}+roll64"]
    out: List[Dict[str, Any]] = []
    for label in labels:
        s = parse_setting(label)
        out.append({"name": label, "policy": s.policy, "budget": s.budget, "rolling": s.rolling,
                    "export_scores": s.export_scores})
    # the baselines, with flash attention too where a setting asks for it (llama.cpp's default on a GPU): llama.cpp's
    # own API in this build (cpp/plain_run.h), and llama-cpp-python (unpatched) where it is installed
    for fa in (False, True) if any(label.endswith("+fa") for label in labels) else (False,):
        runners = (("llama.cpp", "plain"),) + ((("llama-cpp-python", "llama_cpp"),) if peer else ())
        for name, runner in runners:
            out.append({"name": name + ("+fa" if fa else ""), "runner": runner, "policy": "full", "budget": None,
                        "rolling": False, "export_scores": False, "flash_attn": fa})
    return out


def is_baseline(name: str) -> bool:
    """llama.cpp's own API or llama-cpp-python: no setting of ours."""
    return name.startswith(("llama.cpp", "llama-cpp-python"))


def run_one(cfg: Dict[str, Any]) -> Dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--one", json.dumps(cfg)],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> Dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def summarize(records: List[Dict[str, Any]]) -> Dict[tuple, Dict[str, Any]]:
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in records:
        if "error" not in r:
            groups.setdefault((r["name"], r["depth"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {k: statistics.median([r[k] for r in rs]) if rs[0].get(k) is not None else None
                    for k in ("prefill_tok_s", "decode_tok_s", "decode_mean_tok_s", "kv_bytes", "cells_in_use",
                              "model_bytes", "peak_rss", "evict_us_per_step", "head_moves_per_step")}
        out[key]["n"] = len(rs)
    return out


def write_report(out: Path, meta: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    summary = summarize(records)
    names = list(dict.fromkeys(r["name"] for r in records))
    depths = sorted({r["depth"] for r in records})
    bw = meta["memory_bandwidth"]
    lines = [f"# Benchmark: {Path(meta['model']).name}", "",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; threads {meta['threads']}, "
             f"n_batch {meta['n_batch']}; load average before/after {meta['load_before']:.2f} / {meta.get('load_after', float('nan')):.2f}; "
             f"copy bandwidth {bw / 1e9:.1f} GB/s ({meta.get('bandwidth_of', 'the host')}); {meta['repeats']} repeats, medians; {meta['decode_tokens']} "
             f"decode steps per run (median step); "
             + _warmup_words(meta.get("warmup_tokens", 0)), ""]
    for metric, title in (("decode_tok_s", "Decode tokens/s (median step)"),
                          ("decode_mean_tok_s", "Decode tokens/s (mean over steps)"), ("prefill_tok_s", "Prompt tokens/s"),
                          ("kv_bytes", "KV MiB allocated"), ("peak_rss", "Peak RSS MiB"),
                          ("evict_us_per_step", "Eviction per decode step, microseconds (choice, moves, removal)"),
                          ("head_moves_per_step", "Per-head K/V slices moved per decode step")):
        lines += [f"## {title} vs context depth", "", "| setting | " + " | ".join(map(str, depths)) + " |",
                  "|---|" + "---|" * len(depths)]
        for name in names:
            cells = []
            for d in depths:
                s = summary.get((name, d))
                v = None if s is None else s[metric]
                if v is None:
                    cells.append("-")
                elif metric in ("kv_bytes", "peak_rss"):
                    cells.append(f"{v / 2**20:.1f}")
                else:
                    cells.append(f"{v:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")

    lines += _prefill_parts_table(records, names, depths)
    lines += ["## Ratios (same run)", "", "| depth | comparison | ratio |", "|---|---|---|"]
    for d in depths:
        def val(name, metric):
            s = summary.get((name, d))
            return None if s is None else s[metric]
        pairs = [("decode h2o-256 / full", "h2o-256", "full", "decode_tok_s"),
                 ("decode full / llama-cpp-python", "full", "llama-cpp-python", "decode_tok_s"),
                 ("prefill full / llama-cpp-python", "full", "llama-cpp-python", "prefill_tok_s"),
                 ("decode full+fa / llama-cpp-python+fa", "full+fa", "llama-cpp-python+fa", "decode_tok_s"),
                 ("prefill full+fa / llama-cpp-python+fa", "full+fa", "llama-cpp-python+fa", "prefill_tok_s"),
                 ("decode full / llama.cpp", "full", "llama.cpp", "decode_tok_s"),
                 ("prefill full / llama.cpp", "full", "llama.cpp", "prefill_tok_s"),
                 ("decode full+fa / llama.cpp+fa", "full+fa", "llama.cpp+fa", "decode_tok_s"),
                 ("prefill full+fa / llama.cpp+fa", "full+fa", "llama.cpp+fa", "prefill_tok_s"),
                 ("decode llama.cpp+fa / llama-cpp-python+fa", "llama.cpp+fa", "llama-cpp-python+fa", "decode_tok_s"),
                 ("decode full+scores / full", "full+scores", "full", "decode_tok_s"),
                 ("prefill full+scores / full", "full+scores", "full", "prefill_tok_s")]
        for b in meta["budgets"]:
            pairs += [(f"decode h2o-{b} / local-{b}", f"h2o-{b}", f"local-{b}", "decode_tok_s"),
                      (f"prefill h2o-{b} / local-{b}", f"h2o-{b}", f"local-{b}", "prefill_tok_s"),
                      (f"decode (mean) h2o-{b}+roll / h2o-{b}", f"h2o-{b}+roll", f"h2o-{b}", "decode_mean_tok_s"),
                      (f"decode (mean) h2o-{b}+roll64 / h2o-{b}", f"h2o-{b}+roll64", f"h2o-{b}",
                       "decode_mean_tok_s")]
        for name in names:  # every other policy against h2o at its budget (the scorers' and probes' cost)
            if not is_baseline(name):
                st = parse_setting(name)
                if st.budget and st.policy not in ("h2o", "full", "local") and st.policy_label == name:
                    pairs += [(f"decode {name} / h2o-{st.budget}", name, f"h2o-{st.budget}", "decode_tok_s"),
                              (f"prefill {name} / h2o-{st.budget}", name, f"h2o-{st.budget}", "prefill_tok_s")]
        for name in names:  # a bounded cache against the full one with the same flash attention and n_batch
            if not is_baseline(name) and parse_setting(name).budget:
                full = "+".join(["full"] + [x for x in name.split("+")[1:]
                                            if x == "fa" or x.startswith(("batch", "ubatch"))])
                pairs += [(f"prefill {name} / {full}", name, full, "prefill_tok_s"),
                          (f"decode {name} / {full}", name, full, "decode_tok_s")]
        for name in names:  # a suffix against the same setting without it (+nocompact, +fa, +kq8_0, ...)
            base = name.rsplit("+", 1)[0]
            if "+" in name and base in names:
                pairs += [(f"decode {name} / {base}", name, base, "decode_tok_s"),
                          (f"prefill {name} / {base}", name, base, "prefill_tok_s")]
        for label, a, b, metric in pairs:
            va, vb = val(a, metric), val(b, metric)
            if va and vb:
                lines.append(f"| {d} | {label} | {va / vb:.3f} |")
        short = summary.get(("full", depths[0]))
        if d != depths[0] and short:  # a bounded cache deep in a text against the full cache at the shortest depth
            for name in names:
                s = summary.get((name, d))
                if s and not name.startswith("full") and not is_baseline(name) and parse_setting(name).budget:
                    lines.append(f"| {d} | decode {name} / full at {depths[0]} tokens | "
                                 f"{s['decode_tok_s'] / short['decode_tok_s']:.3f} |")
    lines += ["", "## Decode roofline", "",
              "Bytes read per generated token = weights + KV in use (cells x bytes per cell); roofline tokens/s = "
              "copy bandwidth / bytes per token.", "",
              "| setting | depth | MiB per token | roofline tok/s | measured tok/s | fraction |", "|---|---|---|---|---|---|"]
    for (name, d), s in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if s["kv_bytes"] is None or s["model_bytes"] is None:
            continue
        cell_bytes = s["kv_bytes"] / max(1, _cells_allocated(records, name, d))
        per_tok = s["model_bytes"] + s["cells_in_use"] * cell_bytes
        roof = bw / per_tok
        lines.append(f"| {name} | {d} | {per_tok / 2**20:.1f} | {roof:.0f} | {s['decode_tok_s']:.1f} | "
                     f"{s['decode_tok_s'] / roof:.2f} |")
    errors = [r for r in records if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {r['name']} @ {r['depth']}: {r['error']}" for r in errors]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(out.with_suffix(".png"), summary, names, depths)


def _warmup_words(n: int) -> str:
    if n < 0:
        return "each run after a warm-up on its prompt's first four chunks (or two chunks past its budget)."
    return f"each run after a warm-up on its prompt's first {n} tokens." if n else "cold runs (no warm-up)."


PREFILL_PARTS = ("probe_s", "evict_s", "decode_s", "compact_s")  # measure()'s prefill_parts, in the table's order


def _prefill_parts_table(records: List[Dict[str, Any]], names: List[str], depths: List[int]) -> List[str]:
    """The prompt's time by part (medians over repeats): the probes' decodes, the evictions, the prompt's own decodes
    (the device's work and the wait for it), compaction, and the rest (the host's bookkeeping), for our settings."""
    rows = []
    for name in names:
        for d in depths:
            rs = [r for r in records if r["name"] == name and r["depth"] == d and "error" not in r
                  and r.get("prefill_parts")]
            if not rs:
                continue
            total = statistics.median(r["prefill_s"] for r in rs)
            part = {k: statistics.median(r["prefill_parts"].get(k, 0.0) for r in rs) for k in PREFILL_PARTS + ("n_probes",)}
            rest = total - sum(part[k] for k in PREFILL_PARTS)
            rows.append(f"| {name} | {d} | {total * 1e3:.0f} | {part['n_probes']:.0f} | "
                        + " | ".join(f"{part[k] * 1e3:.0f} ({part[k] / total:.0%})" for k in PREFILL_PARTS)
                        + f" | {rest * 1e3:.0f} ({rest / total:.0%}) |")
    if not rows:
        return []
    return ["## The prompt's time by part, milliseconds", "",
            "| setting | depth | prompt | probes run | in probes | in evictions | in its decodes | in compaction | "
            "the rest (host) |", "|---|---|---|---|---|---|---|---|---|"] + rows + [""]


def _cells_allocated(records, name, depth) -> int:
    for r in records:
        if r["name"] == name and r["depth"] == depth and "kv_cells" in r:
            return r["kv_cells"]
    return 1


def _plot(path: Path, summary, names, depths) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install '.[bench]')", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        xs = [d for d in depths if (name, d) in summary]
        if not xs:
            continue
        style = "--" if "local" in name or "sink" in name else "-"
        ax1.plot(xs, [summary[(name, d)]["decode_tok_s"] for d in xs], style, marker="o", label=name)
        kv = [summary[(name, d)]["kv_bytes"] for d in xs]
        if all(v is not None for v in kv):
            ax2.plot(xs, [v / 2**20 for v in kv], style, marker="o", label=name)
    for ax, title, ylabel in ((ax1, "Decode speed", "tokens/s"), (ax2, "KV cache allocated", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens seen)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file, or smollm2 (the default), qwen05b, qwen15b")
    ap.add_argument("--depths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--settings", nargs="+", help="setting labels to run instead of the default set (snapkv-256 ...)")
    ap.add_argument("--only", nargs="+", help="run only these setting names (e.g. full h2o-256 llama-cpp-python)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--n-gpu-layers", type=int, default=0, help="layers offloaded to the GPU (-1: all)")
    ap.add_argument("--warmup-tokens", type=int, default=-1,
                    help="prompt tokens read before each timed run, then forgotten (-1: four chunks, or two past the "
                         "budget; 0: cold runs, which time a device's kernel loading)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-cpp-python (llama.cpp's own API in this build still runs)")
    ap.add_argument("--out", type=Path, default=Path("results/speed/bench"))
    ap.add_argument("--report", type=Path, nargs="+", help="only write the report of these JSON files (merged)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.one:
        cfg = json.loads(args.one)
        print(json.dumps(measure(cfg)))
        return 0
    if args.report:
        loaded = [json.loads(p.read_text()) for p in args.report]
        meta = loaded[0]["meta"]
        meta["budgets"] = sorted({b for d in loaded for b in d["meta"]["budgets"]})
        meta["sources"] = [str(p) for p in args.report]
        records = [r for d in loaded for r in d["records"]]
        write_report(args.out, meta, records)
        print(args.out.with_suffix(".md").read_text())
        return 0

    from experiments.models import model_path

    model = model_path(args.model)
    peer = not args.no_peer
    if peer:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed: running without the peer (pip install '.[bench]')",
                  file=sys.stderr)
            peer = False
    todo = settings(args.budgets, peer, args.settings)
    if args.only:
        todo = [s for s in todo if s["name"] in args.only]
    bandwidth, bandwidth_of = memory_bandwidth(device=args.n_gpu_layers != 0)
    meta = {"model": model, "machine": machine(), "threads": args.threads, "n_batch": args.n_batch, "n_gpu_layers": args.n_gpu_layers,
            "warmup_tokens": args.warmup_tokens, "repeats": args.repeats, "decode_tokens": args.decode_tokens, "budgets": args.budgets,
            "depths": args.depths, "load_before": os.getloadavg()[0], "memory_bandwidth": bandwidth, "bandwidth_of": bandwidth_of}
    records: List[Dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = len(todo) * len(args.depths) * args.repeats
    done = 0
    t_start = time.time()
    for depth in args.depths:
        for rep in range(args.repeats):
            for s in todo:
                cfg = {"runner": "h2o_local", **s, "model": model, "depth": depth, "decode_tokens": args.decode_tokens,
                       "n_batch": args.n_batch, "threads": args.threads, "n_gpu_layers": args.n_gpu_layers,
                       "warmup_tokens": args.warmup_tokens}
                r = run_one(cfg)
                records.append({**s, "depth": depth, "repeat": rep, **r})
                done += 1
                shown = "error: " + r["error"] if "error" in r else \
                    f"prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
                print(f"[{done}/{total} {time.time() - t_start:.0f}s] depth {depth} {s['name']}: {shown}",
                      file=sys.stderr, flush=True)
                args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    meta["load_after"] = os.getloadavg()[0]
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    write_report(args.out, meta, records)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
