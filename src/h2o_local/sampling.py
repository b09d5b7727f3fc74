"""Sampling parameters: one value shared by generate, create_completion, create_chat_completion and
generate_batch (each call's keyword arguments are applied on top of that entry point's defaults)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from . import _engine
from .grammar import DEFAULT_LIMITS, GrammarLimits, check_grammar, work_exceeded
from .policies import check_int


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn, and when generation ends.

    max_tokens: tokens generated at most (None, or a negative number as llama-cpp-python's -1: until an
        end-of-generation token, a stop string or, for the full cache, the end of the context; a bounded cache,
        which never fills up, stops after the model's trained context, `n_ctx_train` tokens).
    temperature: <= 0 is greedy; top_k (0: off), typical_p (1: off), top_p (1: off), min_p (0: off) cut the
        candidates first.
    mirostat_mode (0: off; 1 or 2: Mirostat's versions), mirostat_tau (the surprise it steers to), mirostat_eta (its
        learning rate): llama.cpp's Mirostat draw after the temperature, in place of top_k, typical_p, top_p, min_p.
    stop: strings that end the text (cut before them).
    seed: the draw's seed; None takes the next one from the Llama's own generator.
    ignore_eos: never sample an end-of-generation token (every sequence runs to max_tokens; benchmarks).
    repeat_penalty (1: off), frequency_penalty, presence_penalty (0: off): llama.cpp's penalties on the tokens among
        the last penalty_last_n (the prompt's, then the generated ones): a positive logit divided by repeat_penalty
        (a negative one multiplied), minus frequency_penalty times the count, minus presence_penalty once.
    logit_bias: {token id: bias} added to the logits before anything else (-inf: never).
    grammar: GBNF text (llama.cpp's grammar format, rule `root`) the output must follow; `h2o_local.grammar` has
        JSON and JSON-schema grammars. A grammar that does not parse raises ValueError.
    grammar_limits: how large the grammar may be (`h2o_local.grammar.GrammarLimits`: bytes, rules, alternatives,
        repetitions; a larger one raises ValueError before any work is done on it) and how much work one step of it
        may take (GrammarTooLarge when the sampler is made; a generation whose grammar needs more later ends with
        `_engine.GrammarWorkExceeded`, a ValueError).
    preserved_tokens: special tokens whose text the answer shows, where it would not (control tokens; llama-server's
        name): a chat sets the tags of its tool-call format and think tags (`Llama.preserved_tokens`).
    """

    max_tokens: Optional[int] = 128
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    stop: Union[str, Sequence[str], None] = ()
    seed: Optional[int] = None
    ignore_eos: bool = False
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Optional[Mapping[int, float]] = None
    grammar: Optional[str] = None
    grammar_limits: GrammarLimits = DEFAULT_LIMITS
    typical_p: float = 1.0
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    preserved_tokens: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 0:  # llama-cpp-python's -1: no limit
                object.__setattr__(self, "max_tokens", None)
        for name in ("temperature", "top_p", "min_p", "typical_p", "mirostat_tau", "mirostat_eta", "repeat_penalty",
                     "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 < self.top_p <= 1.0 or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] and min_p in [0, 1], got {self.top_p} and {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1] (1: off), got {self.typical_p}")
        check_int("mirostat_mode", self.mirostat_mode)
        if self.mirostat_mode not in (0, 1, 2):
            raise ValueError(f"mirostat_mode must be 0 (off), 1 or 2, got {self.mirostat_mode}")
        if self.mirostat_tau <= 0 or self.mirostat_eta <= 0:
            raise ValueError(f"mirostat_tau and mirostat_eta must be > 0, got {self.mirostat_tau} and "
                             f"{self.mirostat_eta}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1: off), got {self.repeat_penalty}")
        check_int("penalty_last_n", self.penalty_last_n, minimum=0)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise TypeError(f"grammar must be GBNF text (a str), got {type(self.grammar).__name__}")
        if not isinstance(self.grammar_limits, GrammarLimits):
            raise TypeError(f"grammar_limits must be a GrammarLimits, got {type(self.grammar_limits).__name__}")
        if self.grammar:
            check_grammar(self.grammar, self.grammar_limits)
        check_int("top_k", self.top_k, minimum=0, maximum=None)  # at least the vocabulary: off
        check_int("seed", self.seed, maximum=None)  # any int: the sampler takes its low 32 bits
        stop = self.stop
        is_sequence = stop is None or isinstance(stop, (str, Sequence))
        stops: Tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ()) if is_sequence else ()
        if not is_sequence or not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stops if s))
        if self.ignore_eos and self.max_tokens is None:
            raise ValueError("ignore_eos=True needs max_tokens")
        preserved = tuple(self.preserved_tokens or ())
        for t in preserved:
            check_int("preserved_tokens", t, minimum=0, maximum=None)
        object.__setattr__(self, "preserved_tokens", preserved)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied (unknown names raise TypeError)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)} (expected: {', '.join(sorted(names))})")
        return dataclasses.replace(self, **changes)

    def sampler(self, n_vocab: int, seed: int, banned: Sequence[int] = (), history: Sequence[int] = (),
                engine: Optional["_engine.Engine"] = None,
                grammar_of: Optional["_engine.Sampler"] = None) -> "_engine.Sampler":
        """The C++ sampler chain for these parameters, seeded with `seed` (32 bits); `history`: the prompt's tokens,
        whose last penalty_last_n the penalties count. A token id outside the vocabulary raises ValueError, as does a
        grammar that allows no token at its start (`_engine.GrammarError`) or needs more work than its limits allow
        to start (`GrammarTooLarge`). The grammar is parsed and checked with the GIL released. `grammar_of`: a
        sampler of the same grammar (and engine) whose checked grammar is copied instead (no parse, no check)."""
        if grammar_of is not None and not self.grammar:
            raise ValueError("grammar_of is for a sampler with a grammar")
        try:
            return self._sampler(n_vocab, seed, banned, history, engine, grammar_of)
        except _engine.GrammarWorkExceeded:
            raise work_exceeded(self.grammar_limits) from None

    def _sampler(self, n_vocab: int, seed: int, banned: Sequence[int], history: Sequence[int],
                 engine: Optional["_engine.Engine"], grammar_of: Optional["_engine.Sampler"]) -> "_engine.Sampler":
        return _engine.Sampler(n_vocab, temperature=float(self.temperature), top_p=float(self.top_p),
                               top_k=min(int(self.top_k), n_vocab), min_p=float(self.min_p), seed=int(seed) & 0xFFFFFFFF,
                               banned=list(banned), logit_bias=dict(self.logit_bias or {}),
                               penalty_last_n=int(self.penalty_last_n), repeat_penalty=float(self.repeat_penalty),
                               frequency_penalty=float(self.frequency_penalty),
                               presence_penalty=float(self.presence_penalty),
                               history=list(history[-self.penalty_last_n:]) if self.penalty_last_n else [],
                               grammar=self.grammar or "", grammar_max_work=self.grammar_limits.max_work,
                               engine=engine, typical_p=float(self.typical_p), mirostat=int(self.mirostat_mode),
                               mirostat_tau=float(self.mirostat_tau), mirostat_eta=float(self.mirostat_eta),
                               grammar_of=grammar_of)


