"""What a bounded cache keeps, measured with low noise: fidelity to the full cache and passkey retrieval.

    # teacher-forced fidelity on the 5-shot XSum prompts (64 steps of the full cache's greedy continuation)
    python -m experiments.quality fidelity --input-path ../shared/data/xsum.jsonl --rows 20 \\
        --settings h2o-10% snapkv-10% sink-10% --out results/quality/fidelity-smollm2

    # a long chat: a long system prompt, an MT-Bench question and the full cache's answer, then the second question;
    # the full cache's second answer teacher-forced
    python -m experiments.quality chat --input-path ../shared/data/question.jsonl --rows 10 \\
        --settings h2o-256 snapkv-256 sink-256 --out results/quality/chat-smollm2

    # a 5-digit passkey hidden in news text (the 0-shot XSum articles) at several depths, question at the end
    python -m experiments.quality passkey --input-path ../shared/data/xsum_0shot_dev.jsonl \\
        --lengths 1000 2000 --depths 0.1 0.5 0.9 --keys 4 --settings h2o-256 snapkv-256 \\
        --out results/quality/passkey-smollm2

fidelity: for each prompt the full cache's greedy continuation (--steps tokens) is fed to every setting one token at a
time (the setting's cache evicting as it goes); per step the top-1 agreement with the full cache's next token and
KL(full || setting) of the next-token distributions. The first step's logits come from the prompt's own forward pass,
before any eviction, so step 1 always agrees; steps 2.. measure the kept cache.
passkey: greedy answer of --answer-tokens tokens; right when it contains the key's digits.
chat: a system prompt of --system-tokens tokens (instructions and a news article from --system-path to answer from),
then MT-Bench's first question. The full cache answers it greedily (up to --first-tokens); every setting is fed that
answer and the second question, then the full cache's greedy second answer (--steps tokens) teacher-forced as in
fidelity. Per row: agreement and KL over the second answer (`agree`, `kl`) and over the first (`agree1`, `kl1`), so
that losing the system prompt or the first answer shows. Percent budgets are of the context before the second
answer.

Prefill modes (--prefill, both by default): `all` attends the whole prompt, then compresses it to the budget (the
cache is sized to hold the prompt); `bounded` feeds the prompt in chunks of n_batch, evicting when the next one would
not fit (the cache is budget + n_batch cells), so a needle must survive before the question arrives.

Settings are labels (experiments.common.parse_setting): `h2o-256`, `snapkv-10%` (10% of the prompt), `h2o-20%+s4`.
Records go to OUT.jsonl as they come (a rerun resumes); OUT.md (means with standard errors over prompts) and OUT.png
are written at the end.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from h2o_local import Llama
from experiments.models import model_path
from .common import JsonlRecords, experiment_parser, parse_setting, save_figure, table

FIDELITY, PASSKEY, CHAT = "fidelity", "passkey", "chat"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def mean_se(values: Sequence[float]) -> Tuple[float, float]:
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    m = float(np.mean(values))
    return m, (float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else float("nan"))


def modes(label: str, prefill: Sequence[str]) -> List[str]:
    """The prefill modes a setting runs in: the full cache holds the prompt either way (one mode, "all")."""
    return ["all"] if parse_setting(label).policy == "full" else list(prefill)


def open_llama(model: str, label: str, prompt_len: int, extra: int, prefill: str, threads: Optional[int]) -> Llama:
    setting = parse_setting(label)
    kwargs = setting.llama_kwargs(prompt_len)
    n_ctx = prompt_len + extra + 8 if prefill == "all" or setting.policy == "full" else 0
    return Llama(model, n_ctx=n_ctx, n_threads=threads, **kwargs)


# --- fidelity ---------------------------------------------------------------------------------------------------

def full_continuation(model: str, prompt: List[int], steps: int, threads: Optional[int]):
    """The full cache's greedy tokens and the log-probabilities it gave before each."""
    llm = Llama(model, n_ctx=len(prompt) + steps + 8, n_threads=threads)
    llm.eval(prompt)
    tokens, logps = [], []
    for _ in range(steps):
        lp = log_softmax(llm.last_logits())
        t = int(lp.argmax())
        tokens.append(t)
        logps.append(lp)
        llm.eval([t])
    return tokens, logps


