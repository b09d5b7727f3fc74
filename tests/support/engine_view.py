"""The one place where tests read below `Llama`'s public surface: its C++ engine (`h2o_local._engine.Engine`).

Tests check what `Llama` reports (kept positions, scores, host entries) against llama.cpp's own view of a sequence
(its position range, the bytes of its cells, its cached keys, the host store's rows) and against the engine's
counters (decodes made, KV bytes, probe cells); a user never needs these, a test of the bookkeeping does.
"""
from __future__ import annotations

from typing import Any


def engine(llm: Any) -> Any:
    """The `Llama`'s engine (h2o_local._engine.Engine): every call on it holds the engine's own lock."""
    return llm._engine
