"""The real chat templates that the pinned llama.cpp tests itself with (models/templates/*.jinja in the sdist
the build fetched): Jinja from 70 model families, as their GGUFs carry it."""
import functools
import importlib.util
import os
import tarfile
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]


def _prepare():
    spec = importlib.util.spec_from_file_location("h2o_vendor_prepare", ROOT / "vendor" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def pinned_templates() -> Dict[str, str]:
    """{file name without .jinja: source}; empty when the sdist is not on this machine (a build elsewhere)."""
    prepare = _prepare()
    sdist = Path(os.environ.get("H2O_LOCAL_LLAMA_SDIST") or prepare.cache_dir() / "sdist" / prepare.SDIST_NAME)
    if not sdist.is_file():
        return {}
    prefix = prepare.TREE_PREFIX + "models/templates/"
    out = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(prefix) and member.name.endswith(".jinja"):
                out[member.name[len(prefix):-len(".jinja")]] = tar.extractfile(member).read().decode("utf-8")
    return out
