"""What a scorer written in Python costs: decode speed of H2O ranked in C++ against the same rule ranked in Python
(`policies.PythonRanked`), side by side in one run, interleaved repeats; the difference per evicted token.

    python -m benchmarks.python_policy --budget 256 --prompt-tokens 1024 --max-tokens 256 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from h2o_local import H2O, Llama
from h2o_local.policies import PythonRanked


class PythonH2O(PythonRanked):
    name = "python-h2o"

    def rank(self, total, head, queries):
        return total


def decode_seconds(llm: Llama, prompt, max_tokens: int):
    llm.eval(prompt)
    t0 = time.perf_counter()
    n = sum(1 for e in llm.generate_events([], reset=False, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            if e.token is not None)
    return time.perf_counter() - t0, n, llm.kv_state().n_evicted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.python_policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    from experiments.models import model_path

    model = model_path(args.model)
    policies = {"h2o (C++ rank)": H2O(budget=args.budget), "h2o (Python rank)": PythonH2O(budget=args.budget)}
    llms = {k: Llama(model, policy=p, n_ctx=args.budget + 512, n_threads=args.threads) for k, p in policies.items()}
    words = "the lighthouse keeper wrote a letter to the sea every night while the storm came closer".split()
    text = " ".join(words[i % len(words)] for i in range(args.prompt_tokens))
    prompt = next(iter(llms.values())).tokenize(text)[: args.prompt_tokens]
    runs = {k: [] for k in llms}
    for _ in range(args.repeats):
        for k, llm in llms.items():
            runs[k].append(decode_seconds(llm, prompt, args.max_tokens))
    out = {"model": model.rsplit("/", 1)[-1], "budget": args.budget, "prompt_tokens": len(prompt),
           "max_tokens": args.max_tokens, "repeats": args.repeats}
    for k, rs in runs.items():
        out[k] = {"tok_s": round(statistics.median(n / s for s, n, _ in rs), 2),
                  "ms_per_token": round(1000 * statistics.median(s / n for s, n, _ in rs), 3)}
    c, p = out["h2o (C++ rank)"], out["h2o (Python rank)"]
    out["speed_ratio_python_over_cpp"] = round(p["tok_s"] / c["tok_s"], 3)
    out["extra_us_per_eviction"] = round(1000 * (p["ms_per_token"] - c["ms_per_token"]), 1)  # one eviction a token
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
