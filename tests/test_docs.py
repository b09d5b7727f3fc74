"""The docs' code is the code: docs/policies.md's contract and worked example compile against cpp/policy.h."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