def teacher_forced(llm: Llama, prompt: List[int], tokens: List[int], logps: List[np.ndarray]) -> Dict[str, list]:
    llm.eval(prompt)
    agree, kl = [], []
    for t, ref in zip(tokens, logps):
        lp = log_softmax(llm.last_logits())
        agree.append(int(lp.argmax() == ref.argmax()))
        kl.append(float(np.sum(np.exp(ref) * (ref - lp))))
        llm.eval([t])
    return {"agree": agree, "kl": kl}


def rows_to_run(task: str, args, records: JsonlRecords):
    """The first --rows rows of --input-path that still have settings to run, as (index, row, [(label, mode), ...],
    bar): a progress bar over every job of the task, to `update(1)` after each."""
    from tqdm import tqdm

    rows = [json.loads(line) for line in open(args.input_path)][: args.rows]
    jobs = [(i, label, mode) for i in range(len(rows)) for label in args.settings for mode in modes(label, args.prefill)]
    with tqdm(total=len(jobs), initial=sum(1 for j in jobs if key(task, *j) in records.done), desc=task) as bar:
        for i, row in enumerate(rows):
            todo = [(label, mode) for j, label, mode in jobs
                    if j == i and key(task, j, label, mode) not in records.done]
            if todo:
                yield i, row, todo, bar


def run_fidelity(args, records: JsonlRecords) -> None:
    tok = Llama(args.model, budget=8, n_threads=args.threads)
    for i, row, todo, bar in rows_to_run(FIDELITY, args, records):
        prompt = tok.tokenize(row["article"], add_bos=args.add_bos)[-args.max_prompt:]
        tokens, logps = full_continuation(args.model, prompt, args.steps, args.threads)
        for label, mode in todo:
            t0 = time.perf_counter()
            llm = open_llama(args.model, label, len(prompt), args.steps, mode, args.threads)
            res = teacher_forced(llm, prompt, tokens, logps)
            records.add({"key": key(FIDELITY, i, label, mode), "row": i, "setting": label, "prefill": mode,
                         "prompt_tokens": len(prompt), "budget": llm.budget, "seconds": time.perf_counter() - t0,
                         # step 1 is the prompt's own forward pass (no eviction yet): left out of the means
                         "agree": float(np.mean(res["agree"][1:])), "kl": float(np.mean(res["kl"][1:])),
                         "agree_steps": res["agree"], "kl_steps": [round(v, 5) for v in res["kl"]]})
            del llm
            bar.update(1)


# --- passkey ----------------------------------------------------------------------------------------------------

# the phrasing that SmolLM2-135M with the full cache answers at 400 and 1,500 tokens (the classic "The pass key is
# N. Remember it." needle is not found by the full cache on news text; "secret number" is)
INTRO = "There is a secret number hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
NEEDLE = "\n\nIMPORTANT: the secret number is {key}.\n\n"
QUESTION = "\n\nWhat is the secret number? The secret number is"
QUESTION_CHAT = "\n\nWhat is the secret number?{after}The secret number is"


def filler_tokens(llm: Llama, path: str, n: int) -> List[int]:
    text = ""
    for line in open(path):
        article = json.loads(line)["article"]
        article = article.split("Article:", 1)[-1].split("Summarize the above article", 1)[0].strip()
        text += article + "\n"
        if len(text) > 6 * n:
            break
    return llm.tokenize(text, add_bos=False)[:n]


def passkey_prompt(llm: Llama, filler: List[int], length: int, depth: float, key: int, add_bos: bool,
                   chat: bool) -> List[int]:
    """`length` tokens: the intro, filler with the needle at `depth`, the question; inside the model's chat template
    (one user message, the answer's start after the assistant header) when `chat`."""
    before, after = "", ""
    if chat:
        before, _, after = llm.apply_chat_template([{"role": "user", "content": "@@@"}]).partition("@@@")
    head = llm.tokenize(before + INTRO, add_bos=add_bos, special=True)
    needle = llm.tokenize(NEEDLE.format(key=key), add_bos=False)
    question = llm.tokenize(QUESTION_CHAT.format(after=after) if chat else QUESTION, add_bos=False, special=True)
    n_fill = max(0, length - len(head) - len(needle) - len(question))
    at = round(depth * n_fill)
    return head + filler[:at] + needle + filler[at:n_fill] + question


