"""The command line takes llama.cpp's spellings (llama-cli's and llama-server's) of the settings it shares with them,
so that a command written for llama.cpp runs here as it is."""
import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from h2o_local.cli.common import add_model_args


def test_llama_cpp_s_short_flags_name_the_same_settings_as_the_long_ones():
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    short = ap.parse_args("-m x.gguf -t 3 -ngl 0 -fa on -ctk q8_0 -ctv q8_0 -b 64 -s 7".split())
    long = ap.parse_args("--model x.gguf --threads 3 --n-gpu-layers 0 --flash-attn on --cache-type-k q8_0 "
                         "--cache-type-v q8_0 --n-batch 64 --seed 7".split())
    assert vars(short) == vars(long) != vars(ap.parse_args([]))
    other = ap.parse_args(["--gpu-layers", "5", "--batch-size", "32", "-fa"])
    assert (other.n_gpu_layers, other.n_batch, other.flash_attn) == (5, 32, "on")


def test_llama_server_s_parallel_is_the_number_of_slots(capsys):
    from h2o_local.cli import main

    for flag in ("-np", "--parallel"):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, "0"])  # checked as --slots is, before anything loads
        assert e.value.code == 2 and "--slots" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"generate": "generate", "chat": "chat", "serve": "serve", "inspect": "inspect_kv", "rpc-server": "rpc_server"}


def _parser(command):
    return importlib.import_module(f"h2o_local.cli.{COMMANDS[command]}").parser()


def _readme_flag_rows():
    """README's "llama.cpp and Ollama flags" table: (llama.cpp's form, ours or "refused: reason", commands)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("| llama.cpp / Ollama | h2o-local | commands |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for row in table.strip().splitlines()[1:]:
        theirs, ours, commands = (cell.strip() for cell in row.split("|")[1:4])
        commands = list(COMMANDS) if commands == "every command" else [c.strip() for c in commands.split(",")]
        ours = ours if ours.startswith("refused:") else re.search(r"`([^`]*)`", ours).group(1)
        rows.append(pytest.param(shlex.split(theirs.strip("`")), ours, commands, id=theirs.strip("`")))
    assert len(rows) >= 20
    return rows


@pytest.mark.parametrize("theirs, ours, commands", _readme_flag_rows())
def test_every_flag_in_the_readme_table_parses_as_the_table_says(theirs, ours, commands, capsys):
    from h2o_local.cli import main

    for command in commands:
        prefix = [] if command == "generate" else [command]
        if ours.startswith("refused:"):
            with pytest.raises(SystemExit) as e:  # refused before any model loads
                main(prefix + theirs + (["inspected text"] if command == "inspect" else []))
            err = capsys.readouterr().err
            assert e.value.code == 2 and ours.removeprefix("refused:").strip() in err, (command, err)
            assert theirs[0] in err and len(err.strip().splitlines()) == 1
        elif theirs == ["--version"]:
            with pytest.raises(SystemExit) as e:
                main(prefix + theirs)
            out = capsys.readouterr().out
            assert e.value.code == 0 and out.startswith(_parser(command).prog + " ") and "llama.cpp" in out
        else:
            positional = ["inspected text"] if command == "inspect" else []
            ap = _parser(command)
            parsed, expected = ap.parse_args(theirs + positional), ap.parse_args(shlex.split(ours) + positional)
            assert vars(parsed) == vars(expected) != vars(ap.parse_args(positional)) or theirs == shlex.split(ours)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_flag_is_taken_for_a_longer_one_and_an_error_is_one_line(command, capsys):
    """argparse's prefix matching turned `-n 8` into `-ngl 8` and `-f x` into `-fa x`; `-sys X` into `-s ys`."""
    ap = _parser(command)
    spelled = set(ap.flags())
    tried = 0
    for flag in sorted(spelled):
        for cut in range(2, len(flag)):
            prefix = flag[:cut]
            if prefix in spelled or prefix in ("-", "--"):
                continue
            tried += 1
            with pytest.raises(SystemExit) as e:
                ap.parse_args([prefix, "1"] + (["text"] if command == "inspect" else []))
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1 and f"see {ap.prog} --help" in err, (prefix, err)
    assert tried > 10
