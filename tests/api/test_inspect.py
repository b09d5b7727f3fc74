"""`h2o-local inspect`: per-token kept / evicted and scores, as HTML and PNG."""
import re

import pytest

from h2o_local.cli import main
from h2o_local.inspector import inspect_text, to_html

TEXT = "Heavy hitters are the few tokens that receive most of the attention in a long sequence of text."


def test_each_policy_reports_what_its_cache_holds(tiny_model):
    ins = inspect_text(tiny_model, TEXT, ["h2o-16", "sink-16"], max_tokens=5)
    for i in ins:
        assert i.kept.sum() == 16 and i.n_evicted == i.n_tokens - 16 and len(i.pieces) == i.n_tokens
        assert i.kept[-1]  # the newest token
    assert ins[1].kept[:4].all() and ins[1].kept[-12:].all() and not ins[1].kept[4:-12].any()  # sink: 4 + 12
    page = to_html(ins)
    assert page.count("class='k'") == 2 * 16 + 5  # kept tokens, plus the legend's five swatches
    assert page.count("class='e'") == sum(i.n_evicted for i in ins) + 1  # evicted tokens, plus the legend's


def test_the_command_writes_html_and_png(tiny_model, tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text(TEXT)
    html, png = tmp_path / "k.html", tmp_path / "k.png"
    assert main(["inspect", str(text), "--model", tiny_model, "--policies", "h2o-16", "tova-16",
                 "--html", str(html), "--png", str(png)]) == 0
    assert re.search(r"h2o-16: kept 16 of \d+ tokens", capsys.readouterr().out)
    assert html.read_text().startswith("<!doctype html>") and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line(tiny_model, capsys):
    for args in (["", "--model", tiny_model], ["x", "--model", tiny_model, "--policies", "h2o"]):
        with pytest.raises(SystemExit) as e:
            main(["inspect", *args])
        assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_misspelt_file_name_is_an_error_not_the_text_to_inspect(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path / "artcle.txt"), "--model", tiny_model, "--html", str(tmp_path / "k.html")])
    assert e.value.code == 2
    assert "artcle.txt: no such file" in capsys.readouterr().err
    assert not (tmp_path / "k.html").exists()


def test_an_unwritable_png_is_one_error_line_after_the_html(tiny_model, tmp_path, capsys):
    html = tmp_path / "k.html"
    code = main(["inspect", TEXT, "--model", tiny_model, "--policies", "h2o-16", "--html", str(html),
                 "--png", str(tmp_path / "no-such-folder" / "k.png")])
    err = capsys.readouterr().err
    assert code == 1 and html.is_file()
    assert "error: no PNG" in err and "Traceback" not in err


def test_a_per_head_policy_shows_how_many_heads_hold_each_token(tiny_model):
    (ins,) = inspect_text(tiny_model, TEXT, ["h2o-16+ph"], max_tokens=3)
    # 2 layers x 2 KV heads, 16 entries each: a token is kept when one of them holds it
    assert ins.head_share is not None and ins.head_share.sum() == pytest.approx(16)
    assert 16 <= ins.kept.sum() <= 4 * 16 and ins.kept[-1] and ins.head_share[-1] == 1.0
    assert 0 < ins.head_share[ins.kept].min() < 1  # some tokens are held by some heads only
    assert "of the layers' KV heads" in to_html([ins])


def test_with_recall_the_evicted_tokens_wait_in_host_memory_and_a_question_brings_some_back(tiny_model, capsys):
    label = "tova-16+s4+q8+p4+f4+r4"  # the default's fields: the question probe that recall needs
    # the tiny model's text is short of its trained context (128 tokens, the store's cap): nothing is dropped
    before = inspect_text(tiny_model, TEXT, [label], recall=True)[0]
    assert before.in_host is not None and before.in_host.sum() == before.n_evicted
    assert not (before.in_host & before.kept).any()
    after = inspect_text(tiny_model, TEXT, [label], recall=True, question=" what is heavy?")[0]
    assert after.n_tokens > before.n_tokens and after.kept.sum() == 16
    assert after.in_host.sum() + after.kept.sum() == after.n_tokens  # every token is on the device or in host memory
    page = to_html([after])
    assert page.count("class='h'") == int(after.in_host.sum()) + 1  # host entries, plus the legend's
    assert main(["inspect", TEXT, "--model", tiny_model, "--policies", label, "--recall", "--question",
                 " what?", "--html", "/dev/null", "--png", ""]) == 0
    assert re.search(r"kept 16 of \d+ tokens, evicted \d+, \d+ in host memory", capsys.readouterr().out)
    assert inspect_text(tiny_model, TEXT, ["h2o-16"])[0].in_host is None  # without recall: evicted is gone


def test_long_work_shows_its_progress_on_a_terminal_and_nothing_when_piped(tiny_model, tmp_path):
    """`generate` and `inspect` draw the prompt bar that `chat` draws, on a terminal only."""
    import subprocess
    import sys

    import pexpect

    text = tmp_path / "long.txt"
    text.write_text("The keeper counts the ships. " * 40)
    inspect = ["-m", "h2o_local", "inspect", str(text), "-m", tiny_model, "--policies", "h2o-16", "-t", "1",
               "--html", str(tmp_path / "k.html"), "--png", ""]
    generate = ["-m", "h2o_local", "-m", tiny_model, "-f", str(text), "--no-chat", "-n", "2", "-b", "16", "-t", "1"]
    for argv, shown in ((inspect, r"reading the text with h2o-16\S*: \d+/\d+ tokens"),
                        (generate, r"reading the prompt: \d+/\d+ tokens")):
        child = pexpect.spawn(sys.executable, argv, env={"TERM": "dumb", "PATH": "/usr/bin:/bin"}, encoding="utf-8",
                              timeout=60)
        child.expect(shown)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
        piped = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert piped.returncode == 0 and "reading" not in piped.stderr, piped.stderr