def run_passkey(args, records: JsonlRecords) -> None:
    from tqdm import tqdm

    tok = Llama(args.model, budget=8, n_threads=args.threads)
    filler = filler_tokens(tok, args.input_path, max(args.lengths))
    keys = [random.Random(k).randrange(10000, 100000) for k in range(args.keys)]
    trials = [(length, depth, k) for length in args.lengths for depth in args.depths for k in keys]
    jobs = [(t, label, mode) for t in trials for label in args.settings for mode in modes(label, args.prefill)]
    bar = tqdm(total=len(jobs), initial=sum(1 for j in jobs if key(PASSKEY, *j) in records.done), desc="passkey")
    for trial, label, mode in jobs:
        k = key(PASSKEY, trial, label, mode)
        if k in records.done:
            continue
        length, depth, passkey = trial
        prompt = passkey_prompt(tok, filler, length, depth, passkey, args.add_bos, not args.no_chat)
        t0 = time.perf_counter()
        llm = open_llama(args.model, label, len(prompt), args.answer_tokens, mode, args.threads)
        answer = llm.generate(prompt, max_tokens=args.answer_tokens, temperature=0.0)
        records.add({"key": k, "length": length, "depth": depth, "passkey": passkey, "setting": label,
                     "prefill": mode, "prompt_tokens": len(prompt), "budget": llm.budget,
                     "answer": answer, "right": int(str(passkey) in answer.replace(" ", "")),
                     "seconds": time.perf_counter() - t0})
        del llm
        bar.update(1)
    bar.close()


# --- chat -------------------------------------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant for the readers of a news service. Follow these rules in every answer: be "
          "accurate, say when you are unsure, keep a friendly tone, and when the user's request touches the article "
          "below, use its facts. The article, for reference:\n\n{article}\n\nEnd of the article.")


def system_prompt(llm: Llama, path: str, n_tokens: int) -> str:
    """SYSTEM around the first news articles of `path`, cut to about `n_tokens` tokens."""
    article = llm.detokenize(filler_tokens(llm, path, n_tokens)).decode("utf-8", "ignore")
    return SYSTEM.format(article=article)


def chat_segments(llm: Llama, system: str, turns: Sequence[str]) -> Tuple[List[int], List[int]]:
    """The chat's tokens around the first answer: up to it (system prompt, first question, assistant header), and
    from its end to the second answer (end of turn, second question, assistant header)."""
    first = [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}]
    marker = "\u2063ANSWER\u2063"
    text = llm.apply_chat_template(first + [{"role": "assistant", "content": marker},
                                            {"role": "user", "content": turns[1]}])
    return llm.chat_tokens(first)[0], llm.tokenize(text.split(marker, 1)[1], add_bos=False, special=True)


def full_answer(llm: Llama, tokens: List[int], limit: int) -> Tuple[List[int], List[np.ndarray]]:
    """Feed `tokens` to the full cache `llm`, then its greedy answer up to `limit` tokens or an end-of-generation
    token (not included) and the log-probabilities before each answer token."""
    llm.eval(tokens)
    out, logps = [], []
    for _ in range(limit):
        lp = log_softmax(llm.last_logits())
        t = int(lp.argmax())
        if llm.is_eog(t):
            break
        out.append(t)
        logps.append(lp)
        llm.eval([t])
    return out, logps


