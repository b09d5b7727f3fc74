"""The MT-Bench "infinite" session: all 160 turns of question.jsonl in one session, the cache kept across turns.

    python -m experiments.mtbench --input-path ../shared/data/question.jsonl \\
        --settings full h2o-1024+roll64 --output results/quality/mtbench-smollm2

Each turn is the user message formatted by the model's chat template and appended to the cache; the reply is
generated greedily (up to --max-tokens) until the end-of-turn token, which is fed back so the next turn follows
the template. `full` has the model's trained context and stops when a turn no longer fits: where and how is
recorded. A setting is `full` or POLICY-BUDGET with an optional `+roll` (position rolling after every eviction)
or `+rollN` (rolling once per N evicted tokens, `roll_interval=N`). Per turn: tokens generated, decode tokens/s,
KV cells in use, KV bytes allocated, resident memory.
Writes OUT.json, OUT.md, OUT.png and the transcripts OUT-<setting>.txt.gz.
"""
from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

from h2o_local import Llama
from experiments.models import model_path
from h2o_local import ModelInfo
from .common import experiment_parser, parse_setting, resident_bytes, save_figure




def make(model: str, setting: str, threads) -> Llama:
    s = parse_setting(setting)
    if s.policy == "full":
        return Llama(model, n_ctx=ModelInfo.load(model).n_ctx_train, n_threads=threads)
    return Llama(model, **{"n_batch": 256, **s.llama_kwargs()}, n_threads=threads)


def session(llm: Llama, turns, max_tokens: int, transcript, on_progress=None) -> list:
    records = []
    eog_tail = None
    for k, turn in enumerate(turns):
        prompt = llm.apply_chat_template([{"role": "user", "content": turn}])
        tokens = ([eog_tail] if eog_tail is not None else []) + llm.tokenize(prompt, add_bos=k == 0, special=True)
        rec = {"turn": k, "prompt_tokens": len(tokens)}
        try:
            t0 = time.perf_counter()
            llm.eval(tokens)
            t_prompt = time.perf_counter() - t0
            n, reason, text = 0, "length", []
            t1 = time.perf_counter()
            for e in llm.generate_events([], reset=False, max_tokens=max_tokens, temperature=0):
                text.append(e.text)
                if e.token is None:
                    reason = e.finish_reason
                else:
                    n += 1
            t_gen = time.perf_counter() - t1
            # the stream samples an end-of-turn token without feeding it: the next turn feeds it first
            eog_tail = llm.last_eog_token if reason == "stop" else None
            st = llm.kv_state()
            rec.update({"generated": n, "finish": reason, "prompt_tok_s": len(tokens) / t_prompt,
                        "decode_tok_s": n / t_gen if n else None, "kv_cells": st.n_cells, "kv_bytes": st.kv_bytes,
                        "n_seen": st.n_seen, "n_evicted": st.n_evicted, "rss": resident_bytes()})
            transcript.write(f"### turn {k}\nUSER: {turn}\nASSISTANT: {''.join(text)}\n\n")
        except (ValueError, RuntimeError) as e:
            rec.update({"error": f"{type(e).__name__}: {e}", "n_seen": llm.kv_state().n_seen})
            transcript.write(f"### turn {k}\nUSER: {turn}\n[stopped: {e}]\n")
            records.append(rec)
            print(f"\n  turn {k}: {rec['error']}", file=sys.stderr)
            break
        records.append(rec)
        if on_progress is not None and k % 10 == 9:
            on_progress(records)
        print(f"\r  turn {k + 1}/{len(turns)}: {n} tokens, {rec['decode_tok_s'] or 0:.1f} tok/s, "
              f"{st.n_cells} cells, seen {st.n_seen}   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return records


def main(argv=None) -> int:
    ap = experiment_parser("experiments.mtbench", __doc__)
    ap.add_argument("--settings", nargs="+", default=["full", "h2o-1024+roll64"])
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--max-turns", type=int, default=160)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--report-only", action="store_true", help="rewrite OUT.md and OUT.png from OUT.json")
    args = ap.parse_args(argv)

    if args.report_only:
        run = json.loads(args.output.with_suffix(".json").read_text())
        if "kv_bytes_per_cell" not in run:  # written before the field existed
            run["kv_bytes_per_cell"] = ModelInfo.load(args.model or run["model"]).kv_bytes_per_cell
        write_report(run, args.output)
        return 0
    model = model_path(args.model)
    turns = [t for line in open(args.input_path) for t in json.loads(line)["turns"]][: args.max_turns]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    run = {"model": model, "turns": len(turns), "max_tokens": args.max_tokens,
           "kv_bytes_per_cell": ModelInfo.load(model).kv_bytes_per_cell, "results": {}}
    for setting in args.settings:
        print(f"{setting}:", file=sys.stderr)
        llm = make(model, setting, args.threads)
        with gzip.open(f"{args.output}-{setting}.txt.gz", "wt") as transcript:
            def progress(records, setting=setting):
                run["results"][setting] = records
                write_report(run, args.output)

            run["results"][setting] = session(llm, turns, args.max_tokens, transcript, progress)
        del llm
        write_report(run, args.output)  # after each setting, so a stopped run keeps what it did
    return 0


