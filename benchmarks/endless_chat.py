"""A chat that never ends: long conversations through ChatSession and the server's OpenAI, Ollama and Anthropic routes
(the whole history resent each turn, as their clients do), past several times the model's trained context, with
the defaults the surfaces run (the default policy, recall, position rolling). Per turn: errors, seconds, tokens read
(what no saved conversation held), the history's length, resident memory and the cache's device and host bytes;
whether the system prompt is still the cache's first entries; and at the end, whether a fact given in the first turn
is answered after the history passed twice the trained context. Writes OUT.jsonl as it goes, then OUT.md.

    python -m benchmarks.endless_chat --out results/serving/endless-smollm2 [--turns 200] [--surfaces ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from experiments.common import resident_bytes

SYSTEM = "You are a patient assistant. Answer in one short sentence."
FACT = "Remember this: the code of the blue door is 4712."
QUESTION = "What is the code of the blue door?"
ANSWER = "4712"
SURFACES = ("chatsession", "openai", "ollama", "anthropic")
ARTICLES = Path(__file__).resolve().parents[2] / "shared" / "data" / "xsum_0shot_dev.jsonl"  # the 0-shot XSum news


def turn_text(articles: List[str], turn: int, n_words: int) -> str:
    words = " ".join(articles).split()
    start = (turn * n_words) % max(1, len(words) - n_words)
    return " ".join(words[start:start + n_words]) + " What is this about?"


def run_surface(surface: str, make_llm: Callable[[], Any], articles: List[str], args, log) -> Dict[str, Any]:
    from h2o_local.chat_session import ChatSession

    llm = make_llm()
    n_train = llm.n_ctx_train()
    rows: List[Dict[str, Any]] = []
    history = [{"role": "system", "content": SYSTEM}]
    server = None
    if surface == "chatsession":
        chat = ChatSession(llm, system=SYSTEM, max_tokens=args.max_tokens, temperature=0)
    else:
        from h2o_local.server import create_app, serve_in_background
        app = create_app(llm, model_id="m")
        server = serve_in_background(app)
        port = server.__enter__()
    try:
        system_tokens = llm.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])[1]
        system_tokens = min(system_tokens, args.budget // 2)  # keep="system" protects at most half the budget
        for turn in range(args.turns + 1):
            last = turn == args.turns
            content = QUESTION if last else (FACT + " " if turn == 0 else "") + turn_text(articles, turn, args.words)
            history.append({"role": "user", "content": content})
            t0 = time.perf_counter()
            error, answer, fed, n_prompt = None, "", None, None
            try:
                answer, fed, n_prompt = ask(surface, chat if surface == "chatsession" else port, history, args)
            except Exception as e:  # noqa: BLE001 - counted and written, the soak goes on
                error = f"{type(e).__name__}: {e}"[:300]
            seconds = time.perf_counter() - t0
            history.append({"role": "assistant", "content": answer})
            st = llm.kv_state(0)  # a server's slot: what its last request left (empty once its session is saved)
            sessions = 0 if server is None else app.state.server.scheduler.sessions.nbytes
            row = {"surface": surface, "turn": turn, "seconds": round(seconds, 3), "fed": fed, "error": error,
                   "history_tokens": n_prompt, "x_trained": round((n_prompt or 0) / n_train, 2),
                   "sessions_mib": round(sessions / 2**20, 1),
                   "max_position": int(st.positions.max()) if st.n_cells else 0, "kv_cells": int(st.n_cells),
                   "kv_bytes": int(st.kv_bytes), "host_bytes": int(st.host_bytes),
                   "system_kept": bool(system_tokens and st.origins[:system_tokens].tolist() == list(range(system_tokens))),
                   "rss_mib": round(resident_bytes() / 2**20, 1)}
            if last:
                row["answer"], row["fact_found"] = answer, ANSWER in answer
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"\r{surface}: turn {turn}, {row['x_trained']}x the trained context, {seconds:.1f} s   ", end="",
                  file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    print(file=sys.stderr)
    return summary(surface, rows, n_train)


def ask(surface: str, target: Any, history: List[Dict[str, str]], args) -> tuple:
    """The answer's text, the tokens this turn read (None where the surface does not say) and the prompt's tokens
    (the whole conversation)."""
    if surface == "chatsession":
        answer = "".join(target.send(history[-1]["content"]))
        return answer, target.last.prompt_tokens, target.last.prompt_tokens + target.last.reused_tokens
    base = f"http://127.0.0.1:{target}"
    if surface == "openai":
        import openai
        out = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600).chat.completions.create(
            model="m", messages=history, max_tokens=args.max_tokens, temperature=0)
        used = out.usage
        return (out.choices[0].message.content or "", used.prompt_tokens - used.prompt_tokens_details.cached_tokens,
                used.prompt_tokens)
    if surface == "ollama":
        import ollama
        out = ollama.Client(host=base, timeout=600).chat(model="m", messages=history,
                                                         options={"temperature": 0, "num_predict": args.max_tokens})
        return out.message.content, None, out.prompt_eval_count
    import anthropic
    out = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600).messages.create(
        model="m", system=history[0]["content"], messages=history[1:], max_tokens=args.max_tokens)
    used = out.usage  # Anthropic's input_tokens leave out what the cache held
    return ("".join(b.text for b in out.content if b.type == "text"), used.input_tokens,
            used.input_tokens + (used.cache_read_input_tokens or 0))


def summary(surface: str, rows: List[Dict[str, Any]], n_train: int) -> Dict[str, Any]:
    def median(key, part):
        vals = [r[key] for r in part if r[key] is not None]
        return round(statistics.median(vals), 2) if vals else None

    early, late = rows[10:30], rows[-21:-1]
    return {"surface": surface, "turns": len(rows), "errors": sum(r["error"] is not None for r in rows),
            "x_trained": max(r["x_trained"] for r in rows), "max_position": max(r["max_position"] for r in rows),
            "s_turn_10_30": median("seconds", early), "s_turn_last_20": median("seconds", late),
            "fed_10_30": median("fed", early), "fed_last_20": median("fed", late),
            "rss_mib_turn_10": rows[min(10, len(rows) - 1)]["rss_mib"], "rss_mib_end": rows[-1]["rss_mib"],
            "sessions_mib_end": rows[-1].get("sessions_mib", 0),
            "host_mib_end": round(rows[-1]["host_bytes"] / 2**20, 1), "kv_mib": round(rows[-1]["kv_bytes"] / 2**20, 1),
            "system_kept": all(r["system_kept"] for r in rows if r["kv_cells"]),  # (a slot between requests: empty)
            "fact_found": rows[-1].get("fact_found"),
            "answer": rows[-1].get("answer"), "n_ctx_train": n_train}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--articles", default=str(ARTICLES), help="JSONL with an 'article' per line")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--words", type=int, default=100, help="words of text per turn")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--surfaces", nargs="+", choices=SURFACES, default=list(SURFACES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true", help="only write OUT.md from the turns OUT.jsonl holds (a run "
                    "stopped early: each surface's turns so far)")
    args = ap.parse_args(argv)

    from h2o_local import Llama, ModelInfo
    from h2o_local.models import default_model_path

    model = args.model or default_model_path()
    if args.report:
        rows: Dict[str, List[Dict[str, Any]]] = {}
        for line in open(args.out.with_suffix(".jsonl")):
            row = json.loads(line)
            rows.setdefault(row["surface"], []).append(row)
        n_train = ModelInfo.load(model).n_ctx_train
        write_report([summary(s, r, n_train) for s, r in rows.items()], args, model)
        return 0
    articles = [json.loads(line)["article"] for line in open(args.articles)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summaries = []
    with open(args.out.with_suffix(".jsonl"), "a") as log:
        for surface in args.surfaces:
            make = lambda: Llama(model, budget=args.budget, keep="system", recall=True, n_threads=args.threads,
                                 verbose=False)
            summaries.append(run_surface(surface, make, articles, args, log))
            args.out.with_suffix(".summary.json").write_text(json.dumps(summaries, indent=1))
    write_report(summaries, args, model)
    return 0


def write_report(summaries: List[Dict[str, Any]], args, model: str) -> None:
    keys = ["surface", "turns", "errors", "x_trained", "max_position", "s_turn_10_30", "s_turn_last_20", "fed_10_30",
            "fed_last_20", "rss_mib_turn_10", "rss_mib_end", "kv_mib", "host_mib_end", "sessions_mib_end", "system_kept",
            "fact_found"]
    lines = [f"Model {Path(model).name} (trained context {summaries[0]['n_ctx_train']}), budget {args.budget}, "
             f"recall and rolling as the surfaces run them; turns of about {args.words} words (the last asks what the "
             f"first said), {args.max_tokens}-token answers; medians over turns 10-30 and the last 20 before the "
             f"question.", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(s[k]) for k in keys) + " |" for s in summaries]
    lines += ["", "Answers to the last question (" + QUESTION + "): " +
              "; ".join(f"{s['surface']}: {s['answer']!r}" for s in summaries if s["answer"] is not None)]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
