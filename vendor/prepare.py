#!/usr/bin/env python3
"""Prepare the patched llama.cpp tree that h2o_local builds against.

llama.cpp is a pinned dependency, not our code: the tree comes from the PyPI sdist of llama-cpp-python (fetched by
name with pip), is checked against a recorded sha256, pruned to what the build needs, and patched with the series in
vendor/patches/ (applied in file-name order).

    python vendor/prepare.py --out vendor/llama.cpp        # what the CMake build runs
    python vendor/prepare.py --out /some/dir                 # prepare a tree for an offline machine

Environment:
    H2O_LOCAL_LLAMA_SDIST   path to llama_cpp_python-<version>.tar.gz already downloaded (offline builds)
    H2O_LOCAL_CACHE         cache folder (default: ~/.cache/h2o_local); the sdist is kept there
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
TREE_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# what the library build needs; the rest of the 176 MB tree (tools, tests, models' conversion scripts) is dropped
# llama-cpp-python's JSON-schema-to-GBNF converter (stdlib only), installed as h2o_local/_llama_grammar.py: the
# grammar text goes to the pinned llama.cpp's own grammar sampler
GRAMMAR_MODULE = (f"llama_cpp_python-{VERSION}/llama_cpp/llama_grammar.py", "python/llama_grammar.py")
TREE_LAYOUT = "2"  # bumped when what the prepared tree holds changes (2: the grammar module)
KEEP = ("CMakeLists.txt", "LICENSE", "licenses/", "cmake/", "ggml/", "include/", "src/", "vendor/", "common/build-info.cpp.in")

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"


def log(msg: str) -> None:
    print(f"[h2o_local prepare] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("H2O_LOCAL_CACHE") or Path.home() / ".cache" / "h2o_local")


def fetch_sdist() -> Path:
    """Return a verified sdist: from H2O_LOCAL_LLAMA_SDIST, the cache, or pip download by name."""
    given = os.environ.get("H2O_LOCAL_LLAMA_SDIST")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"H2O_LOCAL_LLAMA_SDIST={given} is not a file")
    else:
        dest = cache_dir() / "sdist"
        path = dest / SDIST_NAME
        if not path.is_file():
            dest.mkdir(parents=True, exist_ok=True)
            log(f"downloading {PACKAGE}=={VERSION} (sdist, 77 MB) with pip for its llama.cpp tree ...")
            # metadata of the sdist is prepared without isolation so that pip does not build cmake/ninja from source
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                   "--no-binary", PACKAGE, f"{PACKAGE}=={VERSION}", "-d", str(dest)]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
    digest = sha256_of(path)
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} does not match the pinned {SDIST_SHA256}")
    return path


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def stamp_text() -> str:
    h = hashlib.sha256((SDIST_SHA256 + TREE_LAYOUT).encode())
    for p in patch_files():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return f"{LLAMA_CPP_COMMIT} {h.hexdigest()}\n"


def extract(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(TREE_PREFIX):
                continue
            rel = m.name[len(TREE_PREFIX):]
            if not rel.startswith(KEEP) or not (m.isfile() or m.isdir()):
                continue
            m.name = rel
            members.append(m)
        tar.extractall(out, members=members, filter="data")
        source, dest = GRAMMAR_MODULE
        (out / dest).parent.mkdir(parents=True, exist_ok=True)
        (out / dest).write_bytes(tar.extractfile(source).read())


def apply_patches(tree: Path) -> None:
    for p in patch_files():
        log(f"applying {p.name}")
        if shutil.which("git"):
            cmd = ["git", "apply", "--whitespace=nowarn", str(p)]
        else:
            cmd = ["patch", "-p1", "--forward", "-i", str(p)]
        # outside any repository: inside one, git apply skips paths silently
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
        subprocess.run(cmd, cwd=tree, check=True, env=env)
    if patch_files() and not (tree / "include" / "llama-attn-scores.h").is_file():
        raise SystemExit("the patch series did not apply")


def prepare(out: Path) -> None:
    stamp = out / ".h2o_local_stamp"
    want = stamp_text()
    if stamp.is_file() and stamp.read_text() == want and (out / "include" / "llama-attn-scores.h").is_file() and \
            (out / GRAMMAR_MODULE[1]).is_file():
        return
    sdist = fetch_sdist()
    log(f"extracting llama.cpp {LLAMA_CPP_COMMIT[:10]} into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=out.parent))
    try:
        extract(sdist, tmp)
        apply_patches(tmp)
        (tmp / ".h2o_local_stamp").write_text(want)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "llama.cpp", help="where to write the patched tree")
    args = ap.parse_args()
    prepare(args.out.resolve())


if __name__ == "__main__":
    main()