def write_report(run: dict, output: Path) -> None:
    """OUT.json (every record), OUT.md (one row per setting) and OUT.png (speed, KV and resident memory per turn)."""
    output.with_suffix(".json").write_text(json.dumps(run))
    mib = 2**20
    per_cell = run["kv_bytes_per_cell"]
    lines = ["| setting | turns completed | tokens seen | tokens generated | turns cut at max tokens | stopped by | "
             "median decode tok/s | KV MiB in use (max) | KV MiB allocated | max RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, recs in run["results"].items():
        ok = [r for r in recs if "error" not in r]
        err = next((r["error"] for r in recs if "error" in r), "-")
        speeds = sorted(r["decode_tok_s"] for r in ok if r["decode_tok_s"])
        med = speeds[len(speeds) // 2] if speeds else 0
        lines.append(f"| {setting} | {len(ok)} | {recs[-1].get('n_seen', 0)} | {sum(r['generated'] for r in ok)} | "
                     f"{sum(r['finish'] == 'length' for r in ok)} | {err} | {med:.1f} | "
                     f"{max((r['kv_cells'] for r in ok), default=0) * per_cell / mib:.1f} | "
                     f"{max((r['kv_bytes'] for r in ok), default=0) / mib:.1f} | "
                     f"{max((r['rss'] for r in ok), default=0) / mib:.0f} |")
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for setting, recs in run["results"].items():
        ok = [r for r in recs if "error" not in r]
        turn = [r["turn"] + 1 for r in ok]
        line, = ax1.plot(turn, [r["decode_tok_s"] or float("nan") for r in ok], label=setting, lw=1)
        ax2.plot(turn, [r["kv_cells"] * per_cell / mib for r in ok], color=line.get_color(), label=f"{setting}: in use")
        ax2.plot(turn, [r["kv_bytes"] / mib for r in ok], color=line.get_color(), ls="--",
                 label=f"{setting}: allocated")
        ax3.plot(turn, [r["rss"] / mib for r in ok], color=line.get_color(), label=setting)
        stop = next((r for r in recs if "error" in r), None)
        if stop is not None:
            for ax in (ax1, ax2, ax3):
                ax.axvline(stop["turn"] + 1, color=line.get_color(), ls=":", lw=1)
    ax1.set_title("decode speed per turn")
    ax1.set_ylabel("tokens/s")
    ax2.set_title("KV cache after each turn")
    ax2.set_ylabel("MiB")
    ax3.set_title("resident memory after each turn")
    ax3.set_ylabel("MiB")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("turn (dotted: where a setting stopped)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"MT-Bench session, {Path(run['model']).name}, up to {run['max_tokens']} new tokens per turn")
    save_figure(fig, output.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
