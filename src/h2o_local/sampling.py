"""Sampling parameters: one value shared by generate, create_completion, create_chat_completion and
generate_batch (each call's keyword arguments are applied on top of that entry point's defaults)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from . import _engine
from .policies import check_int


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn, and when generation ends.

    max_tokens: tokens generated at most (None: until an end-of-generation token, a stop string or, for the full
        cache, the end of the context).
    temperature: <= 0 is greedy; top_k (0: off), top_p (1: off), min_p (0: off) cut the candidates first.
    stop: strings that end the text (cut before them).
    seed: the draw's seed; None takes the next one from the Llama's own generator.
    ignore_eos: never sample an end-of-generation token (every sequence runs to max_tokens; benchmarks).
    """

    max_tokens: Optional[int] = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    stop: Union[str, Sequence[str], None] = ()
    seed: Optional[int] = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 0:
                raise ValueError("max_tokens must be >= 0 (or None: until the end of the text or the context)")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 < self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] and min_p in [0, 1], got {self.top_p} and {self.min_p}")
        check_int("top_k", self.top_k, minimum=0, maximum=None)  # at least the vocabulary: off
        check_int("seed", self.seed, maximum=None)  # any int: the sampler takes its low 32 bits
        stop = self.stop
        stops: Tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stops if s))
        if self.ignore_eos and self.max_tokens is None:
            raise ValueError("ignore_eos=True needs max_tokens")

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied (unknown names raise TypeError)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)} (expected: {', '.join(sorted(names))})")
        return dataclasses.replace(self, **changes)

    def sampler(self, n_vocab: int, seed: int, banned: Sequence[int] = ()) -> "_engine.Sampler":
        """The C++ sampler chain for these parameters, seeded with `seed` (32 bits)."""
        return _engine.Sampler(n_vocab, temperature=float(self.temperature), top_p=float(self.top_p),
                               top_k=min(int(self.top_k), n_vocab), min_p=float(self.min_p), seed=int(seed) & 0xFFFFFFFF,
                               banned=list(banned))


# the defaults of each entry point, as llama-cpp-python has them
GENERATE = SamplingParams()
COMPLETION = SamplingParams(max_tokens=16)
CHAT = SamplingParams(max_tokens=None, temperature=0.2)
