"""An offline long-context suite: RULER-style retrieval and SCBench-style multi-turn, query-aware and query-agnostic,
every task in several prompt formats, so that a policy cannot win on one phrasing.

    python -m experiments.longctx --model smollm2 --context 1500 --rows 8 \\
        --settings full sink-25% h2o-25% tova-25% tova-25%+q32 tova-25%+catalyst tova-25%+repeat \\
        --out results/quality/longctx-smollm2

Tasks (RULER's synthetic set, arXiv 2404.06654, re-implemented; the haystack is the 0-shot XSum articles):
- `single`: one needle ("the special magic number for KEY is: VALUE"), asked for.
- `multikey`: four needles with different keys, one asked for (three distractors).
- `multivalue`: four values for one key, all asked for (score: the share found).
- `multiquery`: four keys, all asked for (score: the share found).
- `vt`: variable tracking, a chain of four assignments (VAR A = 12345 ... VAR D = VAR C), all names asked for.
- `cwe`: common words, a numbered list where 10 words appear 10 times and the 41 others 3 times; the 10 asked for.
- `fwe`: frequent words, coded words with Zipf-like counts; the three most frequent asked for.
- `kv`: SCBench's Retr.KV on one shared context: a list of random id -> id pairs, then three questions in three
  turns, each answer fed back before the next question (turns 2-3 are asked after the context was compressed
  for turn 1: where query-aware methods fail).
- `mixed`: turns of different kinds on one haystack with four needles: retrieve one, summarize the text (not
  scored), retrieve another, then say what the first answer was (from the conversation, not the context).

Modes: `aware` (the question inside the prompt that is compressed: context + question fed together) and `agnostic`
(the context fed and compressed first, then the question). Both use the bounded prefill: the cache holds the
budget + one batch + the probe's cells, and the prompt is fed in pieces of --n-batch that evict as they go (the
mode that keeps memory bounded on a laptop or an edge device). The full cache holds everything.

Formats: row r uses format r % 8, a half fraction of four two-level factors (the fourth is the product of the first
three, so that each level of each factor appears equally often): the needle's wording (RULER's, or another one:
"the access code of KEY is VALUE"), an answer prefix after the question (or none), the model's chat template (or
plain text), and the question before the context as well as after it (or only after). OUT.md reports the mean
per factor level beside the overall mean, so that a win that holds for one phrasing only shows.

Scores are per row in [0, 1]; OUT.md gives means with standard errors over rows, each setting relative to the full
cache (tasks where the full cache scores < --min-full are left out of the relative means, as the issue asks), and
the paired difference against sink and h2o at the same budget. Records go to OUT.jsonl as they come (a rerun
resumes).
"""
from __future__ import annotations

import json
import math
import random
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from h2o_local import Llama
from experiments.models import model_path
from .common import JsonlRecords, experiment_parser, parse_setting, save_figure, table

TASKS = ("single", "multikey", "multivalue", "multiquery", "vt", "cwe", "fwe", "kv", "mixed")
MULTI_TURN = ("kv", "mixed")
MODES = ("aware", "agnostic")
FACTORS = ("wording", "prefix", "template", "before")
WORDS = ("apple banana cherry dolphin eagle falcon garden harbor island jungle kettle lantern meadow needle orchard "
         "pepper quartz river saddle tiger umbrella violet walnut yellow zebra anchor bridge candle desert engine "
         "forest glacier hammer igloo jacket koala ladder magnet nectar oyster pillow quiver rocket summit tunnel "
         "unicorn vessel window xylophone yogurt zipper").split()


def mean_se(values: Sequence[float]) -> Tuple[float, float]:
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    return float(np.mean(values)), (float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else float("nan"))


def row_format(row: int) -> Dict[str, int]:
    """Row r's format: the first three factors from r's bits, the fourth their product (a 2^(4-1) design)."""
    a, b, c = row & 1, (row >> 1) & 1, (row >> 2) & 1
    return {"wording": a, "prefix": b, "template": c, "before": a ^ b ^ c}


# --- the tasks: needles, questions, answers ------------------------------------------------------------------------

def needle(fmt: Dict[str, int], key: str, value: str) -> str:
    if fmt["wording"]:
        return f"Note that the access code of {key} is {value}."
    return f"The special magic number for {key} is: {value}."


def thing(fmt: Dict[str, int]) -> str:
    return "access code" if fmt["wording"] else "special magic number"


