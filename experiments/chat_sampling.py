"""Which sampling the chat surfaces should default to: how often a two-turn chat's answers loop, per setting.

    python -m experiments.chat_sampling --input-path ../shared/data/question.jsonl --rows 12 \\
        --out results/quality/chat-sampling-smollm2

Each row is an MT-Bench question with its follow-up, asked in a `ChatSession` as `h2o-local chat` runs it (the
default policy and budget, the system prompt protected), under each sampling setting, answers of up to
--max-tokens tokens. An answer *loops* when one 6-token sequence occurs 4 times or more in it (a repeated sentence
or phrase; llama.cpp's greedy loops on small models are of this kind); the share of looping answers and the share
that ran to --max-tokens are reported per turn, with standard errors over rows, and the mean distinct-bigram share
(a lower one: more repetition). Records go to OUT.jsonl as they come (a rerun resumes).
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List

from experiments.models import model_path
from .common import JsonlRecords, experiment_parser, table

# name -> ChatSession sampling keywords
SETTINGS: Dict[str, Dict] = {
    "greedy": {"temperature": 0.0},
    "t0.2 (llama-cpp-python's chat)": {"temperature": 0.2},
    "t0.7 (h2o-local chat)": {"temperature": 0.7},
    "greedy + rp1.1": {"temperature": 0.0, "repeat_penalty": 1.1},
    "t0.2 + rp1.1": {"temperature": 0.2, "repeat_penalty": 1.1},
    "t0.7 + rp1.1": {"temperature": 0.7, "repeat_penalty": 1.1},
    "t0.8 p0.9 + rp1.1 (Ollama's)": {"temperature": 0.8, "top_p": 0.9, "repeat_penalty": 1.1},
}


def loops(tokens: List[int], n: int = 6, times: int = 4) -> bool:
    grams = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def distinct2(tokens: List[int]) -> float:
    pairs = [tuple(tokens[i:i + 2]) for i in range(len(tokens) - 1)]
    return len(set(pairs)) / len(pairs) if pairs else 1.0


def mean_se(xs):
    import math

    import numpy as np

    if not xs:
        return float("nan"), float("nan")
    return float(np.mean(xs)), (float(np.std(xs, ddof=1)) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def run(args) -> None:
    from h2o_local import Llama
    from h2o_local.chat_session import ChatSession

    records = JsonlRecords(args.out.with_suffix(".jsonl"))
    questions = [json.loads(line) for line in open(args.input_path)][:args.rows]
    llm = Llama(args.model, budget=args.budget, keep="system", n_threads=args.threads, n_batch=128)
    for q in questions:
        for name, sampling in SETTINGS.items():
            key = f"{q['question_id']}/{name}"
            if key in records.done:
                continue
            session = ChatSession(llm, system="You are a helpful assistant.", max_tokens=args.max_tokens, seed=1,
                                  **sampling)
            turns = []
            t0 = time.perf_counter()
            for text in q["turns"][:2]:
                answer = "".join(session.send(text))
                toks = llm.tokenize(answer, add_bos=False)
                turns.append({"loops": loops(toks), "to_max": session.last.completion_tokens >= args.max_tokens,
                              "distinct2": distinct2(toks), "tokens": session.last.completion_tokens,
                              "answer": answer[:2000]})
            records.add({"key": key, "question": q["question_id"], "setting": name, "turns": turns,
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(key, [t["loops"] for t in turns], flush=True)
    report(args, records.rows)


def report(args, rows) -> None:
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for i, t in enumerate(r["turns"]):
            by[r["setting"]][i].append(t)
    body = []
    for name in SETTINGS:
        cells = [name]
        for i in (0, 1):
            ts = by[name][i]
            lm, ls = mean_se([float(t["loops"]) for t in ts])
            mm, _ = mean_se([float(t["to_max"]) for t in ts])
            dm, _ = mean_se([t["distinct2"] for t in ts])
            cells.append(f"{lm:.2f} ± {ls:.2f} / {mm:.2f} / {dm:.2f} (n={len(ts)})")
        body.append(cells)
    lines = [f"# Chat sampling on {Path(args.model).name}: loops per answer", "",
             f"Two-turn MT-Bench chats, the default policy at budget {args.budget} with the system prompt protected, "
             f"answers of up to {args.max_tokens} tokens, seed 1. Each cell: share of answers that loop (a 6-token "
             "sequence 4+ times) ± s.e. / share that ran to max_tokens / mean distinct-bigram share.", ""]
    lines += table(["setting", "first answer", "second answer"], body) + [""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = experiment_parser("experiments.chat_sampling", __doc__)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--budget", type=int, default=512, help="h2o-local chat's default budget")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.model = model_path(args.model)
    if args.report:
        return report(args, JsonlRecords(args.out.with_suffix(".jsonl")).rows)
    run(args)


if __name__ == "__main__":
    main()
