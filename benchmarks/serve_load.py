"""Load on `h2o-local serve`, on loopback: N concurrent streaming chats against one server, side by side for
  - h2o with N slots (each a bounded cache),
  - the full cache within the same KV memory (as many slots as fit: requests beyond them wait),
  - h2o with one slot (sequential serving).
Each chat has a long system prompt (an XSum article) and a question. Reports throughput (completion tokens/s over
the wall time of the whole load), time to first token, the gap between tokens, and KV bytes. Bounded in requests
and time; writes JSON and a markdown table.

    python -m benchmarks.serve_load --chats 4 --budget 256 --max-tokens 64 --out results/serving/serve-load

With --shared-prefix: N conversations that share one long system prompt (an article) and ask different
questions, one after another, on a server with saved sessions and on one without (side by side in one run,
alternating): the prompt tokens each request found cached and its time to first token.

    python -m benchmarks.serve_load --shared-prefix --chats 6 --budget 1024 --out results/serving/serve-shared-prefix

With --equal-memory MIB (the paper's throughput claim, served): the full cache and the default policy each get the
same KV memory, and each holds as many chats at once as fit in it (`Llama.for_kv_limit`; the full cache needs
prompt + max_tokens cells per chat); N chats arrive at once, those beyond the slots wait. Every chat generates
max_tokens (end tokens ignored), so both serve the same work. Reports chats held, throughput and per-token latency.

    python -m benchmarks.serve_load --equal-memory 48 --chats 16 --budget 128 --max-tokens 256 \
        --out results/serving/serve-equal-memory-smollm2
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from h2o_local import Llama
from experiments.models import model_path
from h2o_local.server import create_app, serve_in_background

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "xsum_0shot_dev.jsonl"


def chats(n: int, chars: int):
    rows = [json.loads(line) for _, line in zip(range(n), open(SHARED))] if SHARED.is_file() else []
    out = []
    for i in range(n):
        article = rows[i]["article"][:chars] if i < len(rows) else ("The committee met again on Tuesday. " * 200)[:chars]
        out.append([{"role": "system", "content": "Answer questions about this article.\n\n" + article},
                    {"role": "user", "content": "Summarise the article in two sentences."}])
    return out


def load(llm, conversations, max_tokens: int, timeout: float, ignore_eos: bool = False):
    app = create_app(llm, model_id="m", max_waiting=64, session_mib=0)
    with serve_in_background(app) as port:
        return _load(port, llm, conversations, max_tokens, timeout, ignore_eos)


def _load(port, llm, conversations, max_tokens: int, timeout: float, ignore_eos: bool = False):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=timeout)
    results = [None] * len(conversations)
    barrier = threading.Barrier(len(conversations))

    errors = []

    def one(i):
        try:
            run(i)
        except Exception as e:  # reported, not hidden: a failed request counts as not completed
            errors.append(f"{type(e).__name__}: {e}")

    def run(i):
        barrier.wait()
        t0 = time.perf_counter()
        times, n = [], 0
        stream = client.chat.completions.create(model="m", messages=conversations[i], max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True} if ignore_eos else None)
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                times.append(time.perf_counter())
            if ch.usage:
                n = ch.usage.completion_tokens
        results[i] = {"ttft": times[0] - t0 if times else None, "tokens": n,
                      "gaps": [b - a for a, b in zip(times, times[1:])], "end": time.perf_counter() - t0}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    gaps = [g for r in done for g in r["gaps"]]
    for e in errors[:3]:
        print("request failed:", e)
    return {"requests": len(conversations), "completed": len(done), "wall_s": round(wall, 2),
            "completion_tokens": sum(r["tokens"] for r in done),
            "throughput_tok_s": round(sum(r["tokens"] for r in done) / wall, 2),
            "ttft_mean_s": round(statistics.mean(r["ttft"] for r in done if r["ttft"] is not None), 3),
            "ttft_max_s": round(max(r["ttft"] for r in done if r["ttft"] is not None), 3),
            "token_gap_ms": round(1000 * statistics.mean(gaps), 1) if gaps else None,
            "token_gap_p95_ms": round(1000 * sorted(gaps)[int(0.95 * (len(gaps) - 1))], 1) if gaps else None,
            "token_gap_max_ms": round(1000 * max(gaps), 1) if gaps else None,
            "kv_bytes": llm.kv_state().kv_bytes, "slots": llm.n_seq_max}


def row_cells(r, *cells) -> str:
    """One markdown row: a request setting's name, policy, slots and KV MiB, then `cells`."""
    return "| " + " | ".join([r["setting"], r["policy"], str(r["slots"]), f"{r['kv_bytes'] / 2**20:.1f}", *map(str, cells)]) + " |"