def run_chat(args, records: JsonlRecords) -> None:
    tok = Llama(args.model, budget=8, n_threads=args.threads, chat_template=args.chat_template)
    system = system_prompt(tok, args.system_path, args.system_tokens)
    for i, row, todo, bar in rows_to_run(CHAT, args, records):
        head, between = chat_segments(tok, system, row["turns"])
        ref = Llama(args.model, n_ctx=len(head) + args.first_tokens + len(between) + args.steps + 8,
                    n_threads=args.threads)
        answer1, logps1 = full_answer(ref, head, args.first_tokens)
        answer2, logps2 = full_answer(ref, between, args.steps)
        del ref
        context = len(head) + len(answer1) + len(between)
        for label, mode in todo:
            t0 = time.perf_counter()
            llm = open_llama(args.model, label, context, len(answer2), mode, args.threads)
            first = teacher_forced(llm, head, answer1, logps1)
            second = teacher_forced(llm, between, answer2, logps2)
            records.add({"key": key(CHAT, i, label, mode), "row": i, "question_id": row.get("question_id"),
                         "setting": label, "prefill": mode, "context_tokens": context, "budget": llm.budget,
                         "answer1_tokens": len(answer1), "answer2_tokens": len(answer2),
                         "seconds": time.perf_counter() - t0,
                         # the first answer's step 1 comes from the prompt's own forward pass: left out
                         "agree1": float(np.mean(first["agree"][1:])) if len(answer1) > 1 else None,
                         "kl1": float(np.mean(first["kl"][1:])) if len(answer1) > 1 else None,
                         "agree": float(np.mean(second["agree"])) if answer2 else None,
                         "kl": float(np.mean(second["kl"])) if answer2 else None,
                         "agree_steps": second["agree"], "kl_steps": [round(v, 5) for v in second["kl"]]})
            del llm
            bar.update(1)


# --- report -----------------------------------------------------------------------------------------------------

def key(task: str, item, label: str, mode: str) -> str:
    return json.dumps([task, item, label, mode])


def summarize(records: Iterable[dict], metrics: Sequence[str], settings: Sequence[str]) -> List[list]:
    groups: Dict[Tuple[str, str], List[dict]] = defaultdict(list)
    for r in records:
        groups[(r["setting"], r["prefill"])].append(r)
    out = []
    for (label, mode), rs in sorted(groups.items(), key=lambda kv: (settings.index(kv[0][0])
                                                                   if kv[0][0] in settings else 1e9, kv[0][1])):
        cells = [label, mode, len(rs)]
        for m in metrics:
            mean, se = mean_se([r[m] for r in rs if r.get(m) is not None])
            cells.append(f"{mean:.3f} ± {se:.3f}")
        out.append(cells)
    return out


def paired_with(records: Sequence[dict], settings: Sequence[str], base_policy: str = "h2o") -> List[list]:
    """Per setting, mean ± standard error over prompts of (setting - base_policy at the same size, same prefill
    mode): the prompts' own difficulty cancels, so small differences show that the unpaired means cannot separate."""
    by = {(r["setting"], r["prefill"], r["row"]): r for r in records}
    out = []
    for label in settings:
        s = parse_setting(label)
        if s.policy in ("full", base_policy) and s.is_plain:
            continue
        size = f"{s.percent:g}%" if s.percent is not None else str(s.budget)
        base = f"{base_policy}-{size}"
        for mode in ("all", "bounded"):
            pairs = [(by[(label, mode, row)], by[(base, mode, row)]) for (lab, m, row) in by
                     if lab == label and m == mode and (base, mode, row) in by]
            if len(pairs) < 2:
                continue
            cells = [label, mode, len(pairs)]
            for m in ("agree", "kl"):
                mean, se = mean_se([a[m] - b[m] for a, b in pairs if a[m] is not None and b[m] is not None])
                cells.append(f"{mean:+.3f} ± {se:.3f}")
            out.append(cells)
    return out


def write_report(args, records: JsonlRecords) -> None:
    metrics = {FIDELITY: ["agree", "kl"], CHAT: ["agree", "kl", "agree1", "kl1"], PASSKEY: ["right"]}[args.task]
    lines = [f"# {args.task}: {Path(args.model).name}", "", f"`{' '.join(sys.argv)}`", "",
             "Means ± standard errors over " + ("trials" if args.task == PASSKEY else "prompts") + "; n = rows.", ""]
    lines += table(["setting", "prefill", "n", *metrics], summarize(records.rows, metrics, args.settings))
    if args.task != PASSKEY:
        for base in ("h2o", "sink"):  # issue 13's two baselines
            paired = paired_with(records.rows, args.settings, base)
            if paired:
                lines += ["", f"Against plain {base} at the same size, paired over the same prompts (setting - {base}; "
                          "agreement up and KL down are better):", ""]
                lines += table(["setting", "prefill", "n", "agree diff", "kl diff"], paired)
    if args.task == PASSKEY:
        lines += ["", "By length and depth (right / trials):", ""]
        cells = defaultdict(list)
        for r in records.rows:
            cells[(r["setting"], r["prefill"], r["length"], r["depth"])].append(r["right"])
        cols = sorted({(r["length"], r["depth"]) for r in records.rows})
        body = []
        for label in args.settings:
            for mode in modes(label, args.prefill):
                if not any(cells[(label, mode, *c)] for c in cols):
                    continue  # not run in this mode
                body.append([label, mode] + [f"{sum(cells[(label, mode, *c)])}/{len(cells[(label, mode, *c)])}"
                                             for c in cols])
        lines += table(["setting", "prefill"] + [f"{l}@{d}" for l, d in cols], body)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(args, records, metrics[0])


