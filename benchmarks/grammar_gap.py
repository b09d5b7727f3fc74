"""How long a running stream waits while another client's structured-output request is served.

    python -m benchmarks.grammar_gap --out results/serving/grammar-gap-smollm2

An in-process server (2 slots, the default model unless --model) streams one answer (ignore_eos) while heavy
structured requests arrive one after the other on the second slot: a JSON schema with an enum of N values (N = 1,000
and 2,000: OpenAI's limit per schema and this server's default alternatives limit; 30,000: the case that stalled
every stream before the limits) and a schema with minItems 10,000,000. For each it reports the heavy request's
status and time, and the running stream's longest gap between two tokens while it was served, beside the stream's
median gap in the same run (a ratio, robust to the machine's speed). Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


def _post(port: int, body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read() or b"null")


def stream_gaps(port: int, body: Dict[str, Any], gaps: List[Tuple[float, float]],
                stop: Optional[threading.Event] = None) -> None:
    """Stream `body` from /v1/chat/completions, appending (time, gap since the chunk before) per chunk to `gaps`."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    last = None
    while stop is None or not stop.is_set():
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now
    c.close()


STORY = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "max_tokens": 100_000,
         "ignore_eos": True, "temperature": 0.7, "seed": 1}


def heavy_requests() -> List[Tuple[str, Dict[str, Any]]]:
    def enum(n):
        return {"type": "object", "properties": {"pick": {"enum": [f"option number {i}" for i in range(n)]}},
                "required": ["pick"]}

    return [(f"enum of {n:,} values", {"json_schema": enum(n)}) for n in (1_000, 2_000, 30_000)] + \
        [("minItems 10,000,000", {"json_schema": {"type": "array", "items": {"type": "integer"},
                                                  "minItems": 10_000_000}})]


def run(model: str, threads: int) -> List[Dict[str, Any]]:
    from h2o_local import Llama
    from h2o_local.server import create_app, serve_in_background

    llm = Llama(model, budget=256, n_seq_max=2, kv_unified=False, n_threads=threads)
    rows = []
    with serve_in_background(create_app(llm, model_id="bench")) as port:
        gaps: List[Tuple[float, float]] = []
        stop = threading.Event()
        t = threading.Thread(target=stream_gaps, args=(port, STORY, gaps, stop), daemon=True)
        t.start()
        while len(gaps) < 30:
            time.sleep(0.05)
        for name, fields in heavy_requests():
            start = time.perf_counter()
            status, body = _post(port, {"messages": [{"role": "user", "content": "Pick one option."}],
                                        "max_tokens": 24, "temperature": 0.7, "seed": 2, **fields})
            end = time.perf_counter()
            time.sleep(0.5)
            during = [g for at, g in gaps if start <= at <= end + 0.5]
            median = statistics.median(g for _, g in gaps)
            rows.append({"request": name, "status": status, "seconds": round(end - start, 3),
                         "finish": body["choices"][0]["finish_reason"] if status == 200 else None,
                         "error": body["error"]["message"][:120] if status != 200 else None,
                         "stream_max_gap_s": round(max(during), 3) if during else None,
                         "stream_median_gap_s": round(median, 4),
                         "gap_ratio": round(max(during) / median, 1) if during else None})
            print(json.dumps(rows[-1]), flush=True)
        stop.set()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args()
    from h2o_local.models import default_model_path

    rows = run(args.model or default_model_path(), args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = ["| heavy request | status | its time s | stream's longest gap s | median gap s | ratio |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['request']} | {r['status']} | {r['seconds']} | {r['stream_max_gap_s']} | "
              f"{r['stream_median_gap_s']} | {r['gap_ratio']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
