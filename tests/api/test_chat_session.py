"""ChatSession and its files: a load succeeds whole or changes nothing; a save never destroys the previous file; an
old answer stream cannot rewrite a newer conversation; bad text is one ValueError."""
import io
import json
import os
import struct
import zipfile

import numpy as np
import pytest

from h2o_local import Llama
from h2o_local.chat_session import ChatSession
from tiny_model import write_tiny_llama

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("chat") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))


def new_session(model, **kw):
    llm = Llama(model, budget=48, n_threads=1, keep="system", **{"policy": "h2o", **kw})
    return ChatSession(llm, system="You are tiny.", max_tokens=12, temperature=0)


def talk(session, text):
    return "".join(session.send(text))


def what_it_holds(session):
    st = session.llm.kv_state()
    return [m.copy() for m in session.messages], st.positions.tolist(), st.scores.tolist(), list(session.llm.pending)


def rewrite(path, out, **parts):
    """A copy of the session file `path` with some members replaced (bytes), written to `out`."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members.update(parts)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out


def damaged_kv(blob: bytes) -> bytes:
    """The snapshot with llama.cpp's own KV bytes damaged (the snapshot's frame stays well formed)."""
    n_origin = struct.unpack_from("<Q", blob, 8)[0]
    kv_at = 8 + 8 + n_origin + 8
    return blob[:kv_at] + b"\xff" * 8 + blob[kv_at + 8:]


@pytest.fixture
def saved(chat_model, tmp_path):
    """A session that said one thing and was saved, then said a second thing (not saved)."""
    s = new_session(chat_model)
    talk(s, "hello there")
    path = tmp_path / "one.session"
    s.save(path)
    talk(s, "and a second message that is long enough to evict")
    return s, path


def test_a_loaded_session_answers_as_the_one_that_never_stopped(chat_model, tmp_path):
    s = new_session(chat_model)
    talk(s, "hello there")
    s.save(tmp_path / "one.session")
    expected = talk(s, "what next?")
    other = new_session(chat_model)
    other.load(tmp_path / "one.session")
    assert talk(other, "what next?") == expected
    assert other.messages == s.messages and other.last.reused_tokens == s.last.reused_tokens > 0


@pytest.mark.parametrize("damage", ["kv_blob", "kv_values", "deflate", "json_field", "json_type", "policy", "truncated",
                                    "empty"])
def test_a_bad_file_is_one_value_error_and_changes_nothing(saved, tmp_path, damage):
    s, path = saved
    before = what_it_holds(s)
    bad = tmp_path / "bad.session"
    meta = json.loads(zipfile.ZipFile(path).read("session.json"))
    if damage == "kv_blob":
        rewrite(path, bad, **{"kv.bin": damaged_kv(zipfile.ZipFile(path).read("kv.bin"))})
    elif damage == "kv_values":  # a few bytes of K/V values: a well-formed file (its zip CRC rewritten) that answers
        kv = bytearray(zipfile.ZipFile(path).read("kv.bin"))  # differently unless the snapshot's checksum sees it
        for at in (len(kv) // 3, len(kv) // 2, len(kv) // 2 + 1):
            kv[at] ^= 0x10
        rewrite(path, bad, **{"kv.bin": bytes(kv)})
    elif damage == "deflate":
        data = bytearray(path.read_bytes())
        info = zipfile.ZipFile(path).getinfo("kv.bin")
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + 10: start + 200] = bytes(190)  # the compressed stream itself
        bad.write_bytes(bytes(data))
    elif damage == "json_field":
        rewrite(path, bad, **{"session.json": json.dumps({**meta, "tokens": [1, "two"]}).encode()})
    elif damage == "json_type":
        meta["messages"][0]["name"] = ["not", "a", "string"]
        rewrite(path, bad, **{"session.json": json.dumps(meta).encode()})
    elif damage == "policy":
        rewrite(path, bad, **{"session.json": json.dumps({**meta, "policy": "sink-48"}).encode()})
    elif damage == "truncated":
        bad.write_bytes(path.read_bytes()[:-100])
    else:
        bad.write_bytes(b"")
    with pytest.raises(ValueError, match="bad.session"):
        s.load(bad)
    assert what_it_holds(s) == before
    talk(s, "the conversation goes on")  # and the object stays usable


def test_a_refused_snapshot_keeps_the_token_shown_last(saved, tmp_path):
    s, path = saved
    assert s.llm.pending, "the last answer ended with a token shown but not fed"
    before = what_it_holds(s)
    bad = rewrite(path, tmp_path / "bad.session", **{"kv.bin": damaged_kv(zipfile.ZipFile(path).read("kv.bin"))})
    with pytest.raises(ValueError):
        s.load(bad)
    assert what_it_holds(s) == before


def test_a_zip_bomb_is_refused_before_it_is_inflated(saved, tmp_path):
    s, _ = saved
    bomb = tmp_path / "bomb.session"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("session.json", "{}")
        with z.open("kv.bin", "w", force_zip64=True) as f:
            zeros = bytes(2**24)
            for _ in range(64):  # 1 GiB of zeros, about 1 MiB on disk
                f.write(zeros)
    assert bomb.stat().st_size < 4 * 2**20
    with pytest.raises(ValueError, match="declares"):
        s.load(bomb)


def test_a_save_that_fails_half_way_keeps_the_previous_file(saved, monkeypatch):
    s, path = saved
    good = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        s.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".part")] == []


def test_closing_an_old_stream_after_a_newer_turn_keeps_the_newer_history(chat_model):
    s = new_session(chat_model)
    old = s.send("first question")
    next(old)
    for _ in s.send("second question"):
        pass
    newer = what_it_holds(s)
    old.close()
    assert what_it_holds(s) == newer
    assert s.messages[-2]["content"] == "second question"


def test_text_that_is_not_unicode_is_a_value_error(chat_model):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # how a Latin-1 byte arrives in sys.argv
    llm = Llama(chat_model, policy="h2o", budget=48, n_threads=1)
    with pytest.raises(ValueError, match="lone surrogate"):
        ChatSession(llm, system=bad)
    s = ChatSession(llm, max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="lone surrogate"):
        talk(s, bad)
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.tokenize(bad)
    assert talk(s, "fine") is not None


def test_a_bad_system_byte_in_the_cli_is_one_line(chat_model, capsys):
    from h2o_local.cli import main

    with pytest.raises(SystemExit) as e:
        main(["chat", "--model", chat_model, "--system", b"caf\xe9".decode("utf-8", "surrogateescape")])
    assert e.value.code == 2
    assert "lone surrogate" in capsys.readouterr().err


def test_bad_sampling_values_are_refused_when_the_session_is_made(chat_model):
    """Not at every answer (the chat CLI once printed the same error after each message, with an empty answer)."""
    llm = Llama(chat_model, budget=48, n_threads=1, policy="h2o")
    for kwargs, error in (({"max_tokens": "8"}, TypeError), ({"temperature": float("nan")}, ValueError),
                          ({"top_p": 0}, ValueError), ({"colour": "red"}, TypeError)):
        with pytest.raises(error):
            ChatSession(llm, **kwargs)
    assert talk(ChatSession(llm, max_tokens=4, temperature=0), "hi") is not None


def test_a_session_recalls_by_default_where_its_policy_can(chat_model):
    """As `h2o-local chat`: a script's chat keeps what its cache evicts in host memory for its next questions."""
    llm = Llama(chat_model, budget=48, n_threads=1, keep="system")  # the library's own default: recall off
    s = ChatSession(llm, max_tokens=4, temperature=0)
    talk(s, "a message long enough to evict part of the conversation " * 3)
    assert s.recall and s.stats()["host_entries"] == s.stats()["evicted"] > 0
    off = ChatSession(Llama(chat_model, budget=48, n_threads=1), recall=False, max_tokens=4, temperature=0)
    talk(off, "a message long enough to evict part of the conversation " * 3)
    assert not off.recall and "host_entries" not in off.stats() and off.llm.kv_state().host_bytes == 0
    per_head = ChatSession(Llama(chat_model, policy="h2o-48+ph", n_threads=1), max_tokens=4)
    assert not per_head.recall  # a policy that cannot recall: "auto" leaves it off
    with pytest.raises(ValueError):
        ChatSession(Llama(chat_model, policy="h2o-48+ph", n_threads=1), recall=True)
    with pytest.raises(ValueError, match="recall must be 'auto'"):
        ChatSession(llm, recall="yes")
    assert not ChatSession(Llama(chat_model, n_ctx=256, n_threads=1)).recall  # the full cache evicts nothing


def test_a_turns_speed_leaves_the_prompt_out():
    """The answer's tokens/s is its decoding speed (llama.cpp's "eval" rate): the tokens after the first over the time
    after the first; the time to the first token (the prompt read) is its own figure."""
    from h2o_local.chat_session import TurnStats
    assert TurnStats(completion_tokens=11, seconds=3.0, first_token_seconds=1.0).tokens_per_second == 5.0
    assert TurnStats(completion_tokens=1, seconds=3.0, first_token_seconds=3.0).tokens_per_second == 0.0


def test_a_sessions_stats_give_the_time_to_the_first_token(chat_model):
    s = ChatSession(Llama(chat_model, budget=48, n_threads=1, policy="h2o"), max_tokens=6, temperature=0)
    talk(s, "hello")
    stats = s.stats()
    assert 0 < s.last.first_token_seconds <= s.last.seconds and stats["completion_tokens"] == 6
    assert stats["first_token_seconds"] == round(s.last.first_token_seconds, 2)
    assert stats["tokens_per_second"] == round(5 / (s.last.seconds - s.last.first_token_seconds), 1)