def _logit_bias(bias: Any) -> Optional[Dict[int, float]]:
    """{token id: bias} with int keys (OpenAI's JSON gives them as strings of digits) and number values."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must be a mapping of token ids to numbers, got {bias!r}")
    out: Dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit() and key.strip().isascii():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**31:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value == math.inf:
            raise ValueError(f"logit_bias of token {key} must be a number (or -inf), got {value!r}")
        out[key] = float(value)
    return out or None


# the defaults of each entry point, as llama-cpp-python has them
def merge(defaults: SamplingParams, given: Optional[SamplingParams], keywords: Dict[str, Any]) -> SamplingParams:
    """What a call samples with: `given` (else the call's `defaults`) with its sampling keywords on top."""
    base = defaults if given is None else given
    if not isinstance(base, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {base!r}")
    return base.replace(**keywords) if keywords else base


GENERATE = SamplingParams()
COMPLETION = SamplingParams(max_tokens=16)
CHAT = SamplingParams(max_tokens=None, temperature=0.2)
# what the chat surfaces (`h2o-local chat`, the server's /v1/chat/completions without sampling fields, its web page)
# start from: Ollama's defaults. On SmolLM2-135M, two-turn MT-Bench chats, 10 rows: llama-cpp-python's temperature
# 0.2 loops in 0.80 / 0.90 of first / second answers (a 6-token sequence 4+ times), 0.7 in 0.00 / 0.30, these
# settings in 0.00 / 0.00 with the fewest answers that run to max_tokens (results/quality/chat-sampling-smollm2.md)
CHAT_SURFACE = SamplingParams(max_tokens=None, temperature=0.8, top_p=0.9, repeat_penalty=1.1, penalty_last_n=64)
