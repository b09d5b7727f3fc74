"""`h2o-local chat`, driven through a real terminal (pexpect): streaming, status line, commands, Ctrl-C, Ctrl-D."""
import sys
import time

import pytest

import pexpect

from tiny_model import write_tiny_llama

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = ">>> "


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("chat") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))


def spawn(model, *extra):
    child = pexpect.spawn(sys.executable, ["-m", "h2o_local", "chat", "--model", model, "--budget", "48",
                                           "--temperature", "0", "--threads", "1", *extra],
                          env={"TERM": "dumb", "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"},
                          encoding="utf-8", codec_errors="replace", timeout=60)
    child.expect_exact(PROMPT)
    return child


def finish(child):
    child.expect(pexpect.EOF)
    child.close()
    assert "Traceback" not in child.before
    return child.exitstatus


def test_a_conversation_keeps_its_cache_and_shows_a_status_line(chat_model, tmp_path):
    child = spawn(chat_model, "--system", "You are tiny.", "--max-tokens", "40")
    child.sendline("hello")
    child.expect(r"\[kv (\d+)/48 · evicted (\d+) · host (\d+) · recalled \d+ · 40 tokens, [\d.]+ tok/s · prompt (\d+) fed, 0 reused\]")
    assert int(child.match.group(1)) == 48  # the first turn already filled the budget
    assert int(child.match.group(3)) == int(child.match.group(2))  # recall is on: what left waits in host memory
    first_prompt = int(child.match.group(4))
    child.expect_exact(PROMPT)
    child.sendline("and again")  # the first turn is reused from the cache: its prompt at least, not fed again
    child.expect(r"prompt (\d+) fed, (\d+) reused\]")
    assert int(child.match.group(2)) >= first_prompt and int(child.match.group(1)) > 0
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"n_keep: (\d+)")
    assert int(child.match.group(1)) > 0  # the system prompt is protected (--keep system)
    child.expect(r"kv: [\d.]+ MiB")  # sizes people read, not raw bytes
    child.expect_exact(PROMPT)
    saved = tmp_path / "chat.session"
    child.sendline(f"/save {saved}")
    child.expect(r"\(saved 5 messages, 48 KV entries, (\d+) entries waiting in host memory for recall to .*: "
                 r"[\d.]+ MiB\)")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("(conversation forgotten)")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {saved}")
    child.expect(r"\(loaded .*: 5 messages, 48 KV entries\)")
    child.expect_exact(PROMPT)
    child.sendline("/load /nonexistent/file")
    child.expect_exact("error:")
    child.expect_exact(PROMPT)
    child.sendline("/help")
    child.expect_exact("/save FILE")
    child.expect_exact(PROMPT)
    child.sendeof()
    assert finish(child) == 0


def test_ctrl_c_stops_the_answer_and_keeps_the_session(chat_model):
    child = spawn(chat_model, "--max-tokens", "1000000", "--ignore-eos", "--position-rolling")
    child.sendline("talk forever")
    child.expect(r"\S{20}")      # the answer is streaming
    child.sendintr()
    child.expect(r"\[kv \d+/48 .* · stopped\]")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"turns: 1")
    child.expect_exact(PROMPT)
    child.sendintr()             # at the prompt: a hint, then a second Ctrl-C leaves
    child.expect_exact("Ctrl-C again")
    child.sendintr()
    assert finish(child) == 0


def test_a_bad_option_is_one_line_without_traceback(chat_model, tmp_path):
    bare = str(write_tiny_llama(tmp_path / "bare.gguf"))
    for args, message in ((["--model", bare], "no chat template"), (["--model", chat_model, "--budget", "8", "--keep", "9"],
                                                                     "protected prefix"),
                          (["--model", "/nonexistent.gguf"], "not found")):
        child = pexpect.spawn(sys.executable, ["-m", "h2o_local", "chat", *args], encoding="utf-8", timeout=60)
        child.expect_exact(message)
        assert finish(child) == 2


