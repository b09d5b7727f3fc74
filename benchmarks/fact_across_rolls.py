"""A fact given in a chat's first turn, asked after the history passed twice the model's trained context: does the
chat still know it? ChatSession with the defaults `h2o-local chat` runs (the default policy, recall, position rolling
near the trained context, the system prompt kept), beside controls on the same rows: the same long chat without
recall (what rolling alone keeps), the question asked right after the fact (what the model can answer at all), and
recall with a store that holds the whole history (`store-all`: whether recall across rolls finds the fact when its
entries are still stored), and the default without reading dropped text again (`forget`: past its cap the store
drops the oldest text, and with reread=0 nothing of it comes back).

Each row is one fact of several kinds and phrasings (a code, a name, a password, a place, a date), then turns of news
text (`--words` words each, the 0-shot XSum articles) until the history passes `--times` x the trained context,
then the question; right when the answer (`--max-tokens` tokens, greedy) contains the fact's value. Writes
OUT.jsonl as it goes (a stopped run resumes), then OUT.md.

    python -m benchmarks.fact_across_rolls --rows 8 --out results/quality/recall/fact-across-rolls-smollm2
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from benchmarks.endless_chat import ARTICLES, SYSTEM, turn_text

# at-once: the question right after the fact; default: as `h2o-local chat` (recall's store capped at the trained
# context and 256 MiB; past it the oldest text keeps only its tokens, which a question may read again); forget: the
# default without reading dropped text again (reread=0: what the cap drops is gone); no-recall: rolling alone;
# store-all: recall with a store that holds the whole history
SETTINGS = ["at-once", "default", "forget", "no-recall", "store-all"]
# (the fact, the question, the value the answer must hold): the values differ per row
FACTS: List[Tuple[str, str, str]] = [
    ("Remember this: the code of the blue door is {n4}.", "What is the code of the blue door?", "{n4}"),
    ("Please note that my sister's name is {name}.", "What is my sister's name?", "{name}"),
    ("The password for the garden shed is {word}{n2}. Keep it in mind.", "What is the password for the garden shed?",
     "{word}{n2}"),
    ("I left my keys in the {place}. Don't let me forget.", "Where did I leave my keys?", "{place}"),
    ("Our meeting with the bank is on {month} {n1}.", "When is our meeting with the bank?", "{month} {n1}"),
    ("For later: the train to the coast leaves from platform {n1}.", "Which platform does the train to the coast "
     "leave from?", "{n1}"),
    ("My locker number at the gym is {n3}, remember it please.", "What is my locker number at the gym?", "{n3}"),
    ("The cat's vet is called Doctor {name}.", "What is the name of the cat's vet?", "{name}"),
]
NAMES = ["Marisol", "Thaddeus", "Ingrid", "Octavia", "Leopold", "Beatrix", "Casimir", "Rosalind"]
WORDS = ["falcon", "harbor", "violet", "copper", "meadow", "lantern", "pepper", "glacier"]
PLACES = ["blue teapot", "piano bench", "laundry basket", "glovebox", "bread tin", "garden boot", "fish tank",
          "top drawer"]
MONTHS = ["March", "June", "October", "January", "August", "May", "November", "April"]


def fact_row(i: int) -> Dict[str, str]:
    fact, question, value = FACTS[i % len(FACTS)]
    fields = {"n4": str(3000 + (i * 7919) % 6000), "n3": str(100 + (i * 613) % 800), "n2": str(10 + (i * 37) % 80),
              "n1": str(2 + (i * 5) % 17), "name": NAMES[(i * 3) % len(NAMES)], "word": WORDS[(i * 5) % len(WORDS)],
              "place": PLACES[(i * 7) % len(PLACES)], "month": MONTHS[(i * 3) % len(MONTHS)]}
    return {"fact": fact.format(**fields), "question": question, "value": value.format(**fields)}


def filler(articles: List[str], turn: int, n_words: int, row: int) -> str:
    """A turn of news text, each row's from its own place (endless_chat's turns, shifted by 37 turns a row)."""
    return turn_text(articles, turn + 37 * row, n_words)


def value_origins(llm, first_turn: str, value: str) -> List[int]:
    """The places in the conversation of the tokens that spell the fact's value in the first turn (the first match
    of its tokens, with or without a leading space)."""
    toks, _ = llm.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_turn}])
    for text in (" " + value, value):
        want = llm.tokenize(text, add_bos=False)
        for a in range(len(toks) - len(want) + 1):
            if toks[a:a + len(want)] == want:
                return list(range(a, a + len(want)))
    return []


def run_row(make_llm, i: int, setting: str, articles: List[str], args) -> Dict[str, Any]:
    from h2o_local.chat_session import ChatSession

    row = fact_row(i)
    llm = make_llm(setting)
    n_train = llm.n_ctx_train()
    # the default's store: the trained context's worth (and 256 MiB), the oldest text's K and V dropped first;
    # store-all: room for the whole history
    recall = {"no-recall": False, "store-all": int(args.times * n_train * 1.25)}.get(setting, True)
    chat = ChatSession(llm, system=SYSTEM, max_tokens=args.max_tokens, temperature=0, recall=recall)
    t0 = time.perf_counter()
    turn, history = 0, 0
    first = row["fact"] if setting == "at-once" else row["fact"] + " " + filler(articles, 0, args.words, i)
    fact_at = value_origins(llm, first, row["value"])
    if setting == "at-once":
        "".join(chat.send(row["fact"]))
    else:
        while history < args.times * n_train:
            "".join(chat.send((row["fact"] + " " if turn == 0 else "") + filler(articles, turn, args.words, i)))
            history = chat.last.prompt_tokens + chat.last.reused_tokens
            turn += 1
            print(f"\r  row {i} {setting}: turn {turn}, {history / n_train:.2f}x   ", end="", file=sys.stderr,
                  flush=True)
    answer = "".join(chat.send(row["question"]))
    st = llm.kv_state(0)
    kept, stored = set(st.origins.tolist()), set(st.host_origins.tolist())
    return {"row": i, "setting": setting, "fact": row["fact"], "question": row["question"], "value": row["value"],
            "answer": answer, "right": int(row["value"].lower() in answer.lower()), "turns": turn,
            "history_tokens": chat.last.prompt_tokens + chat.last.reused_tokens,
            "x_trained": round((chat.last.prompt_tokens + chat.last.reused_tokens) / n_train, 2),
            "max_position": int(st.positions.max()) if st.n_cells else 0, "n_recalled": int(st.n_recalled),
            "value_tokens": len(fact_at), "value_kept": sum(o in kept for o in fact_at),
            "value_stored": sum(o in stored for o in fact_at),
            "seconds": round(time.perf_counter() - t0, 1)}


def report(rows: List[Dict[str, Any]], settings: List[str], args, n_train: int) -> List[str]:
    lines = [f"A fact in the first turn, asked after the history passed {args.times}x the trained context "
             f"({n_train} tokens); turns of {args.words} words, {args.max_tokens}-token greedy answers; right: the "
             f"answer holds the fact's value. Rows: one fact each ({len(FACTS)} kinds and phrasings).", "",
             "The value's tokens in the cache: those of its tokens (their places in the conversation) that the "
             "cache holds after the answer (the question's recall, then the answer's own evictions), over all rows' "
             "value tokens.", "",
             "| setting | rows | right | s.e. | history x trained (median) | largest position | entries recalled "
             "(median) | value's tokens in the cache |", "|---|---|---|---|---|---|---|---|"]
    for s in settings:
        part = [r for r in rows if r["setting"] == s]
        if not part:
            continue
        p = sum(r["right"] for r in part) / len(part)
        med = lambda k: sorted(r[k] for r in part)[len(part) // 2]
        tracked = [r for r in part if "value_kept" in r]
        held = (f"{sum(r['value_kept'] for r in tracked)} of {sum(r['value_tokens'] for r in tracked)}"
                if tracked else "-")
        lines.append(f"| {s} | {len(part)} | {p:.2f} | {math.sqrt(p * (1 - p) / len(part)):.2f} | {med('x_trained')} "
                     f"| {max(r['max_position'] for r in part)} | {med('n_recalled')} | {held} |")
    lines += ["", "| row | question | value | " + " | ".join(settings) + " |", "|---|---|---|" + "---|" * len(settings)]
    for i in sorted({r["row"] for r in rows}):
        by = {r["setting"]: r for r in rows if r["row"] == i}
        cells = [("right: " if by[s]["right"] else "wrong: ") + repr(by[s]["answer"][:60]) if s in by else "-"
                 for s in settings]
        first = next(iter(by.values()))
        lines.append(f"| {i} | {first['question']} | {first['value']} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--articles", default=str(ARTICLES), help="JSONL with an 'article' per line")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--times", type=float, default=2.2, help="ask once the history passes this x the trained context")
    ap.add_argument("--words", type=int, default=600, help="words of text per turn")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--settings", nargs="+", default=["at-once", "default", "forget", "no-recall"],
                    choices=SETTINGS)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true", help="only write OUT.md from the rows OUT.jsonl holds")
    args = ap.parse_args(argv)

    from h2o_local import Llama, ModelInfo
    from h2o_local.models import default_model_path
    from h2o_local.policies import resolve

    model = args.model or default_model_path()
    articles = [json.loads(line)["article"] for line in open(args.articles)]
    path = args.out.with_suffix(".jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in open(path)] if path.exists() else []
    done = {(r["row"], r["setting"]) for r in rows}
    options = lambda setting: {"reread": 0} if setting == "forget" else {}
    make = lambda setting: Llama(model, policy=resolve(None, args.budget, **options(setting)), keep="system",
                                 recall=setting != "no-recall", n_threads=args.threads, verbose=False)
    with open(path, "a") as log:
        for i in range(0 if args.report else args.rows):
            for s in args.settings:
                if (i, s) in done:
                    continue
                r = run_row(make, i, s, articles, args)
                rows.append(r)
                log.write(json.dumps(r) + "\n")
                log.flush()
                print(f"\r  row {i} {s}: {'right' if r['right'] else 'wrong'} ({r['answer'][:50]!r})   ",
                      file=sys.stderr, flush=True)
    lines = report(rows, args.settings, args, ModelInfo.load(model).n_ctx_train)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
