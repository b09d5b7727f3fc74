"""Fault run against `h2o-local serve` on loopback: what clients and attackers do, and what must hold afterwards.

    python -m benchmarks.server_faults --out results/serving/server-faults-smollm2          # SmolLM2, 1,000 requests
    python -m benchmarks.server_faults --sequential 50 --disconnects 5 --out /tmp/f  # a quick one

Starts the server as a child process (its own resident memory is what is sampled), then:
- malformed requests (bad JSON, wrong types, out-of-range fields, nested or invalid-UTF-8 bodies, unknown routes):
  each must get a 4xx with an OpenAI-shaped error, never a 5xx;
- oversized bodies, declared (Content-Length) and streamed in chunks without a length: 413;
- clients that disconnect mid-stream, give up on a non-streaming answer, or leave while waiting for a slot:
  the slots and the waiting line must drain;
- a burst of concurrent requests past slots + waiting line: only 200 and 429 (with Retry-After);
- N sequential requests (chat and completions, each a new conversation so the session cache churns), resident
  memory sampled every 100;
then a greedy reference answer must equal the one given before the faults, the server must still run, its log
must hold no traceback, and it must stop cleanly on SIGINT. Writes OUT.json and OUT.md; exit 1 if a check failed.
The checks are plain functions of a base URL (`run_faults`), so the tests run them at a small size.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Name three colours."}]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Report:
    checks: List[Check] = field(default_factory=list)
    figures: Dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    @property
    def failed(self) -> List[Check]:
        return [c for c in self.checks if not c.ok]


def chat(content: str, **extra: Any) -> Dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


# (name, path, body: JSON-able value or raw bytes, expected status or statuses)
MALFORMED: List[tuple] = [
    ("body is not JSON", CHAT, b"{not json", 400),
    ("body is a JSON array", CHAT, b"[]", 400),
    ("body is empty", CHAT, b"", 400),
    ("messages missing", CHAT, {"max_tokens": 4}, 400),
    ("messages is a string", CHAT, {"messages": "hi"}, 400),
    ("messages is empty", CHAT, {"messages": []}, 400),
    ("message without content", CHAT, {"messages": [{"role": "user"}]}, 400),
    ("message role unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("message role is a list", CHAT, {"messages": [{"role": ["user"], "content": "hi"}]}, 400),
    ("message role is an object", CHAT, {"messages": [{"role": {"a": 1}, "content": "hi"}]}, 400),
    ("message content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("message is a string", CHAT, {"messages": ["hi"]}, 400),
    ("max_tokens negative", CHAT, chat("hi", max_tokens=-1), 400),
    ("max_tokens a string", CHAT, chat("hi", max_tokens="many"), 400),
    ("temperature a string", CHAT, chat("hi", temperature="hot"), 400),
    ("temperature negative", CHAT, chat("hi", temperature=-1), 400),
    ("temperature NaN", CHAT, json.dumps(chat("hi", temperature=float("nan"))).encode(), 400),
    ("top_p 7", CHAT, chat("hi", top_p=7), 400),
    ("top_k -1", CHAT, chat("hi", top_k=-1), 400),
    ("n = 17", CHAT, chat("hi", n=17), 400),
    ("stop is a number", CHAT, chat("hi", stop=7), 400),
    ("stream is a string", CHAT, chat("hi", stream="sometimes"), 400),
    ("stream_options is a list", CHAT, chat("hi", stream=True, stream_options=[1]), 400),
    ("JSON nested 100,000 deep", CHAT, b"[" * 100_000 + b"]" * 100_000, (400, 413)),
    ("invalid UTF-8 in a message", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("prompt missing", COMPLETIONS, {"max_tokens": 4}, 400),
    ("prompt is empty (400, or 200 from a model that starts with BOS)", COMPLETIONS, {"prompt": "", "max_tokens": 4},
     (200, 400)),
    ("prompt token id past the vocabulary", COMPLETIONS, {"prompt": [10**9], "max_tokens": 4}, 400),
    ("prompt token id negative", COMPLETIONS, {"prompt": [-1], "max_tokens": 4}, 400),
    ("prompt token ids empty", COMPLETIONS, {"prompt": [], "max_tokens": 4}, 400),
    ("more prompts than the slots and waiting line hold", COMPLETIONS, {"prompt": ["a"] * 1000, "max_tokens": 4}, 400),
    ("a batch with a token-id prompt past the vocabulary", COMPLETIONS,
     {"prompt": [[5, 6], [10**9]], "max_tokens": 4}, 400),
    ("a batch of one empty token-id prompt", COMPLETIONS, {"prompt": [[]], "max_tokens": 4}, 400),
    ("prompt is a dict", COMPLETIONS, {"prompt": {"a": 1}, "max_tokens": 4}, 400),
    ("prompt token ids with a JSON boolean", COMPLETIONS, {"prompt": [5, True], "max_tokens": 4}, 400),
    ("prompt token id 2^40", COMPLETIONS, {"prompt": [2**40], "max_tokens": 4}, 400),
    ("a lone surrogate in a message", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400),
    ("stop: 50 strings", CHAT, chat("hi", stop=[f"s{i}" for i in range(50)]), 400),
    ("stop: 220,000 strings", CHAT, chat("hi", stop=["x"] * 220_000), (400, 413)),
    ("stop: a string of 10,000 characters", CHAT, chat("hi", stop="y" * 10_000), 400),
    ("logit_bias: a value of 1,000", CHAT, chat("hi", logit_bias={"5": 1000}), 400),
    ("logit_bias: a key that is neither a token id nor text", CHAT, chat("hi", logit_bias=[[1.5, 1]]), 400),
    ("logit_bias: a token id past the vocabulary", CHAT, chat("hi", logit_bias={"999999999": 1}), 400),
    ("logit_bias: 100,000 entries", CHAT, chat("hi", logit_bias={str(i): 1 for i in range(100_000)}), (400, 413)),
    ("unsupported: suffix", COMPLETIONS, {"prompt": "x", "suffix": "end"}, 400),
    ("logprobs: 21 top tokens (at most 20)", COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400),
    ("top_logprobs without logprobs", CHAT, chat("hi", top_logprobs=2), 400),
    ("response_format of type yaml", CHAT, chat("hi", response_format={"type": "yaml"}), 400),
    ("response_format json_schema without a schema", CHAT, chat("hi", response_format={"type": "json_schema"}), 400),
    ("a grammar that does not parse", CHAT, chat("hi", grammar='root ::= "open'), 400),
    ("a grammar and a response_format", CHAT, chat("hi", grammar='root ::= "a"', response_format={"type": "json_object"}), 400),
    ("tools whose parameters are not a schema", CHAT,
     chat("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": "none"}}]), 400),
    ("tools: a tool without a name", CHAT, chat("hi", tools=[{"type": "function", "function": {}}]), 400),
    ("tool_choice without tools", CHAT, chat("hi", tool_choice="required"), 400),
    ("presence_penalty 3 (OpenAI's range is [-2, 2])", CHAT, chat("hi", presence_penalty=3.0), 400),
    ("repeat_penalty 0", CHAT, chat("hi", repeat_penalty=0), 400),
    ("repeat_penalty and repetition_penalty that differ", CHAT, chat("hi", repeat_penalty=1.1, repetition_penalty=1.2), 400),
]


# valid but extreme: each must be answered (200)
EXTREME: List[tuple] = [
    ("top_k 2^40 (= off)", CHAT, chat("hi", top_k=2**40)),
    ("seed 2^70 (taken modulo 2^32)", CHAT, chat("hi", seed=2**70)),
    ("seed negative", CHAT, chat("hi", seed=-5)),
    ("temperature 100", CHAT, chat("hi", temperature=100)),
    ("stop: 16 strings", CHAT, chat("hi", stop=[f"s{i}" for i in range(16)])),
    ("max_tokens 0", CHAT, chat("hi", max_tokens=0)),
    ("prompt of 1,000 token ids", COMPLETIONS, {"prompt": [100 + i % 100 for i in range(1000)], "max_tokens": 2}),
    ("unknown fields are ignored", CHAT, chat("hi", frobnicate=True, user="someone")),
    ("unsupported fields at their defaults are accepted", CHAT, chat("hi", logprobs=False, tools=[], suffix="")),
    ("logprobs with 20 top tokens", CHAT, chat("hi", logprobs=True, top_logprobs=20)),
    ("echo and logprobs of 200 prompt tokens", COMPLETIONS, {"prompt": [100 + i % 100 for i in range(200)],
                                                            "max_tokens": 0, "echo": True, "logprobs": 20}),
    ("penalties and a bias at their limits", CHAT, chat("hi", logit_bias={"5": -100, "6": 100}, presence_penalty=2,
                                                         frequency_penalty=-2, repeat_penalty=10, repeat_last_n=4096)),
]


def _openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
        return isinstance(err["message"], str) and bool(err["message"])
    except (ValueError, KeyError, TypeError):
        return False


def check_malformed(base: str, report: Report) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        for name, path, body, status in MALFORMED:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=content, headers={"Content-Type": "application/json"})
            expected = status if isinstance(status, tuple) else (status,)
            report.add(f"malformed: {name}", r.status_code in expected and (r.status_code == 200 or _openai_error(r)),
                       f"{r.status_code} {r.text[:120]!r}")
        for name, path, body in EXTREME:
            r = c.post(path, json=body)
            report.add(f"extreme but valid: {name}", r.status_code == 200, f"{r.status_code} {r.text[:120]!r}")
        r = c.get("/v1/nowhere")
        report.add("unknown route: 404", r.status_code == 404, str(r.status_code))
        r = c.get(CHAT)
        report.add("GET on a POST route: 405", r.status_code == 405, str(r.status_code))


def check_oversized(base: str, report: Report, limit: int) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (limit + 1024) + b'"}]}'
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post(CHAT, content=big, headers={"Content-Type": "application/json"})
        report.add("oversized body with Content-Length: 413", r.status_code == 413 and _openai_error(r), str(r.status_code))

        def chunks():
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]

        try:
            r = c.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
            report.add("oversized body in chunks, no length: 413", r.status_code == 413, str(r.status_code))
        except httpx.HTTPError as e:  # the server may close the connection once it has answered
            report.add("oversized body in chunks, no length: 413", False, f"{type(e).__name__}: {e}")
    with socket.create_connection(_host_port(base), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: -5\r\n\r\n")
        status = s.recv(4096).split(b" ", 2)[1:2]
        report.add("negative Content-Length: 4xx", bool(status) and status[0].startswith(b"4"), repr(status))


def _host_port(base: str):
    hostport = base.split("://", 1)[1].rstrip("/")
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def wait_idle(base: str, timeout_s: float = 60.0) -> Dict[str, Any]:
    """The server's /health once no slot is busy and no request waits (or the last seen after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    h: Dict[str, Any] = {}
    while time.monotonic() < deadline:
        h = httpx.get(base + "/health", timeout=30).json()
        if h["slots_processing"] == 0 and h["requests_waiting"] == 0:
            return h
        time.sleep(0.2)
    return h


