"""Decode and prefill speed of two installs of h2o_local measured side by side, interleaved, in one run: the
working tree against an earlier commit (a restructure must not cost speed).

    # the earlier commit, built into its own folder and run by a Python that does not see this install
    git worktree add /tmp/base <commit> && pip install --target /tmp/base-site /tmp/base
    python -m benchmarks.side_by_side --baseline-python python3 --baseline-path /tmp/base-site \\
        --baseline-module h2o_local.bench --out results/speed/side-by-side

Each measurement runs in its own process (`--one` of either benchmark); runs alternate between the two installs,
repeat after repeat, so machine noise falls on both. Reports medians and the ratio new / baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from experiments.common import parse_setting, table

REPO_ROOT = Path(__file__).resolve().parents[1]


def measure(python: str, module: str, cfg: Dict[str, Any], env: Dict[str, str]) -> Dict[str, Any]:
    proc = subprocess.run([python, "-m", module, "--one", json.dumps(cfg)], capture_output=True, text=True, env=env,
                          cwd=env.get("H2O_SIDE_CWD", str(REPO_ROOT)))
    if proc.returncode != 0:
        raise RuntimeError(f"{module}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file, or smollm2 (the default), qwen05b, qwen15b")
    ap.add_argument("--baseline-python", required=True)
    ap.add_argument("--baseline-path", required=True, help="PYTHONPATH of the earlier install")
    ap.add_argument("--baseline-module", default="h2o_local.bench")
    ap.add_argument("--settings", nargs="+", default=["full", "h2o-256", "sink-256"])
    ap.add_argument("--depths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from experiments.models import model_path

    model = model_path(args.model)
    base_env = {**os.environ, "PYTHONPATH": args.baseline_path, "H2O_SIDE_CWD": "/"}
    new_env = {**os.environ}
    records: List[Dict[str, Any]] = []
    for depth in args.depths:
        for rep in range(args.repeats):
            for label in args.settings:
                s = parse_setting(label)
                cfg = {"runner": "h2o_local", "name": label, "model": model, "policy": s.policy, "budget": s.budget,
                       "rolling": s.rolling, "roll_interval": s.roll_interval, "export_scores": s.export_scores,
                       "depth": depth, "decode_tokens": args.decode_tokens, "n_batch": args.n_batch,
                       "threads": args.threads}
                for which, python, module, env in (("baseline", args.baseline_python, args.baseline_module, base_env),
                                                   ("new", sys.executable, "benchmarks.bench", new_env)):
                    r = measure(python, module, cfg, env)
                    records.append({"which": which, "setting": label, "depth": depth, "repeat": rep, **r})
                    print(f"depth {depth} {label} {which}: prefill {r['prefill_tok_s']:.0f} tok/s, "
                          f"decode {r['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
                args.out.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                     "records": records}, indent=1))

    def med(which, label, depth, key):
        return statistics.median(r[key] for r in records
                                 if r["which"] == which and r["setting"] == label and r["depth"] == depth)

    rows = []
    for depth in args.depths:
        for label in args.settings:
            row = [depth, label]
            for key in ("decode_tok_s", "decode_mean_tok_s", "prefill_tok_s"):
                b, n = med("baseline", label, depth, key), med("new", label, depth, key)
                row += [f"{b:.1f}", f"{n:.1f}", f"{n / b:.3f}"]
            rows.append(row)
    lines = [f"# Side by side: this tree vs {args.baseline_path} ({Path(model).name}, {args.threads} threads, "
             f"{args.repeats} repeats interleaved, medians)", ""]
    lines += table(["depth", "setting", "decode base", "decode new", "ratio", "decode mean base", "decode mean new",
                    "ratio", "prefill base", "prefill new", "ratio"], rows)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
