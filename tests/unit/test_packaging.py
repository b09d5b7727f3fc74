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