def test_a_file_goes_with_the_next_message_and_a_long_prompt_shows_its_progress(chat_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper counts the ships. " * 15, encoding="utf-8")
    child = spawn(chat_model, "--file", str(doc), "--max-tokens", "8")
    child.sendline("What does the keeper count?")
    child.expect(r"reading the prompt: \d+/(\d+) tokens")
    assert int(child.match.group(1)) > 500  # the document went with the message
    child.expect(r"prompt (\d+) fed")
    assert int(child.match.group(1)) > 500
    child.expect_exact(PROMPT)
    child.sendline(f"/file {doc}")
    child.expect(r"\(attached .*doc.txt: (\d+) tokens; it goes with your next message\)")
    child.expect_exact(PROMPT)
    child.sendline("/file /nonexistent/doc.txt")
    child.expect_exact("error: cannot attach /nonexistent/doc.txt")
    child.expect_exact(PROMPT)
    child.sendline("/file")
    child.expect_exact("usage: /file PATH")
    child.expect_exact(PROMPT)
    child.sendeof()
    assert finish(child) == 0
    missing = pexpect.spawn(sys.executable, ["-m", "h2o_local", "chat", "--model", chat_model, "--file", "/nope.txt"],
                            env={"TERM": "dumb", "PATH": "/usr/bin:/bin"}, encoding="utf-8", timeout=60)
    missing.expect_exact("error: cannot attach /nope.txt")
    assert finish(missing) == 2


def test_a_thinking_models_reasoning_is_shown_apart_or_hidden(tmp_path):
    """The template opens the think tags (DeepSeek-R1's distills), so the tiny model's text is all reasoning: shown
    between Ollama's "Thinking..." and "...done thinking.", or not at all with --hide-thinking."""
    from test_reasoning import OPENED

    model = str(write_tiny_llama(tmp_path / "think.gguf", chat_template=OPENED, n_ctx_train=4096))
    child = spawn(model, "--max-tokens", "8")
    child.sendline("think")
    child.expect_exact("Thinking...")
    child.expect(r"\S+")
    child.expect_exact("...done thinking.")
    child.expect_exact("[kv ")
    child.expect_exact(PROMPT)
    child.sendeof()
    assert finish(child) == 0
    hidden = spawn(model, "--max-tokens", "8", "--hide-thinking")
    hidden.sendline("think")
    hidden.expect_exact("[kv ")
    assert "Thinking" not in hidden.before and "8 tokens" in hidden.readline()
    hidden.expect_exact(PROMPT)  # Ctrl-D typed before readline holds the terminal would be lost
    hidden.sendeof()
    assert finish(hidden) == 0


def test_file_reads_a_regular_file_only_and_at_most_its_limit(tmp_path):
    """/file on /dev/zero read for ever, and on a pipe with no writer waited for one: both are refused at once."""
    import os
    import time

    from h2o_local.cli.common import MAX_FILE_BYTES, read_text_file

    doc = tmp_path / "doc.txt"
    doc.write_text("plain text\n")
    assert read_text_file(str(doc)) == "plain text\n"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    start = time.monotonic()
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises((ValueError, OSError)):
            read_text_file(path)
    assert time.monotonic() - start < 5
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (MAX_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_text_file(str(big))


def test_save_over_a_symlink_replaces_the_link_and_leaves_its_target(chat_model, tmp_path):
    from h2o_local import Llama
    from h2o_local.chat_session import ChatSession

    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "chat.session"
    link.symlink_to(target)
    session = ChatSession(Llama(chat_model, budget=48, n_threads=1), max_tokens=2, temperature=0)
    "".join(session.send("hi"))
    session.save(link)
    assert target.read_text() == "keep me" and not link.is_symlink()
    ChatSession(Llama(chat_model, budget=48, n_threads=1)).load(link)


def test_text_typed_while_an_answer_streams_is_not_echoed_into_it(chat_model):
    child = spawn(chat_model, "--max-tokens", "400", "--ignore-eos")
    child.sendline("talk for a while")
    child.expect(r"\S{20}")      # the answer is streaming
    child.send("typed-ahead")    # a terminal echoes this by default
    child.expect(r"\[kv \d+/48 .*\]")
    assert "typed-ahead" not in child.before
    child.expect_exact(PROMPT)
    child.sendintr()             # leave: Ctrl-C twice at the prompt
    child.expect_exact("Ctrl-C again")
    child.sendintr()
    assert finish(child) == 0


def test_ctrl_c_while_a_long_prompt_is_read_stops_within_a_chunk(chat_model, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text("The lighthouse keeper counts the ships. " * 2500, encoding="utf-8")  # ~100k byte tokens
    child = spawn(chat_model, "--file", str(doc), "--max-tokens", "8", "-b", "16")
    child.sendline("What does the keeper count?")
    child.expect(r"reading the prompt: \d+/\d+ tokens")
    t0 = time.monotonic()
    child.sendintr()
    child.expect(r"\[kv .* · stopped\]")
    assert time.monotonic() - t0 < 2.0
    child.expect_exact(PROMPT)
    child.sendline("/stats")     # the session is still usable
    child.expect(r"kv_entries: \d+")
    child.expect_exact(PROMPT)  # Ctrl-D typed before readline holds the terminal would be lost
    child.sendeof()
    assert finish(child) == 0