def make_task(task: str, rng: random.Random, fmt: Dict[str, int]) -> Dict:
    """The needles (sentences to hide), the questions (one per turn) with their answer prefixes, and the expected
    strings of each answer."""
    number = lambda: str(rng.randrange(1_000_000, 10_000_000))
    keys = rng.sample(WORDS, 4)
    if task in ("single", "multikey"):
        values = [number() for _ in keys]
        n = 1 if task == "single" else 4
        needles = [needle(fmt, k, v) for k, v in zip(keys[:n], values[:n])]
        q = f"What is the {thing(fmt)} for {keys[0]} mentioned in the provided text?"
        return {"needles": needles, "turns": [(q, f"The {thing(fmt)} for {keys[0]} is")], "answers": [[values[0]]]}
    if task == "multivalue":
        values = [number() for _ in range(4)]
        q = f"What are all the {thing(fmt)}s for {keys[0]} mentioned in the provided text?"
        return {"needles": [needle(fmt, keys[0], v) for v in values],
                "turns": [(q, f"The {thing(fmt)}s for {keys[0]} are")], "answers": [values]}
    if task == "multiquery":
        values = [number() for _ in keys]
        q = f"What are the {thing(fmt)}s for {', '.join(keys[:3])} and {keys[3]} mentioned in the provided text?"
        return {"needles": [needle(fmt, k, v) for k, v in zip(keys, values)],
                "turns": [(q, f"The {thing(fmt)}s for {', '.join(keys[:3])} and {keys[3]} are")], "answers": [values]}
    if task == "vt":
        value = str(rng.randrange(10_000, 100_000))
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        q = f"Find all variables that are assigned the value {value} in the text above."
        return {"needles": needles, "turns": [(q, f"The variables assigned the value {value} are")],
                "answers": [names]}
    if task == "kv":
        hexid = lambda: "".join(rng.choice("0123456789abcdef") for _ in range(8))
        pairs = [(hexid(), hexid()) for _ in range(48)]
        asked = rng.sample(range(len(pairs)), 3)
        lines = [f'"{k}": "{v}"' for k, v in pairs]
        turns = [(f'What is the value of key "{pairs[i][0]}" in the JSON data above?',
                  f'The value of key "{pairs[i][0]}" is') for i in asked]
        return {"context": "{\n" + ",\n".join(lines) + "\n}", "turns": turns,
                "answers": [[pairs[i][1]] for i in asked]}
    if task == "mixed":
        # turns of different kinds on one context: retrieve a needle, summarize (not scored), retrieve another
        # needle, then answer about the first turn (its answer is in the conversation, not in the context)
        values = [number() for _ in keys]
        ask = lambda k: (f"What is the {thing(fmt)} for {k} mentioned in the provided text?",
                         f"The {thing(fmt)} for {k} is")
        turns = [ask(keys[0]), ("Summarize the text above in one sentence.", "In short,"), ask(keys[1]),
                 (f"Which {thing(fmt)} did you give in your first answer?", "In my first answer I gave")]
        return {"needles": [needle(fmt, k, v) for k, v in zip(keys, values)], "turns": turns,
                "answers": [[values[0]], None, [values[1]], [values[0]]]}
    if task == "cwe":
        # RULER's common words: 10 words 10 times each among the 41 others 3 times each, a numbered list (~1,000 tokens)
        pool = rng.sample(WORDS, len(WORDS))
        common, rare = pool[:10], pool[10:]
        items = common * 10 + rare * 3
        rng.shuffle(items)
        q = "What are the 10 most common words in the list above?"
        return {"context": "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items)),
                "turns": [(q, "The 10 most common words in the list are:")], "answers": [common]}
    if task == "fwe":
        # RULER's frequent words: coded words with Zipf-like counts (word k about 1/k^1.5 of the text); the three
        # most frequent asked for (~1,000 tokens)
        coded = []
        while len(coded) < 30:
            w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 6)))
            if w not in coded:
                coded.append(w)
        counts = [max(1, int(130 / (k + 1) ** 1.5)) for k in range(len(coded))]
        items = [w for w, c in zip(coded, counts) for _ in range(c)]
        rng.shuffle(items)
        q = "What are the three most frequently appearing coded words in the coded text above?"
        return {"context": " ".join(items), "turns": [(q, "The three most frequent coded words are:")],
                "answers": [coded[:3]]}
    raise ValueError(task)


