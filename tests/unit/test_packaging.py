"""The extension carries its own patched llama.cpp without exposing it: no clash with llama-cpp-python."""
import shutil
import subprocess
import sys

import pytest

import h2o_local._engine as engine


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None, reason="optional: needs nm on Linux")
def test_extension_exports_no_llama_or_ggml_symbols():
    out = subprocess.run(["nm", "-D", "--defined-only", engine.__file__], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    assert "PyInit__engine" in names
    assert [n for n in names if n.startswith(("llama_", "ggml_", "gguf_"))] == []
    # and it needs no libllama / libggml shared library that another package could have loaded first
    deps = subprocess.run(["ldd", engine.__file__], capture_output=True, text=True).stdout
    assert "libllama" not in deps and "libggml" not in deps


def stub_names(tree):
    """The stub's public names: module level, and each class's, as {name: set of members}."""
    import ast

    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id != "__all__":
            names[node.target.id] = set()
    return names


def test_the_extension_stub_names_what_the_extension_has():
    """src/h2o_local/_engine.pyi (for editors and type checkers, beside py.typed) lists every public class,
    function and constant of the extension, and each class's methods and properties, and nothing else. After a
    binding changes: `pybind11-stubgen h2o_local._engine -o src` (pip install pybind11-stubgen)."""
    import ast
    import inspect
    from pathlib import Path

    package = Path(engine.__file__).resolve().parent
    src = Path(__file__).resolve().parents[2] / "src" / "h2o_local"
    assert (src / "py.typed").exists()
    stub = stub_names(ast.parse((src / "_engine.pyi").read_text(encoding="utf-8")))
    actual = {}
    for name, value in vars(engine).items():
        if name.startswith("_"):
            continue
        members = set()
        if inspect.isclass(value):
            own = set(vars(value)) - {"__module__", "__doc__", "__dict__", "__weakref__"}
            members = {m for m in own if not m.startswith("_")}
        actual[name] = members
    assert set(stub) == set(actual), "the stub is not the extension's (regenerate it)"
    for name, members in actual.items():
        missing = members - stub[name]
        assert not missing, f"{name}: {sorted(missing)} not in the stub (regenerate it)"
    assert package.name == "h2o_local"
