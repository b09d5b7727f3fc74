"""`h2o-local serve` as a person runs it: a banner that says what is served and where, a log line per request, and
Ctrl-C or SIGTERM stops it within two seconds whatever it is reading."""
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tiny_model import write_tiny_llama

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("serve") / "chat.gguf", chat_template=CHATML, n_ctx_train=2048))


class Served:
    """`h2o-local serve` in a child process on a free port; its stderr collected line by line."""

    def __init__(self, model, *extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "h2o_local", "serve", "--model", model, "--port", "0",
                                      "--threads", "1", "--budget", "48", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.port = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 60
        while self.port is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.lines)
            time.sleep(0.05)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))

    def chat(self, content, max_tokens=8):
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_the_banner_says_what_is_served_and_each_request_gets_a_log_line(chat_model):
    served = Served(chat_model)
    try:
        banner = "\n".join(served.lines[:2])
        assert "h2o-local serve: chat.gguf on " in banner
        assert "budget 48 tokens per conversation" in banner and "4 slots" in banner and "KV " in banner
        assert "the chat page at http://127.0.0.1:" in banner
        status, out = served.chat("hello there", max_tokens=6)
        assert status == 200
        n_prompt = out["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 10
        while not any("slot 0:" in line for line in served.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        line = next(line for line in served.lines if "slot 0:" in line)
        assert re.search(rf"slot 0: prompt {n_prompt} tokens \({n_prompt} fed, 0 reused\), first token [\d.]+ s, "
                         rf"{out['usage']['completion_tokens']} tokens at [\d.]+ tok/s, kv \d+/48 kept, \d+ evicted", line), line
    finally:
        served.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_within_two_seconds_while_it_reads_a_long_prompt(chat_model, sig):
    served = Served(chat_model, "--max-prompt-tokens", "400000", "-b", "16")
    answer = {}
    try:
        # ~200k byte tokens: about 13 s of reading on this model, fed in chunks of 16
        client = threading.Thread(target=lambda: answer.update(out=served.chat("the quick brown fox " * 10000)))
        client.start()
        time.sleep(1.5)
        assert served.proc.poll() is None and not answer  # still reading it
        t0 = time.monotonic()
        served.proc.send_signal(sig)
        served.proc.wait(timeout=30)
        stopped_s = time.monotonic() - t0
        client.join(timeout=10)
        assert stopped_s < 2.5, (stopped_s, served.lines[-8:])
        status, body = answer["out"]
        assert status == 503 and body["error"]["code"] == "shutting_down"
        assert not any("Traceback" in line for line in served.lines), "\n".join(served.lines)
    finally:
        served.stop()