def haystack_sentences(path: Path) -> List[str]:
    text = " ".join(json.loads(line)["article"].split("Article:", 1)[-1].rsplit("Summarize", 1)[0]
                    for line in open(path))
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s.strip()) < 400]


def context_text(llm: Llama, task: Dict, sentences: List[str], rng: random.Random, context_tokens: int) -> str:
    """About context_tokens tokens: haystack sentences (a random run) with the needles at evenly spread random
    depths, or, for kv, the JSON block after a little haystack."""
    if "context" in task:
        return task["context"]
    start = rng.randrange(len(sentences))
    body: List[str] = []
    n = 0
    while n < context_tokens:
        s = sentences[(start + len(body)) % len(sentences)]
        body.append(s)
        n += len(llm.tokenize(s, add_bos=False)) + 1
    needles = task["needles"]
    slots = sorted(rng.sample(range(1, len(body)), len(needles)))
    for i, (slot, nd) in enumerate(zip(reversed(slots), reversed(needles))):
        body.insert(slot, nd)
    return " ".join(body)


def build_prompt(llm: Llama, fmt: Dict[str, int], context: str, question: str, prefix: str) -> Tuple[str, str]:
    """(context part, question part) of the first turn as text: the question part starts where the context ends."""
    kind = "JSON data" if context.startswith("{") else "text"
    intro = f"Read the following {kind} and answer the question after it."
    if fmt["before"]:
        intro += f" The question will be: {question}"
    head = f"{intro}\n\n{context}\n\n"
    tail = f"Question: {question}"
    if fmt["template"]:
        text = llm.apply_chat_template([{"role": "user", "content": head + tail}])
        cut = text.index(head) + len(head)
        head, tail = text[:cut], text[cut:]
    else:
        tail += "\nAnswer:"
    if fmt["prefix"]:
        tail += " " + prefix
    return head, tail


def next_turn(llm: Llama, fmt: Dict[str, int], question: str, prefix: str) -> str:
    """What follows an answer to ask the next question: with the template, its text after an assistant turn (the
    end of that turn included: the end-of-generation token a greedy answer stops at is not fed)."""
    if fmt["template"]:
        mark = "\x00ANSWER\x00"
        text = llm.apply_chat_template([{"role": "user", "content": "context"}, {"role": "assistant", "content": mark},
                                        {"role": "user", "content": f"Question: {question}"}])
        tail = text[text.index(mark) + len(mark):]
    else:
        tail = f"\n\nQuestion: {question}\nAnswer:"
    return tail + (" " + prefix if fmt["prefix"] else "")


def row_prompt(llm: Llama, sentences: List[str], task: str, row: int, seed: int, context_tokens: int) -> Tuple:
    """Row `row` of `task` as tokens: (format, task spec, the first turn's context part, its question part, the later
    turns' parts). The same seed, task and row give the same prompt in every experiment."""
    rng = random.Random(f"{seed}/{task}/{row}")
    fmt = row_format(row)
    spec = make_task(task, rng, fmt)
    context = context_text(llm, spec, sentences, rng, context_tokens)
    (q1, p1), rest = spec["turns"][0], spec["turns"][1:]
    head, tail = build_prompt(llm, fmt, context, q1, p1)
    head_ids = llm.tokenize(head, add_bos=True, special=True)
    tail_ids = llm.tokenize(tail, add_bos=False, special=True)
    later = [llm.tokenize(next_turn(llm, fmt, q, p), add_bos=False, special=True) for q, p in rest]
    return fmt, spec, head_ids, tail_ids, later


def score(answer: str, expected: Sequence[str]) -> float:
    """The share of the expected strings found in the answer (a word only as a whole word: "tiger", not "tigers")."""
    found = lambda e: (re.search(rf"(?<![A-Za-z]){re.escape(e)}(?![A-Za-z])", answer) is not None
                       if e.isalpha() else e in answer)
    return sum(found(e) for e in expected) / len(expected)


# --- running one row under one setting -----------------------------------------------------------------------------

def open_llama(model: str, label: str, prompt_len: int, n_batch: int, threads: Optional[int]) -> Llama:
    setting = parse_setting(label)
    kwargs = setting.llama_kwargs(prompt_len)
    n_ctx = prompt_len + 512 if setting.policy == "full" else 0  # 0: budget + a batch + the probe's cells
    kwargs.setdefault("n_batch", n_batch)
    return Llama(model, n_ctx=n_ctx, n_threads=threads, **kwargs)


