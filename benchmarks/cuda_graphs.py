"""Whether llama.cpp's CUDA graphs run in a decode (issue 51.6): each setting decodes greedily after a prompt with
llama.cpp's log on, and the ggml-cuda lines of the decode are counted. A graph that is captured once and replayed
logs "warmup complete" once (and "reused" where llama.cpp reuses its graph); one whose nodes change every step logs
"warmup reset" each step and is launched op by op, a fixed cost per layer that a small model feels most. On a build
without CUDA every count is 0.

    python -m benchmarks.cuda_graphs --model M.gguf --settings full+fa tova-256+s4+q32+p9+f12+r32+fa --out DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO_ROOT = Path(__file__).resolve().parents[1]
MARK = "### decode starts"
# the ggml-cuda log lines counted, by what they say
LINES = {"warmup_complete": "CUDA graph warmup complete", "warmup_reset": "CUDA graph warmup reset",
         "reused": "CUDA Graph id", "disabled": "disabling CUDA graphs"}

CHILD = """
import sys, numpy as np
from h2o_local import Llama
from experiments.common import parse_setting
model, label, depth, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if label.startswith("llama-cpp-python"):
    import llama_cpp
    llm = llama_cpp.Llama(model, n_ctx=depth + n + 16, n_batch=512, n_gpu_layers=-1, flash_attn=label.endswith("+fa"),
                          verbose=True)
    llm.eval(list(range(100, 100 + depth)))
    logits = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
else:
    setting = parse_setting(label)
    kwargs = setting.llama_kwargs()
    kwargs.setdefault("n_batch", 512)
    llm = Llama(model, **kwargs, n_ctx=depth + n + 16 if setting.budget is None else 0, n_gpu_layers=-1,
                verbose=True)
    llm.eval(list(range(100, 100 + depth)))
    logits = llm.last_logits
print("%s", file=sys.stderr, flush=True)
for _ in range(n):
    llm.eval([int(np.argmax(logits()))])
""" % MARK


def count(model: str, label: str, depth: int, n: int) -> Dict[str, object]:
    """The setting's decode of `n` tokens after `depth`, its ggml-cuda log lines counted."""
    proc = subprocess.run([sys.executable, "-c", CHILD, model, label, str(depth), str(n)], capture_output=True,
                          text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        return {"setting": label, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return {"setting": label, "steps": n, **counted(proc.stderr)}


def counted(log: str) -> Dict[str, int]:
    """The ggml-cuda lines of a child's log after the decode's mark, by kind."""
    if MARK not in log:
        raise ValueError("the decode's mark is not in the log")
    decode = log.split(MARK, 1)[1].splitlines()
    return {key: sum(text in line for line in decode) for key, text in LINES.items()}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--settings", nargs="+", required=True, help="labels as benchmarks.bench takes them; "
                                                                  "llama-cpp-python / llama-cpp-python+fa: the peer")
    ap.add_argument("--depth", type=int, default=2048, help="prompt tokens before the decode")
    ap.add_argument("--steps", type=int, default=32, help="tokens decoded")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [count(args.model, s, args.depth, args.steps) for s in args.settings]
    lines = ["| setting | decode steps | warmup complete | warmup reset | graph reused | disabled |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | error: {r['error']} | | | | |")
        else:
            lines.append(f"| {r['setting']} | {r['steps']} | {r['warmup_complete']} | {r['warmup_reset']} | "
                         f"{r['reused']} | {r['disabled']} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cuda-graphs.json").write_text(json.dumps(rows, indent=1))
        (args.out / "cuda-graphs.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