def plot(args, records: JsonlRecords, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: Dict[Tuple[str, str], Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records.rows:
        s = parse_setting(r["setting"])
        if s.policy == "full" or r.get(metric) is None:
            continue  # the full cache is the reference: a line at its mean, below
        size = f"{s.percent:g}%" if s.percent is not None else str(s.budget)
        series[(s.family, r["prefill"])][size].append(r[metric])
    sizes = sorted({size for d in series.values() for size in d}, key=lambda x: (x.endswith("%"), float(x.rstrip("%"))))
    fig, axes = plt.subplots(1, len(args.prefill), figsize=(6 * len(args.prefill), 4), squeeze=False)
    for ax, mode in zip(axes[0], args.prefill):
        for (name, m), d in sorted(series.items()):
            if m != mode:
                continue
            xs = [i for i, size in enumerate(sizes) if size in d]
            stats = [mean_se(d[sizes[i]]) for i in xs]
            ax.errorbar(xs, [s[0] for s in stats], yerr=[0 if math.isnan(s[1]) else s[1] for s in stats],
                        marker="o", capsize=3, label=name)
        full = [r[metric] for r in records.rows if r["setting"] == "full" and r.get(metric) is not None]
        if full:
            ax.axhline(float(np.mean(full)), color="k", linestyle="--", linewidth=1, label="full")
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_xlabel("budget (entries, or % of the prompt)")
        ax.set_ylabel({"agree": "top-1 agreement with full", "right": "passkey accuracy"}.get(metric, metric))
        ax.set_title(f"{args.task}, prefill={mode}")
        ax.legend(fontsize=7)
    save_figure(fig, args.out.with_suffix(".png"))


def main(argv=None) -> int:
    ap = experiment_parser("experiments.quality", __doc__)
    ap.add_argument("task", choices=[FIDELITY, PASSKEY, CHAT])
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: OUT.jsonl, OUT.md, OUT.png")
    ap.add_argument("--settings", nargs="+", required=True)
    ap.add_argument("--prefill", nargs="+", choices=["all", "bounded"], default=["all", "bounded"])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--add-bos", action="store_true", help="start prompts with BOS (base models that expect it)")
    ap.add_argument("--rows", type=int, default=20, help="fidelity, chat: first N rows")
    ap.add_argument("--steps", type=int, default=64, help="fidelity, chat: teacher-forced steps (chat: of the second "
                    "answer)")
    ap.add_argument("--first-tokens", type=int, default=128, help="chat: the first answer's tokens at most")
    ap.add_argument("--system-tokens", type=int, default=1000, help="chat: the system prompt's article, in tokens")
    ap.add_argument("--chat-template", help="chat: a template for models without one (chatml, or Jinja source)")
    ap.add_argument("--system-path", default="../shared/data/xsum_0shot_dev.jsonl",
                    help="chat: news articles (the XSum jsonl schema) for the system prompt")
    ap.add_argument("--max-prompt", type=int, default=4096, help="fidelity: keep the last N prompt tokens")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000], help="passkey: prompt tokens")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey: needle depth (0-1)")
    ap.add_argument("--keys", type=int, default=4, help="passkey: keys per length and depth")
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--no-chat", action="store_true", help="passkey: plain text instead of the chat template")
    ap.add_argument("--report-only", action="store_true", help="write OUT.md / OUT.png from OUT.jsonl, run nothing")
    args = ap.parse_args(argv)
    for label in args.settings:
        parse_setting(label)
    args.model = model_path(args.model)
    records = JsonlRecords(args.out.with_suffix(".jsonl"))
    if not args.report_only:
        {FIDELITY: run_fidelity, PASSKEY: run_passkey, CHAT: run_chat}[args.task](args, records)
    write_report(args, records)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