def run_row(llm: Llama, head: List[int], tail: List[int], later: List[List[int]], mode: str,
            max_tokens: int) -> Tuple[List[str], int]:
    """The answers of every turn; turn 1's prompt is head + tail, fed together (aware) or head first (agnostic)."""
    if mode == "agnostic":
        llm.eval(head)
        first = llm.generate(tail, max_tokens=max_tokens, temperature=0, reset=False)
    else:
        first = llm.generate(head + tail, max_tokens=max_tokens, temperature=0)
    answers = [first]
    for toks in later:
        answers.append(llm.generate(toks, max_tokens=max_tokens, temperature=0, reset=False))
    return answers, llm.kv_state().n_cells


def key(task: str, row: int, label: str, mode: str) -> str:
    return f"{task}/{row}/{label}/{mode}"


def run(args) -> None:
    records = JsonlRecords(args.out.with_suffix(".jsonl"))
    if args.report:
        others = [JsonlRecords(Path(p)).rows for p in args.also]
        return report(args, records.rows + [r for rows in others for r in rows])
    sentences = haystack_sentences(args.input_path)
    tok = Llama(args.model, budget=8, n_threads=args.threads)
    from tqdm import tqdm

    jobs = [(t, r, lab, m) for t in args.tasks for r in range(args.rows) for lab in args.settings
            for m in (MODES if parse_setting(lab).policy != "full" else ("aware",))]
    todo = [j for j in jobs if key(*j) not in records.done]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="longctx")
    prompts: Dict[Tuple[str, int], Tuple] = {}
    for task, row, label, mode in todo:
        if (task, row) not in prompts:
            prompts[(task, row)] = row_prompt(tok, sentences, task, row, args.seed, args.context)
        fmt, spec, head_ids, tail_ids, later = prompts[(task, row)]
        t0 = time.perf_counter()
        prompt_len = len(head_ids) + len(tail_ids)
        llm = open_llama(args.model, label, len(head_ids), args.n_batch, args.threads)
        answers, n_cells = run_row(llm, head_ids, tail_ids, later, mode, args.max_tokens)
        scores = [None if e is None else score(a, e) for a, e in zip(answers, spec["answers"])]
        records.add({"key": key(task, row, label, mode), "task": task, "row": row, "setting": label, "mode": mode,
                     **fmt, "context_tokens": len(head_ids), "prompt_tokens": prompt_len, "budget": llm.budget,
                     "kept": n_cells, "seconds": round(time.perf_counter() - t0, 2), "score": scores[0],
                     "turn_scores": scores, "answers": answers})
        del llm
        bar.update(1)
    bar.close()
    others = [JsonlRecords(Path(p)).rows for p in args.also]
    report(args, records.rows + [r for rows in others for r in rows])


# --- the report ----------------------------------------------------------------------------------------------------

