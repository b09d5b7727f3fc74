"""The docs' code is the code: docs/policies.md's contract and worked example compile against cpp/policy.h."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_INCLUDE = ROOT / "vendor" / "llama.cpp" / "include"  # prepared by the build (vendor/prepare.py)


@pytest.mark.skipif(shutil.which("c++") is None or not LLAMA_INCLUDE.is_dir(),
                    reason="optional: needs a C++ compiler and the llama.cpp tree the build prepares")
def test_the_worked_example_in_docs_policies_compiles_against_policy_h(tmp_path):
    blocks = re.findall(r"```cpp\n(.*?)```", (ROOT / "docs" / "policies.md").read_text(), flags=re.S)
    example = next(b for b in blocks if "PolicyRegistration reg(" in b)
    src = tmp_path / "example.cpp"
    src.write_text(example)
    out = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'cpp'}", f"-I{LLAMA_INCLUDE}",
                          f"-I{ROOT / 'vendor' / 'llama.cpp' / 'ggml' / 'include'}", str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_readme_keyword_table_names_every_llama_keyword_with_its_default():
    """README's "Keyword arguments of `Llama(model_path, ...)`" table: each public keyword once, with the default the
    signature has (a keyword added without its row, or a default changed without the docs, fails here)."""
    import ast
    import inspect

    from h2o_local import Llama

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("Keyword arguments of `Llama(model_path, ...)`:", 1)[1].split("\n\n", 2)[1]
    documented = {}
    for row in table.splitlines()[2:]:
        names, defaults = (re.findall(r"`([^`]*)`", cell) for cell in row.split("|")[1:3])
        assert len(names) == len(defaults), row
        for name, default in zip(names, defaults):
            assert name not in documented, f"{name} has two rows"
            documented[name] = ast.literal_eval(default)
    params = {name: p.default for name, p in inspect.signature(Llama.__init__).parameters.items()
              if name not in ("self", "model_path") and not name.startswith("_")}
    assert sorted(documented) == sorted(params)
    assert documented == params


def test_the_policy_options_table_names_every_option_with_its_suffix_and_unset_value():
    """docs/policies.md's options table: one row per row of cpp/policy_config.cpp's policy_options()."""
    from h2o_local.policies import OPTIONS

    text = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    table = text.split("| option | label | not given | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for row in table.strip().splitlines()[1:]:
        name, label, unset = (cell.strip().strip("`") for cell in row.split("|")[1:4])
        rows[name] = (label, int(unset))
    assert sorted(rows) == sorted(o["name"] for o in OPTIONS)
    for o in OPTIONS:
        label, unset = rows[o["name"]]
        assert unset == o["unset"], o["name"]
        suffix = "\\+" + o["suffix"] + ("" if o["flag"] else "[0-9]+")
        assert re.fullmatch(suffix, label), (o["name"], label)
