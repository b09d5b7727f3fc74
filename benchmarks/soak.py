"""Soak: one rolling chat session generating N tokens (default 200,000), sampling resident memory, KV cells and
speed every 10,000 tokens, and checking that the output stays text. Writes as it goes (OUT.jsonl), then OUT.md.

    python -m benchmarks.soak --out results/serving/soak-smollm2 [--tokens 200000] [--budget 256]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.common import resident_bytes

QUESTIONS = ["Tell me a long story about a lighthouse keeper.", "Explain how tides work, in detail.",
             "Write a letter to a friend about your travels.", "Describe a city you would like to visit.",
             "What makes a good recipe? Give examples.", "Summarize what we talked about so far."]




def text_share(s: str) -> float:
    """Share of letters, digits, spaces and common punctuation: near 1 for prose, low for byte garbage."""
    if not s:
        return 1.0
    return sum(c.isalnum() or c.isspace() or c in ".,;:!?'\"()-" for c in s) / len(s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--roll-interval", type=int, default=64)
    ap.add_argument("--max-turn", type=int, default=600, help="tokens per answer at most")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from h2o_local import Llama
    from h2o_local.models import default_model_path

    model = args.model or default_model_path()
    llm = Llama(model, budget=args.budget, position_rolling=True, roll_interval=args.roll_interval, n_batch=128,
                n_threads=args.threads, seed=0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out.with_suffix(".jsonl"), "w")
    generated, turn, next_mark, tail = 0, 0, 0, ""
    t0 = t_mark = time.perf_counter()
    gen_at_mark = 0
    samples = []
    eog = None
    while generated < args.tokens:
        question = QUESTIONS[turn % len(QUESTIONS)]
        prompt = llm.apply_chat_template([{"role": "user", "content": question}])
        tokens = ([eog] if eog is not None else []) + llm.tokenize(prompt, add_bos=turn == 0, special=True)
        n = min(args.max_turn, args.tokens - generated)
        for e in llm.generate_events(tokens, reset=False, max_tokens=n, temperature=0.8, seed=turn):
            if e.token is None:
                continue
            generated += 1
            tail = (tail + e.text)[-2000:]
            if generated >= next_mark:
                st = llm.kv_state()
                now = time.perf_counter()
                rec = {"generated": generated, "turn": turn, "rss": resident_bytes(), "kv_cells": st.n_cells,
                       "kv_bytes": st.kv_bytes, "n_seen": st.n_seen, "max_position": int(st.positions.max()),
                       "tok_s": (generated - gen_at_mark) / max(now - t_mark, 1e-9), "text_share": text_share(tail),
                       "elapsed_s": now - t0}
                samples.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(f"{generated:>7} tokens: RSS {rec['rss'] / 2**20:.1f} MiB, KV {st.n_cells} cells, "
                      f"{rec['tok_s']:.1f} tok/s, text {rec['text_share']:.2f}", file=sys.stderr, flush=True)
                next_mark += args.every
                t_mark, gen_at_mark = now, generated
        eog = llm.last_eog_token
        turn += 1

    rss = [s["rss"] for s in samples[1:]] or [samples[0]["rss"]]
    lines = [f"# Soak: {generated:,} generated tokens in one rolling chat session", "",
             f"Model {Path(model).name}, h2o budget {args.budget}, rolling every {args.roll_interval}, {turn} turns, "
             f"{samples[-1]['elapsed_s'] / 60:.1f} min.", "",
             "| generated | RSS MiB | KV cells | max position | tok/s | text share |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['generated']:,} | {s['rss'] / 2**20:.1f} | {s['kv_cells']} | {s['max_position']} | "
              f"{s['tok_s']:.1f} | {s['text_share']:.2f} |" for s in samples]
    lines += ["", f"RSS after the first sample: min {min(rss) / 2**20:.1f}, max {max(rss) / 2**20:.1f} MiB "
              f"(growth {(max(rss) - min(rss)) / 2**20:.1f} MiB); KV cells at most {max(s['kv_cells'] for s in samples)}."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