def write_report(args, data: dict, lines) -> None:
    """OUT.json (the arguments and `data`) and OUT.md (`lines`), printed too."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), **data}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


QUESTIONS = ["Who is the article about?", "Summarise it in one sentence.", "Where does it take place?",
             "What happened first?", "What is the main number in it?", "Give it a title.", "Who said what?",
             "What happens next?"]


def shared_prefix(model, args, common) -> int:
    rows = [json.loads(line) for _, line in zip(range(1), open(SHARED))] if SHARED.is_file() else []
    article = rows[0]["article"][:args.article_chars] if rows else ("The committee met again. " * 300)[:args.article_chars]
    system = {"role": "system", "content": "Answer questions about this article.\n\n" + article}
    import openai

    servers = {}
    stack = []
    for name, mib in (("sessions on", 256), ("sessions off", 0)):
        llm = Llama(model, budget=args.budget, n_seq_max=1, keep="system", **common)
        cm = serve_in_background(create_app(llm, model_id="m", session_mib=mib))
        port = cm.__enter__()
        stack.append(cm)
        servers[name] = (llm, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                            timeout=args.timeout))
    found = {name: [] for name in servers}
    try:
        for i in range(args.chats):
            for name, (llm, client) in servers.items():  # alternating: the machine's noise falls on both
                t0 = time.perf_counter()
                ttft, cached, prompt = None, 0, 0
                stream = client.chat.completions.create(
                    model="m", messages=[system, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    max_tokens=args.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
                for ch in stream:
                    if ttft is None and ch.choices and ch.choices[0].delta.content:
                        ttft = time.perf_counter() - t0
                    if ch.usage:
                        cached = ch.usage.prompt_tokens_details.cached_tokens
                        prompt = ch.usage.prompt_tokens
                found[name].append({"request": i + 1, "prompt_tokens": prompt, "cached_tokens": cached,
                                    "ttft_s": round(ttft, 3) if ttft is not None else None})
                print(name, json.dumps(found[name][-1]))
    finally:
        for cm in stack:
            cm.__exit__(None, None, None)
    later = {name: [r["ttft_s"] for r in rs[1:] if r["ttft_s"] is not None] for name, rs in found.items()}
    on, off = statistics.median(later["sessions on"]), statistics.median(later["sessions off"])
    lines = [f"{args.chats} conversations sharing one system prompt ({found['sessions on'][0]['prompt_tokens']} prompt "
             f"tokens in the first), different questions, one at a time, budget {args.budget}, "
             f"the default policy; one run, servers alternating\n",
             "| request | cached tokens, sessions on | TTFT s, sessions on | cached tokens, sessions off | TTFT s, sessions off |",
             "|---|---|---|---|---|"]
    for a, b in zip(found["sessions on"], found["sessions off"]):
        lines.append(f"| {a['request']} | {a['cached_tokens']} | {a['ttft_s']} | {b['cached_tokens']} | {b['ttft_s']} |")
    lines.append(f"\nRequests 2-{args.chats}, median time to first token: sessions on {on} s, off {off} s "
                 f"(ratio {on / off:.2f}).")
    write_report(args, {"rows": found}, lines)
    return 0


def equal_memory(model, args, common) -> int:
    """The full cache and the default policy within the same KV memory, each with as many slots as fit."""
    conversations = chats(args.chats, args.article_chars)
    limit = int(args.equal_memory * 2**20)
    probe = Llama(model, budget=args.budget, **common)
    prompt_tokens = max(len(probe.chat_tokens(c)[0]) for c in conversations)
    del probe
    bounded = dict(budget=args.budget) if args.policy is None else dict(budget=args.budget, policy=args.policy)
    settings = [(args.policy or "default policy",
                 lambda: Llama.for_kv_limit(model, limit, prompt_tokens=prompt_tokens, max_tokens=args.max_tokens,
                                            **bounded, **common)),
                ("full cache", lambda: Llama.for_kv_limit(model, limit, prompt_tokens=prompt_tokens,
                                                          max_tokens=args.max_tokens, **common))]
    rows = []
    for name, make in settings:
        llm = make()
        r = {"setting": name, "policy": llm.policy.label,
             **load(llm, conversations, args.max_tokens, args.timeout, ignore_eos=True)}
        print(json.dumps(r))
        rows.append(r)
        del llm
    d, f = rows
    lines = [f"{args.chats} streaming chats arriving at once, prompts up to {prompt_tokens} tokens, {args.max_tokens} "
             f"tokens each (end tokens ignored), greedy, within {args.equal_memory} MiB of KV each; one run\n",
             "| setting | policy | chats held | KV MiB | throughput tok/s | TTFT mean / max s | token gap mean / p95 / max ms | completed |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [row_cells(r, r["throughput_tok_s"], f"{r['ttft_mean_s']} / {r['ttft_max_s']}",
                        f"{r['token_gap_ms']} / {r['token_gap_p95_ms']} / {r['token_gap_max_ms']}",
                        f"{r['completed']}/{r['requests']}") for r in rows]
    lines.append(f"\n{d['setting']} vs full cache at equal KV memory: {d['slots'] / f['slots']:.1f}x the chats held, "
                 f"{d['throughput_tok_s'] / f['throughput_tok_s']:.2f}x the throughput, "
                 f"{d['token_gap_ms'] / f['token_gap_ms']:.2f}x the mean gap between tokens.")
    write_report(args, {"prompt_tokens": prompt_tokens, "rows": rows}, lines)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file, or smollm2 (the default), qwen05b, qwen15b")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--article-chars", type=int, default=3500)
    ap.add_argument("--n-batch", type=int, default=128)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per setting at most")
    ap.add_argument("--out", default="results/serving/serve-load")
    ap.add_argument("--equal-memory", type=float, metavar="MIB", help="the full cache and the default policy, each "
                    "within this much KV memory, as many chats held as fit")
    ap.add_argument("--policy", help="with --equal-memory: the bounded policy's name (default: the default policy)")
    ap.add_argument("--shared-prefix", action="store_true", help="conversations that share a system prompt, one at "
                    "a time, with and without saved sessions")
    args = ap.parse_args(argv)
    model = model_path(args.model)
    if args.equal_memory:
        return equal_memory(model, args, dict(n_batch=args.n_batch, n_threads=args.threads, kv_unified=False))
    if args.shared_prefix:
        return shared_prefix(model, args, dict(n_batch=args.n_batch, n_threads=args.threads, kv_unified=False))
    conversations = chats(args.chats, args.article_chars)
    common = dict(n_batch=args.n_batch, n_threads=args.threads, kv_unified=False)

    h2o = Llama(model, budget=args.budget, n_seq_max=args.chats, **common)
    prompt_tokens = max(len(h2o.chat_tokens(c)[0]) for c in conversations)
    settings = [("h2o", h2o)]
    try:
        full = Llama.for_kv_limit(model, h2o.kv_state().kv_bytes, prompt_tokens=prompt_tokens,
                                  max_tokens=args.max_tokens, **common)
        settings.append(("full, same KV memory", full))
    except ValueError as e:
        print(f"full cache: {e}")
    settings.append(("h2o, one slot (sequential)", Llama(model, budget=args.budget, **common)))

    rows = []
    for name, llm in settings:
        r = {"setting": name, "policy": llm.policy.label, **load(llm, conversations, args.max_tokens, args.timeout)}
        print(json.dumps(r))
        rows.append(r)
        del llm
    base = rows[0]["throughput_tok_s"]
    lines = [f"{args.chats} concurrent streaming chats, prompts up to {prompt_tokens} tokens, {args.max_tokens} tokens "
             f"each, greedy; one run\n",
             "| setting | policy | slots | KV MiB | throughput tok/s | vs h2o | TTFT mean / max s | token gap ms | completed |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row_cells(r, r["throughput_tok_s"], f"{r['throughput_tok_s'] / base:.2f}",
                        f"{r['ttft_mean_s']} / {r['ttft_max_s']}", r["token_gap_ms"],
                        f"{r['completed']}/{r['requests']}") for r in rows]
    write_report(args, {"prompt_tokens": prompt_tokens, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
