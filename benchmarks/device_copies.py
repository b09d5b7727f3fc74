"""What a bounded prompt pays for moving its cache between the device and the host: the same prompt with and without
compaction (the kept cells moved to the bottom of the cache after the prompt) and with recall (every evicted entry
copied to host memory), side by side in one process, each after a warm-up run of the same prompt (a device compiles
its kernels on first use). On a device each transfer is a synchronous call, so what these cost is counted in calls,
not bytes: `random_model.py --shape host-cost-28` (28 layers, little arithmetic) shows it most plainly.

    python -m benchmarks.device_copies --model /tmp/hc28.gguf --depth 2048 --n-gpu-layers -1 --out results/speed/x
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.bench import depth_prompt
from experiments.common import parse_setting

DEFAULT = "tova-256+s4+q32+p9+f12+r32"  # the default policy's shape (Llama(path, budget=256))
SUFFIXES = ("+nocompact", "", "+recall")


PARTS = ("evict_seconds", "decode_seconds", "compact_seconds", "probe_seconds")  # KVState's, after the prompt


def prefill_seconds(model: str, label: str, depth: int, repeats: int, n_gpu_layers: int,
                    threads: int) -> List[Dict[str, float]]:
    """Each timed run's prompt seconds ("prompt") and where they went (PARTS: recall's spill is in the evictions)."""
    from h2o_local import Llama

    llm = Llama(model, **parse_setting(label).llama_kwargs(), n_ctx=0, n_batch=512, n_threads=threads,
                n_gpu_layers=n_gpu_layers)
    prompt = depth_prompt(lambda t: llm.tokenize(t, add_bos=False), depth)
    times = []
    for i in range(repeats + 1):  # the first run warms the device up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        if i > 0:
            st = llm.kv_state()
            times.append({"prompt": time.perf_counter() - t0, **{k: getattr(st, k) for k in PARTS}})
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    labels = [DEFAULT + fa + s for fa in ("+fa", "") for s in SUFFIXES]
    runs: Dict[str, List[Dict[str, float]]] = {label: [] for label in labels}
    for _ in range(args.repeats):  # interleaved: a drift of the machine spreads over every setting
        for label in labels:
            runs[label] += prefill_seconds(args.model, label, args.depth, 1, args.n_gpu_layers, args.threads)
    med = {label: {k: statistics.median(r[k] for r in rs) for k in ("prompt",) + PARTS} for label, rs in runs.items()}

    lines = [f"# Device copies: {Path(args.model).name}, {args.depth}-token prompt, n_gpu_layers {args.n_gpu_layers}",
             "", f"Median of {args.repeats} runs (each after a warm-up run), interleaved; where the prompt's seconds "
             "went (recall's spill is in the evictions).", "",
             "| setting | prompt s | against +nocompact | evictions s | its decodes s | compaction s | probes s |",
             "|---|---|---|---|---|---|---|"]
    for label in labels:
        m = med[label]
        base = med[label.replace("+recall", "").replace("+nocompact", "") + "+nocompact"]["prompt"]
        lines.append(f"| {label} | {m['prompt']:.3f} | {m['prompt'] / base:.2f}x | "
                     + " | ".join(f"{m[k]:.3f}" for k in PARTS) + " |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "seconds": runs}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
