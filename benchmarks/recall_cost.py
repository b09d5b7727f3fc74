"""What recall costs: the recall step of a new turn against re-reading the whole history, and decode with recall on.

    python -m benchmarks.recall_cost --model qwen05b --history 4096 16384 --out results/recall/recall-cost-qwen05b

For each history length N (XSum articles, a chat's history as plain text) and one new turn (a question of ~30
tokens), side by side in one run:
- `recall step`: the default policy with recall reads the history (a bounded prefill that spills what it evicts to
  host memory); the time of `recall_for(question)` (the pages of spilled entries, each put back beside the kept ones
  and ranked by the question probe) is what every new turn pays before its own tokens;
- `re-read`: the default policy without recall reads history + question from an empty cache (what a stateless
  client's every turn costs: `create_chat_completion` re-reads the history);
- `full, new turn`: the full cache holding the history prefills the question alone (what a full cache pays per
  turn; its memory grows with N);
- decode tokens/s after the history with the same budget, recall on and off (interleaved repeats, medians);
- host bytes per spilled token;
- the same recall step, decode and host bytes with the q8_0 host copy (`recall_type="q8_0"`).
Writes OUT.json and OUT.md.

    python -m benchmarks.recall_cost --pages --model smollm2 --history 4096 16384 65536 --out results/recall/recall-pages-smollm2

`--pages` measures only the recall step, the page choice against every page, side by side: the history is read once
(the default policy, a host store large enough for all of it, positions rolled past the trained context as chat
does), then, from its snapshot, `recall_for(question)` with `recall_pages=N` (--recall-pages, the default's 8: the question
probed once for its queries, the host entries ranked against the stored keys, N pages probed) and with
`recall_pages=0` (every page), interleaved,
medians of --repeats. Also which entries each brought back (the overlap of the two kept sets).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

QUESTION = "\nQuestion: which of the stories above mentions a court, and what was decided there? Answer briefly."


def history_tokens(llm, n: int, data: Path) -> List[int]:
    texts = [json.loads(line)["article"] for line in data.open()]
    tokens: List[int] = []
    for t in texts:
        tokens += llm.tokenize(t + "\n\n", add_bos=not tokens)
        if len(tokens) >= n:
            return tokens[:n]
    raise SystemExit(f"{data} holds fewer than {n} tokens")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(model: str, n: int, budget: int, threads: int, repeats: int, data: Path) -> Dict[str, Any]:
    from h2o_local import Llama

    def bounded(recall, recall_type=None):
        return Llama(model, budget=budget, n_batch=512, n_threads=threads, recall=recall, recall_type=recall_type)

    llm = bounded(True)
    history = history_tokens(llm, n, data)
    question = llm.tokenize(QUESTION, add_bos=False)
    read_spill = timed(lambda: llm.eval(history))
    snap = llm.save_state()
    recall_s = timed(lambda: llm.recall_for(question))
    st = llm.kv_state()
    host_per_token = st.host_bytes / max(len(st.host_positions), 1)
    n_recalled = st.n_recalled

    q8 = bounded(True, "q8_0")
    q8_read_spill = timed(lambda: q8.eval(history))
    q8_snap = q8.save_state()
    q8_recall_s = timed(lambda: q8.recall_for(question))
    q8_st = q8.kv_state()
    same_kept = q8_st.positions.tolist() == st.positions.tolist()

    plain = bounded(False)
    reread = timed(lambda: plain.eval(history + question))

    full = Llama(model, policy="full", n_ctx=n + 1024, n_batch=512, n_threads=threads)
    full_history = timed(lambda: full.eval(history))
    full_turn = timed(lambda: full.eval(question))
    del full

    # decode after the history, recall on and off, interleaved
    decode = {"recall": [], "plain": [], "q8": []}
    plain.eval(history)
    plain_snap = plain.save_state()
    for _ in range(repeats):
        for name, l, s in (("recall", llm, snap), ("plain", plain, plain_snap), ("q8", q8, q8_snap)):
            l.load_state(s)
            t0 = time.perf_counter()
            out = l.generate_events([], max_tokens=64, temperature=0, ignore_eos=True, reset=False)
            k = sum(e.token is not None for e in out)
            decode[name].append(k / (time.perf_counter() - t0))
    row = {"history": n, "budget": budget, "recall_step_s": round(recall_s, 3), "reread_s": round(reread, 3),
           "full_new_turn_s": round(full_turn, 3), "bounded_read_with_spill_s": round(read_spill, 3),
           "full_read_s": round(full_history, 3), "recall_vs_reread": round(recall_s / reread, 3),
           "recall_vs_full_new_turn": round(recall_s / full_turn, 2), "recalled": n_recalled,
           "host_entries": int(len(st.host_positions)), "host_bytes_per_token": int(host_per_token),
           "decode_recall_tok_s": round(statistics.median(decode["recall"]), 1),
           "decode_plain_tok_s": round(statistics.median(decode["plain"]), 1),
           "q8_bounded_read_with_spill_s": round(q8_read_spill, 3), "q8_recall_step_s": round(q8_recall_s, 3),
           "q8_host_bytes_per_token": int(q8_st.host_bytes / max(len(q8_st.host_positions), 1)),
           "q8_recalls_the_same_entries": same_kept,
           "decode_q8_tok_s": round(statistics.median(decode["q8"]), 1)}
    row["decode_ratio"] = round(row["decode_recall_tok_s"] / row["decode_plain_tok_s"], 3)
    row["decode_q8_ratio"] = round(row["decode_q8_tok_s"] / row["decode_plain_tok_s"], 3)
    print(json.dumps(row), flush=True)
    return row


def run_pages(model: str, n: int, budget: int, threads: int, repeats: int, data: Path,
              recall_pages: int, snapshots: Optional[Path] = None) -> Dict[str, Any]:
    from h2o_local import Llama
    from h2o_local.kv_state import Snapshot
    from h2o_local.policies import resolve

    llm = Llama(model, budget=budget, n_batch=512, n_threads=threads, recall=n)
    question = llm.tokenize(QUESTION, add_bos=False)
    saved = snapshots / f"{Path(model).stem}-{n}-{budget}.snapshot" if snapshots else None
    if saved is not None and saved.exists():  # the history read by an earlier run
        read_s = None
        snap = Snapshot.from_bytes(saved.read_bytes())
    else:
        history = history_tokens(llm, n, data)
        read_s = round(timed(lambda: llm.eval(history)), 1)
        snap = llm.save_state()
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(snap.to_bytes())
    n_host = snap.n_host
    times: Dict[str, List[float]] = {"chosen": [], "every": []}
    kept: Dict[str, List[int]] = {}
    probes: Dict[str, int] = {}
    for _ in range(repeats):
        for name, pages in (("chosen", recall_pages), ("every", 0)):
            llm.load_state(snap)
            llm.set_policy(resolve(None, budget, recall_pages=pages))
            before = llm.kv_state().n_probes
            times[name].append(timed(lambda: llm.recall_for(question)))
            st = llm.kv_state()
            kept[name] = st.positions.tolist()
            probes[name] = int(st.n_probes - before)
    llm.load_state(snap)
    held = set(llm.kv_state().positions.tolist())
    back = {k: set(v) - held for k, v in kept.items()}
    both = len(back["chosen"] & back["every"])
    row = {"history": n, "budget": budget, "recall_pages": recall_pages, "host_entries": n_host, "read_s": read_s,
           "recall_chosen_s": round(statistics.median(times["chosen"]), 3),
           "recall_every_s": round(statistics.median(times["every"]), 3),
           "probes_chosen": probes["chosen"], "probes_every": probes["every"],
           "recalled_chosen": len(back["chosen"]), "recalled_every": len(back["every"]), "recalled_both": both}
    print(json.dumps(row), flush=True)
    return row


def pages_report(rows: List[Dict[str, Any]]) -> List[str]:
    base = rows[0]["recall_chosen_s"]
    lines = ["| history tokens | host entries | recall step, chosen pages s | every page s | chosen / every | "
             "chosen / chosen at the first history | probes, chosen / every | recalled, chosen / every / both |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['history']:,} | {r['host_entries']:,} | {r['recall_chosen_s']} | {r['recall_every_s']} | "
              f"{r['recall_chosen_s'] / r['recall_every_s']:.3f} | {r['recall_chosen_s'] / base:.2f} | "
              f"{r['probes_chosen']} / {r['probes_every']} | {r['recalled_chosen']} / {r['recalled_every']} / "
              f"{r['recalled_both']} |" for r in rows]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen05b")
    ap.add_argument("--history", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "xsum.jsonl")
    ap.add_argument("--pages", action="store_true", help="only the recall step: the page choice against every page")
    ap.add_argument("--recall-pages", type=int, default=8, help="with --pages: the pages the choice probes")
    ap.add_argument("--snapshots", type=Path, help="with --pages: keep each history's snapshot here and read it from "
                                                   "there next time (the history is read once across runs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from experiments.models import model_path

    model = model_path(args.model)
    if args.pages:
        rows = [run_pages(model, n, args.budget, args.threads, args.repeats, args.data, args.recall_pages,
                          args.snapshots) for n in args.history]
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        lines = pages_report(rows)
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    rows = [run(model, n, args.budget, args.threads, args.repeats, args.data) for n in args.history]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = ["| history tokens | recall step s | re-read s | recall / re-read | full cache, new turn s | recalled | "
             "host entries | host bytes / token | decode tok/s recall / plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['history']:,} | {r['recall_step_s']} | {r['reread_s']} | {r['recall_vs_reread']} | "
              f"{r['full_new_turn_s']} | {r['recalled']} | {r['host_entries']:,} | {r['host_bytes_per_token']:,} | "
              f"{r['decode_recall_tok_s']} / {r['decode_plain_tok_s']} ({r['decode_ratio']}) |" for r in rows]
    lines += ["", "With the q8_0 host copy (`recall_type=\"q8_0\"`):", "",
              "| history tokens | read with spill s, rows / q8_0 | recall step s, rows / q8_0 | host bytes / token, "
              "rows / q8_0 | same entries recalled | decode tok/s q8_0 / plain |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['history']:,} | {r['bounded_read_with_spill_s']} / {r['q8_bounded_read_with_spill_s']} | "
              f"{r['recall_step_s']} / {r['q8_recall_step_s']} | {r['host_bytes_per_token']:,} / "
              f"{r['q8_host_bytes_per_token']:,} | {'yes' if r['q8_recalls_the_same_entries'] else 'no'} | "
              f"{r['decode_q8_tok_s']} / {r['decode_plain_tok_s']} ({r['decode_q8_ratio']}) |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