def report(args, rows: List[Dict]) -> None:
    by = defaultdict(dict)  # (task, mode, label) -> {row: score}
    turns = defaultdict(lambda: defaultdict(list))  # (task, mode, label) -> turn index -> scores (multi-turn)
    for r in rows:
        modes = MODES if r["setting"] == "full" else (r["mode"],)
        for m in modes:  # the full cache's one run stands for both modes
            by[(r["task"], m, r["setting"])][r["row"]] = r
            if r["task"] in MULTI_TURN:
                for i, s in enumerate(r["turn_scores"]):
                    if s is not None:
                        turns[(r["task"], m, r["setting"])][i].append(s)
    labels = [s for s in args.settings]
    kept_tasks = [t for t in args.tasks if np.mean([x["score"] for x in by[(t, "aware", "full")].values()] or [0])
                  >= args.min_full]
    lines = [f"# Long-context suite: {Path(args.model).name}", "",
             f"{args.rows} rows per task, context about {args.context} tokens, bounded prefill (n_batch "
             f"{args.n_batch}), greedy answers of up to {args.max_tokens} tokens. Tasks kept for relative scores "
             f"(full cache >= {args.min_full}): {', '.join(kept_tasks) or 'none'}.", ""]
    for mode in MODES:
        lines += [f"## {mode}: score per task (mean ± s.e. over rows)", ""]
        head = ["setting"] + list(args.tasks) + ["mean (kept tasks)", "relative to full"]
        body = []
        full_mean = np.mean([np.mean([x["score"] for x in by[(t, mode, "full")].values()]) for t in kept_tasks]) \
            if kept_tasks and "full" in labels else float("nan")
        for lab in labels:
            cells, means = [lab], []
            for t in args.tasks:
                vals = [x["score"] for x in by[(t, mode, lab)].values()]
                m, se = mean_se(vals)
                cells.append(f"{m:.2f} ± {se:.2f}" if vals else "")
                if t in kept_tasks and vals:
                    means.append(m)
            mm = float(np.mean(means)) if means else float("nan")
            cells += [f"{mm:.3f}", f"{mm / full_mean:.2f}" if full_mean > 0 else ""]
            body.append(cells)
        lines += table(head, body) + [""]
        lines += [f"### {mode}: mean over kept tasks per format factor (level 0 / level 1)", ""]
        head = ["setting"] + [f"{f} 0 / 1" for f in FACTORS]
        body = []
        for lab in labels:
            cells = [lab]
            for f in FACTORS:
                lv = [[x["score"] for t in kept_tasks for x in by[(t, mode, lab)].values() if x[f] == v] for v in (0, 1)]
                cells.append(" / ".join(f"{np.mean(v):.2f}" if v else "-" for v in lv))
            body.append(cells)
        lines += table(head, body) + [""]
        lines += [f"### {mode}: paired differences over rows of kept tasks (mean ± s.e.)", ""]
        body = []
        for lab in labels:
            cells = [lab]
            for ref in ("sink", "h2o"):
                ref_lab = re.sub(r"^[a-z0-9_]+", ref, lab.split("+")[0])
                d = [by[(t, mode, lab)][r]["score"] - by[(t, mode, ref_lab)][r]["score"] for t in kept_tasks
                     for r in by[(t, mode, lab)] if r in by[(t, mode, ref_lab)]]
                m, se = mean_se(d)
                cells.append(f"{m:+.3f} ± {se:.3f} (n={len(d)})" if d and ref_lab != lab else "")
            body.append(cells)
        lines += table(["setting", "minus sink, same budget", "minus h2o, same budget"], body) + [""]
    for task in (t for t in MULTI_TURN if t in args.tasks):
        lines += [f"## {task} (multi-turn): score per turn, mean ± s.e. (later turns asked after the context was "
                  f"compressed{'; turn 2, a summary, is not scored' if task == 'mixed' else ''})", ""]
        body, n_turns = [], 0
        for mode in MODES:
            for lab in labels:
                t = turns[(task, mode, lab)]
                if t:
                    n_turns = max(n_turns, len(t))
                    body.append([mode, lab] + ["{:.2f} ± {:.2f}".format(*mean_se(t[i])) for i in sorted(t)] +
                                ["{:.2f}".format(np.mean([x for i in sorted(t)[1:] for x in t[i]]))])
        turn_names = [f"turn {i + 1}" for i in range(4 if task == "mixed" else 3) if not (task == "mixed" and i == 1)]
        lines += table(["mode", "setting"] + turn_names + ["later turns"], body) + [""]
    secs = defaultdict(list)
    for r in rows:
        secs[r["setting"]].append(r["seconds"])
    lines += ["## Seconds per run (prefill + answers)", ""]
    lines += table(["setting", "mean s"], [[lab, f"{np.mean(secs[lab]):.1f}"] for lab in labels if secs[lab]]) + [""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    plot(args, by, kept_tasks, labels)
    print("\n".join(lines))


def plot(args, by, kept_tasks, labels) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(labels))
    for i, mode in enumerate(MODES):
        vals = [np.mean([x["score"] for t in kept_tasks for x in by[(t, mode, lab)].values()] or [np.nan])
                for lab in labels]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=mode)
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("mean score, kept tasks")
    ax.set_title(f"long-context suite, {Path(args.model).name}")
    ax.legend()
    save_figure(fig, args.out.with_suffix(".png"))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = experiment_parser("experiments.longctx", __doc__)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500, help="haystack tokens per prompt")
    ap.add_argument("--settings", nargs="+", required=True)
    ap.add_argument("--n-batch", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-full", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per job (run two jobs at a time on 2 cores)")
    ap.add_argument("--also", nargs="*", default=[], help="jsonl files of other jobs of the same run, for the report")
    ap.add_argument("--report", action="store_true", help="only write the report of the records so far")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.model = model_path(args.model)
    args.input_path = Path(args.input_path)
    for label in args.settings:
        parse_setting(label)
    run(args)


if __name__ == "__main__":
    main()