def check_disconnects(base: str, report: Report, n: int, slots: int) -> None:
    long = chat("Write a long story about a lighthouse keeper.", max_tokens=400, ignore_eos=True)
    for _ in range(n):  # read a few chunks of a stream, then hang up
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", CHAT, json={**long, "stream": True}) as r:
                for i, _line in enumerate(r.iter_lines()):
                    if i >= 4:
                        break
    for _ in range(max(1, n // 4)):  # give up on a non-streaming answer
        try:
            httpx.post(base + CHAT, json=long, timeout=0.3)
        except httpx.TimeoutException:
            pass
    # fill every slot, then send requests that wait for one and leave before it comes
    hold = [httpx.Client(base_url=base, timeout=60) for _ in range(slots)]
    streams = [c.stream("POST", CHAT, json={**long, "stream": True}) for c in hold]
    for s in streams:
        r = s.__enter__()
        next(r.iter_lines())
    for _ in range(max(1, n // 4)):
        try:
            httpx.post(base + CHAT, json=long, timeout=0.2)
        except httpx.TimeoutException:
            pass
    for s, c in zip(streams, hold):
        s.__exit__(None, None, None)
        c.close()
    h = wait_idle(base)
    report.add("after disconnects the slots and the waiting line drain",
               h.get("slots_processing") == 0 and h.get("requests_waiting") == 0, json.dumps(h))


def check_burst(base: str, report: Report, n: int) -> None:
    def one(i: int):
        try:
            r = httpx.post(base + CHAT, json=chat(f"Count to {i}.", max_tokens=16), timeout=300)
            return r.status_code, r.headers.get("retry-after")
        except httpx.HTTPError as e:
            return type(e).__name__, None

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    codes = [c for c, _ in results]
    counts = {str(c): codes.count(c) for c in sorted(set(codes), key=str)}
    report.figures["burst"] = {"requests": n, "statuses": counts}
    report.add(f"burst of {n}: only 200 and 429", set(codes) <= {200, 429} and 200 in codes, json.dumps(counts))
    report.add("every 429 says Retry-After", all(ra for c, ra in results if c == 429))
    h = wait_idle(base)
    report.add("after the burst the server is idle", h.get("slots_processing") == 0, json.dumps(h))


def check_sequential(base: str, report: Report, n: int, rss: Optional[Callable[[], int]]) -> None:
    samples, bad, t0 = [], [], time.perf_counter()
    with httpx.Client(base_url=base, timeout=120) as c:
        for i in range(n):
            if i % 2:
                r = c.post(COMPLETIONS, json={"prompt": f"Request {i}: the number after {i} is", "max_tokens": 4})
            else:
                r = c.post(CHAT, json=chat(f"Request {i}. Say the word {i}.", max_tokens=4))
            if r.status_code != 200:
                bad.append((i, r.status_code))
            if rss and (i % 100 == 0 or i == n - 1):
                samples.append((i, rss()))
    seconds = time.perf_counter() - t0
    report.figures["sequential"] = {"requests": n, "seconds": round(seconds, 1), "failed": len(bad),
                                    "rss_mib": [(i, round(b / 2**20, 1)) for i, b in samples]}
    report.add(f"{n} sequential requests all 200", not bad, str(bad[:5]))


def check_head_of_line(base: str, report: Report, prompt_words: int) -> None:
    """A stream runs; a prompt of about `prompt_words` words arrives, then the same prompt from a client that hangs up
    at once. Figures: the stream's gaps between tokens before and while the long prompt is read, and how long the
    server goes on with a prompt nobody waits for."""
    stamps: List[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 100_000, "temperature": 0.8, "seed": 1, "stream": True,
                "ignore_eos": True}  # a sampled end would end the stream before the long prompt comes
        with httpx.Client(base_url=base, timeout=300) as c, c.stream("POST", COMPLETIONS, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
                if done.is_set():
                    return

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while len(stamps) < 20 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.05)
    long_prompt = {"prompt": " ".join(f"word{i % 50}" for i in range(prompt_words)), "max_tokens": 1}
    t0 = time.perf_counter()
    r = httpx.post(base + COMPLETIONS, json=long_prompt, timeout=600)
    t1 = time.perf_counter()
    # the same prompt from a client that leaves once the server has started reading it (half a second)
    body = json.dumps({**long_prompt, "prompt": "Again: " + long_prompt["prompt"]}).encode()  # no saved prefix
    with socket.create_connection(_host_port(base), timeout=30) as sock:
        sock.sendall(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
    t2 = time.perf_counter()  # the next request needs the slot the abandoned prompt holds
    httpx.post(base + COMPLETIONS, json={"prompt": "Next", "max_tokens": 1}, timeout=600)
    freed = time.perf_counter() - t2
    done.set()
    t.join(60)

    def gaps(a: float, b: float) -> List[float]:
        inside = [x for x in stamps if a <= x <= b]
        return [y - x for x, y in zip(inside, inside[1:])]

    before = gaps(0, t0)
    # every gap between two tokens that overlaps the time the long prompt was read (a stall spans it whole)
    during = [y - x for x, y in zip(stamps, stamps[1:]) if y >= t0 and x <= t1]
    ms = lambda xs, f: round(1000 * f(xs), 1) if xs else None
    report.figures["head_of_line"] = {
        "prompt_tokens": r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else r.status_code,
        "prompt_seconds": round(t1 - t0, 2), "stream_tokens_while_read": len([x for x in stamps if t0 <= x <= t1]),
        "gap_ms_median_before": ms(before, statistics.median), "gap_ms_max_before": ms(before, max),
        "gap_ms_median_while_read": ms(during, statistics.median), "gap_ms_max_while_read": ms(during, max),
        "next_request_seconds_after_a_client_left_its_long_prompt": round(freed + 0.5, 2)}
    report.add("a long prompt does not stall a running stream (no gap between its tokens of half the prompt's time)",
               r.status_code == 200 and bool(during) and max(during) < max((t1 - t0) / 2, 0.25),
               json.dumps(report.figures["head_of_line"]))
    report.add("a long prompt whose client left does not hold its slot until it is read",
               freed < max((t1 - t0) / 2, 1.0),  # 1 s: the server looks for gone clients every 0.5 s
               f"the next request took {freed:.2f} s; reading the prompt took {t1 - t0:.2f} s")


def check_planted_session(base: str, report: Report, render: Callable[[List[Dict[str, str]]], str]) -> None:
    """A client sends another's chat text and answer as a completion that generates nothing (it would have replaced
    that chat's saved cache when sessions were keyed by text): the chat's next answer must not change. The first
    message is long enough that the cache evicts, so a lost protected prefix (the system prompt) would show."""
    facts = " ".join(f"Fact {i}: the lighthouse keeper wrote letter {i}." for i in range(40))
    first = [{"role": "system", "content": "You are a terse assistant."},
             {"role": "user", "content": facts + " What did the keeper write?"}]

    def chat(messages: List[Dict[str, str]], n: int) -> str:
        r = httpx.post(base + CHAT, json={"messages": messages, "max_tokens": n, "temperature": 0}, timeout=300)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    answers = []
    for plant in (False, True):
        answer = chat(first, 24)
        if plant:
            httpx.post(base + COMPLETIONS, json={"prompt": render(first) + answer, "max_tokens": 0},
                       timeout=300).raise_for_status()
        answers.append(chat(first + [{"role": "assistant", "content": answer},
                                     {"role": "user", "content": "And then?"}], 16))
    report.add("a completion that plants a chat's text does not change the chat's next answer",
               answers[0] == answers[1], f"{answers[0]!r} / {answers[1]!r}")


def greedy_answer(base: str) -> str:
    r = httpx.post(base + CHAT, json={"messages": HELLO, "max_tokens": 24, "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def run_faults(base: str, *, slots: int, max_waiting: int, body_limit: int, disconnects: int, sequential: int,
               rss: Optional[Callable[[], int]] = None, report: Optional[Report] = None,
               long_prompt_words: int = 0,
               render: Optional[Callable[[List[Dict[str, str]]], str]] = None) -> Report:
    """Every check against the server at `base`; the report says which held. `long_prompt_words`: the head-of-line
    check's prompt (0: not run; it needs a server with 2 slots or more and prompts longer than a batch). `render`:
    the server's chat template as text (the planted-session check; not run without it)."""
    report = report or Report()
    before = greedy_answer(base)
    if long_prompt_words:
        check_head_of_line(base, report, long_prompt_words)
    if render is not None:
        check_planted_session(base, report, render)
    check_malformed(base, report)
    check_oversized(base, report, body_limit)
    check_disconnects(base, report, disconnects, slots)
    check_burst(base, report, slots + max_waiting + 10)
    check_sequential(base, report, sequential, rss)
    after = greedy_answer(base)
    report.add("the greedy answer after the faults equals the one before", after == before, f"{before!r} / {after!r}")
    return report


# --- the server as a child process ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.server_faults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--max-waiting", type=int, default=4)
    ap.add_argument("--session-mib", type=float, default=32)
    ap.add_argument("--disconnects", type=int, default=20)
    ap.add_argument("--sequential", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long-prompt-words", type=int, default=680,
                    help="the head-of-line check's prompt, in words (about 1,900 tokens on SmolLM2; 0: skip it)")
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: OUT.json, OUT.md, OUT.log (server)")
    args = ap.parse_args(argv)

    from experiments.common import resident_bytes
    from experiments.models import model_path
    from h2o_local import Llama

    model = model_path(args.model)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".log")
    cmd = [sys.executable, "-m", "h2o_local", "serve", "--model", model, "--port", str(port), "--slots", str(args.slots),
           "--max-waiting", str(args.max_waiting), "--session-mib", str(args.session_mib), "--budget", str(args.budget),
           "--threads", str(args.threads)]
    report = Report()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(base + "/health", timeout=5)
                    break
                except httpx.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        print(f"the server did not start (see {log_path})", file=sys.stderr)
                        return 1
                    time.sleep(0.5)
            rss0 = resident_bytes(proc.pid)
            t0 = time.perf_counter()
            run_faults(base, slots=args.slots, max_waiting=args.max_waiting, body_limit=8 * 2**20,
                       disconnects=args.disconnects, sequential=args.sequential, rss=lambda: resident_bytes(proc.pid),
                       report=report, long_prompt_words=args.long_prompt_words,
                       render=Llama(model, budget=64, n_ctx=256, n_threads=1).apply_chat_template)
            report.figures["seconds"] = round(time.perf_counter() - t0, 1)
            report.figures["rss_mib_start"] = round(rss0 / 2**20, 1)
            report.figures["rss_mib_end"] = round(resident_bytes(proc.pid) / 2**20, 1)
            report.figures["health"] = httpx.get(base + "/health", timeout=30).json()
            report.add("the server still runs", proc.poll() is None)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
    report.add("the server stops cleanly on SIGINT (exit 0)", code == 0, f"exit {code}")
    text = log_path.read_text(errors="replace")
    report.add("the server log holds no traceback", "Traceback" not in text, f"{text.count('Traceback')} tracebacks")
    seq = report.figures.get("sequential", {}).get("rss_mib", [])
    if len(seq) >= 3:
        half = seq[len(seq) // 2][1]
        report.figures["rss_growth_second_half_mib"] = round(seq[-1][1] - half, 1)

    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "server": cmd[2:], "model": os.path.basename(model),
         "checks": [asdict(c) for c in report.checks], "figures": report.figures}, indent=1) + "\n")
    lines = [f"# Server fault run: {os.path.basename(model)}", "", f"`{' '.join(sys.argv)}`", "",
             f"{len(report.checks) - len(report.failed)} of {len(report.checks)} checks hold.", "",
             "| check | holds | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'yes' if c.ok else '**NO**'} | {c.detail[:100].replace('|', '/')} |" for c in report.checks]
    lines += ["", "```", json.dumps(report.figures, indent=1), "```", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    for c in report.failed:
        print(f"FAILED: {c.name}: {c.detail}", file=sys.stderr)
    print(f"{len(report.checks) - len(report.failed)} / {len(report.checks)} checks hold; "
          f"RSS {report.figures.get('rss_mib_start')} -> {report.figures.get('rss_mib_end')} MiB; {args.out}.md")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
