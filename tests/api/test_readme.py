"""README.md's commands are the product's: every `h2o-local` line it shows parses as written, and its first-run
commands and Python quick start run (on a tiny model standing in for model.gguf), so that the README cannot go stale."""
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODULES = {"chat": "chat", "serve": "serve", "inspect": "inspect_kv", "rpc-server": "rpc_server"}


def _section(title):
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _commands(text):
    """Each `h2o-local ...` or `python -m h2o_local ...` command in the text's bash blocks, as its argv."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["h2o-local"]:
                    found.append(words[1:])
                elif words[:3] == ["python", "-m", "h2o_local"]:
                    found.append(words[3:])
    return found


def _parser(argv):
    import importlib

    command = argv[0] if argv and argv[0] in MODULES else None
    module = importlib.import_module(f"h2o_local.cli.{MODULES.get(command, 'generate')}")
    return module.parser(), argv[1:] if command else argv


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("readme") / "model.gguf", chat_template=CHATML,
                                n_ctx_train=4096))


def test_every_command_the_readme_shows_parses_as_written():
    commands = _commands(README)
    assert len(commands) >= 8
    for argv in commands:
        ap, rest = _parser(argv)
        ap.parse_args(rest)  # an unknown or misspelt flag exits 2 here, naming it


def test_the_first_run_commands_run(model, monkeypatch, capsys):
    from h2o_local.cli import main

    commands = [c for c in _commands(_section("Install and first run")) if c and c[0] != "serve"]
    assert len(commands) == 2  # chat, and one answer (serve is started by the server tests)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # the chat sees the end of its input and leaves
    for argv in commands:
        argv = [model if a == "model.gguf" else a for a in argv] + ["--threads", "1"]
        assert main(argv) == 0, argv
    err = capsys.readouterr().err
    assert "h2o_local chat:" in err and "prompt=" in err and "Traceback" not in err


def test_the_python_quick_start_runs(model, capsys):
    block = re.findall(r"```python\n(.*?)```", _section("Install and first run"), flags=re.S)[0]
    exec(compile(block.replace('"model.gguf"', repr(model)), "README quick start", "exec"), {})
    assert capsys.readouterr().out.strip()  # the answer was printed
