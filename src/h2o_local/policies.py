"""Eviction policies as values: what a sequence's KV cache keeps once it holds more than its budget.

    from h2o_local import Llama
    from h2o_local.policies import H2O, Sink

    Llama(path, budget=128)                                # short form: H2O(budget=128)
    Llama(path, policy="sink", budget=64)                  # short form: Sink(budget=64)
    Llama(path, policy=H2O(heavy=32, recent=96, sinks=4))  # long form: budget = 4 + 32 + 96
    Llama(path, policy=SnapKV(budget=256))                 # another scorer, same split fields

Each class is the Python face of one C++ policy (cpp/policies/); validation, defaults and the budget split are
the C++ policy's own, so a value shows its resolved split (`H2O(budget=128).heavy == 64`). A `budget` is always
in KV entries (tokens) per sequence. How to add a policy: docs/policies.md.
"""
from __future__ import annotations


import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Type, Union

import numpy as np

from . import _engine

REGISTRY: Dict[str, Type["Policy"]] = {}
# the options of a scoring policy, declared once in C++ (cpp/policy_config.cpp: a PolicyConfig field and a row each):
# dicts of name, suffix (the label's), unset (what leaving it out means), minimum, maximum, unit, flag, help
OPTIONS: Tuple[Dict[str, Any], ...] = tuple(_engine.POLICY_OPTIONS)
OPTION_NAMES: Tuple[str, ...] = tuple(o["name"] for o in OPTIONS)
# the fields a policy value may give its C++ policy (PolicyConfig)
CONFIG_FIELDS = ("budget", "heavy", "recent", "sinks", "query_window", "probe", "question") + OPTION_NAMES
# what ranks a prompt besides the split; a name with none of them (nor the options) and no budget is the full cache
PROBE_FIELDS = ("query_window", "probe", "question")
# what a probe decodes after a piece of a prompt to rank it before eviction (cpp/policy.h ProbeSource)
PROBES = ("question", "repeat", "catalyst")
_FLAGS = frozenset(o["name"] for o in OPTIONS if o["flag"])


INT32_MAX = 2**31 - 1  # the C++ side takes 32-bit ints


def check_int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = INT32_MAX) -> None:
    """`value` must be None or an int (not a bool, not a float) in [`minimum`, `maximum`]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    if maximum is not None and value < -INT32_MAX - 1:
        raise ValueError(f"{name} must be >= {-INT32_MAX - 1}, got {value}")


def _config(name: str, fields: Dict[str, Any]) -> "_engine.PolicyConfig":
    """The C++ PolicyConfig of `name` with `fields` (None: not given; a flag as 1 or 0)."""
    cfg = _engine.PolicyConfig()
    cfg.name = name
    for key, value in fields.items():
        if value is not None:
            setattr(cfg, key, value if key == "probe" else int(value))
    return cfg


def _config_fields(cfg: "_engine.PolicyConfig") -> Dict[str, Any]:
    """The fields `cfg` gives (a flag as True or False), by name."""
    out: Dict[str, Any] = {}
    for key in CONFIG_FIELDS:
        value = getattr(cfg, key)
        if key == "probe":
            if value:
                out[key] = value
        elif value >= 0:
            out[key] = bool(value) if key in _FLAGS else value
    return out


def check_field(name: str, value: Any) -> None:
    """A policy field's type (and an int's sign); C++ checks what the numbers may be."""
    if name == "probe":
        check_probe(value)
    elif name in _FLAGS:
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True, False or None, got {value!r}")
    else:
        check_int(name, value, minimum=1 if name == "budget" else 0)


def check_per_head(per_head: Any) -> None:
    if per_head is not None and not isinstance(per_head, (bool, np.bool_)):
        raise TypeError(f"per_head must be True, False or None, got {per_head!r}")


def check_probe(probe: Any) -> None:
    if probe is not None and (not isinstance(probe, str) or probe not in PROBES):
        raise ValueError(f"probe must be one of {', '.join(PROBES)} (or None), got {probe!r}")


@dataclass(frozen=True)
class Policy:
    """Base of the policy values; subclasses declare their fields and their registered `name`."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name and not getattr(cls, "_in_python", False):  # the registry names the C++ policies
            REGISTRY[cls.name] = cls

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_field(f.name, getattr(self, f.name))
        self._adopt(_engine.Policy(_config(self.name, self._given())))

    def _adopt(self, cpp: "_engine.Policy") -> None:
        """Hold the resolved C++ policy and show its resolution (the split, the query window, the probe, the
        options: None where an option is left at its unset value) in the fields."""
        fields = self._field_names()
        resolved = {"sinks": cpp.sinks, "heavy": cpp.heavy, "recent": cpp.recent, "query_window": cpp.query_window,
                    "probe": cpp.probe or None, "question": cpp.question or None}
        for o in OPTIONS:
            value = cpp.option(o["name"])
            resolved[o["name"]] = None if value == o["unset"] else True if o["flag"] else value
        for key, value in resolved.items():
            if key in fields:
                object.__setattr__(self, key, value)
        object.__setattr__(self, "_cpp", cpp)

    @classmethod
    def _of(cls, cpp: "_engine.Policy", given: Dict[str, Any]) -> "Policy":
        """The value of an already resolved C++ policy (no second resolution)."""
        value = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(value, f.name, given.get(f.name, f.default))
        value._adopt(cpp)
        return value

    @classmethod
    def _field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def _given(self) -> Dict[str, Any]:
        """The PolicyConfig fields this value gives (not None)."""
        return {k: getattr(self, k) for k in CONFIG_FIELDS if getattr(self, k, None) is not None}

    @property
    def cpp(self) -> "_engine.Policy":
        """The resolved C++ policy this value stands for (what the engine runs)."""
        return self._cpp  # type: ignore[attr-defined]

    @property
    def bounded(self) -> bool:
        """True when the cache holds at most `budget` entries per sequence."""
        return bool(self.cpp.bounded)

    @property
    def needs_scores(self) -> bool:
        """True when the policy ranks entries by attention scores (the engine then exports them)."""
        return bool(self.cpp.needs_scores)

    @property
    def query_window(self) -> int:
        """Tokens at the end of a prompt that are decoded on their own to score it (0: none; tova 1, snapkv 16).
        Such a policy ranks a prompt by what it observed while the prompt was fed under it, so switching to it with
        `set_policy` + `compress` after a prompt was fed under another policy does not give its own ranking."""
        return int(self.cpp.query_window)

    @property
    def split(self) -> Tuple[int, int, int]:
        """(sinks, heavy, recent): entries kept per sequence by each rule."""
        return int(self.cpp.sinks), int(self.cpp.heavy), int(self.cpp.recent)

    @functools.cached_property
    def label(self) -> str:
        """A short name for reports, written by C++ (`policy_label`): "full", "local-256", "h2o-128", "h2o-128+s4",
        "tova-256+s4+r192" (a recent window other than the policy's default split), "tova-256+q32" / "+repeat" /
        "+catalyst" (a probe), then each option that is not at its unset value ("+p9", "+f12", "+b16", "+m50", "+ph";
        OPTIONS); `parse` reads it back."""
        return str(self.cpp.label)


@dataclass(frozen=True)
class Full(Policy):
    """The whole cache: never evicts. A prompt that does not fit raises ValueError; generation stops at the end of
    the context."""

    name: ClassVar[str] = "full"
    budget: ClassVar[Optional[int]] = None


@dataclass(frozen=True)
class Local(Policy):
    """The last `budget` tokens (a sliding window)."""

    name: ClassVar[str] = "local"
    budget: int


@dataclass(frozen=True)
class Sink(Policy):
    """StreamingLLM: the first `sinks` tokens (attention sinks, default 4) and the last `budget - sinks`."""

    name: ClassVar[str] = "sink"
    budget: int
    sinks: Optional[int] = None
    recent: Optional[int] = None


@dataclass(frozen=True)
class Scored(Policy):
    """Base of the scoring policies: the first `sinks`, the `heavy` best-ranked older entries, the `recent` newest.
    `budget` may be left out when heavy and recent are given (budget = sinks + heavy + recent). How entries rank is
    the subclass's C++ rule."""

    budget: Optional[int] = None
    heavy: Optional[int] = None
    recent: Optional[int] = None
    sinks: Optional[int] = None
    # a probe: before each eviction of a prompt (every piece of a bounded prefill, the prompt's end, compress()),
    # tokens decoded after what the cache holds rank it by their attention (the largest over probes, in the head
    # that gives the most), then are removed without a trace. "question": the prompt's last `question` tokens
    # (default 32); "repeat": "Repeat the previous context exactly." + the entries' own tokens (query-agnostic,
    # about twice the prefill); "catalyst": a short generic instruction (query-agnostic, cheap). None: no probe.
    probe: Optional[str] = None
    question: Optional[int] = None
    # the options (OPTIONS: pool, follow, block, probe_share, per_head, ...), fields declared from their C++ rows,
    # None by default; their meaning: `h2o_local.policies.OPTIONS` or docs/policies.md
    for _option in OPTIONS:
        __annotations__[_option["name"]] = "Optional[bool]" if _option["flag"] else "Optional[int]"
        locals()[_option["name"]] = None
    del _option

    def __post_init__(self) -> None:
        if self.budget is None:
            if self.heavy is None or self.recent is None:
                raise ValueError(f"policy {self.name!r} needs a budget (KV entries kept per sequence), or heavy and recent")
            check_int("heavy", self.heavy, 0)
            check_int("recent", self.recent, 0)
            check_int("sinks", self.sinks, 0)
            object.__setattr__(self, "budget", (self.sinks or 0) + self.heavy + self.recent)
        super().__post_init__()


@dataclass(frozen=True)
class H2O(Scored):
    """Heavy-Hitter Oracle as published: the `heavy` entries with the most accumulated attention (summed over heads
    and queries, no decay), the `recent` newest, and optionally the first `sinks`. Defaults: heavy = (budget -
    sinks) // 2, recent = the rest, sinks = 0."""

    name: ClassVar[str] = "h2o"


@dataclass(frozen=True)
class H2ONorm(Scored):
    """H2O ranked by the mean attention per query that could see the entry (accumulated sum / queries): OpenVINO
    GenAI's default (NORM_SUM). Plain sums favour old tokens. Split as H2O's."""

    name: ClassVar[str] = "h2o_norm"


@dataclass(frozen=True)
class H2OMaxHead(Scored):
    """H2O ranked by the largest per-head accumulated score instead of the sum over heads. Split as H2O's."""

    name: ClassVar[str] = "h2o_maxhead"


@dataclass(frozen=True)
class H2OHeadNorm(Scored):
    """H2O with each head's accumulated scores divided by that head's largest before the sum over heads. Split as
    H2O's."""

    name: ClassVar[str] = "h2o_headnorm"


@dataclass(frozen=True)
class TOVA(Scored):
    """TOVA (arXiv 2401.06104): ranked by the newest query's attention alone, nothing accumulates; a prompt's last
    token is decoded on its own so that it ranks the prompt. Default recent = 1 (the newest token)."""

    name: ClassVar[str] = "tova"


@dataclass(frozen=True)
class SnapKV(Scored):
    """SnapKV (arXiv 2404.14469): a prompt is ranked by the attention of its last `query_window` tokens (default 16,
    about one question, where kvpress uses 64; decoded on their own), averaged over 5 neighbouring entries;
    generation then accumulates on top as H2O does. Default recent = min(query_window, half of what the sinks
    leave). Label suffix `+wN`."""

    name: ClassVar[str] = "snapkv"
    query_window: Optional[int] = None  # type: ignore[assignment]  # the field shows the resolved window


@dataclass(frozen=True)
class KeyDiff(Scored):
    """KeyDiff (arXiv 2504.15364): ranked by how unlike the others an entry's keys are (minus the cosine similarity
    to the mean of the kept entries' normalised keys, summed over layers and KV heads). Reads the cached keys
    before each eviction; needs no attention scores. Split as H2O's."""

    name: ClassVar[str] = "keydiff"


@dataclass(frozen=True)
class PythonRanked(Scored):
    """A scorer written in Python, for research (kvpress's shape: one scoring method over a shared base). Subclass it
    and define `rank(total, head, queries)`: NumPy arrays of the kept entries' accumulated attention ([n], and [n,
    n_head] per query head) and of the queries that attended each ([n]) in, one number per entry out (larger = more
    worth keeping). The engine keeps the first `sinks`, the `recent` newest and the `heavy` best-ranked of the rest,
    as for every C++ scorer, and accumulates the scores as H2O does. It runs inside every eviction with the GIL
    taken: docs/performance.md measures what that costs.

        class MeanAttention(PythonRanked):
            name = "mean"
            def rank(self, total, head, queries):
                return total / queries

        Llama(path, policy=MeanAttention(budget=128))
    """

    name: ClassVar[str] = "python"
    _in_python: ClassVar[bool] = True

    def rank(self, total: np.ndarray, head: np.ndarray, queries: np.ndarray) -> np.ndarray:
        return total  # H2O's ranking

    def __post_init__(self) -> None:
        for key in ("budget", "heavy", "recent", "sinks"):
            check_int(key, getattr(self, key), minimum=0)
        if self.budget is None:
            if self.heavy is None or self.recent is None:
                raise ValueError(f"policy {self.name!r} needs a budget (KV entries kept per sequence), or heavy and recent")
            object.__setattr__(self, "budget", (self.sinks or 0) + self.heavy + self.recent)
        if any(getattr(self, k) is not None for k in ("probe", "question") + OPTION_NAMES):
            raise ValueError(f"a PythonRanked policy takes no probe, {', '.join(OPTION_NAMES)} (yet)")
        # resolved once, in C++ (the split), as a RankedPolicy whose rank() is this value's
        split = (-1 if v is None else int(v) for v in (self.budget, self.heavy, self.recent, self.sinks))
        self._adopt(_PythonRank(self, self.name, *split))


class _PythonRank(_engine.RankedPolicy):
    """The C++ RankedPolicy whose rank() calls the Python value's (which holds it, and so keeps it alive)."""

    def __init__(self, owner: PythonRanked, *args: Any):
        super().__init__(*args)
        self._rank = owner.rank  # a bound method: no cycle through the frozen value's fields

    def rank(self, total: np.ndarray, head: np.ndarray, queries: np.ndarray) -> np.ndarray:
        return self._rank(total, head, queries)


# The default policy of `Llama(path, budget=B)`, `h2o-local chat` and `serve` is chosen in C++
# (cpp/policy_config.h, default_policy_config): TOVA ranked by the newest query and by the prompt's own question (the
# question probe, pooled over 9 entries and the 12 before each), min(32, B // 2) recent entries and min(4, B // 8)
# attention sinks, the best mean score relative to the full cache over the whole quality suite (docs/quality-log.md,
# "The default"). Plain H2O stays available by name ("h2o").


def resolve(policy: Union[str, Policy, None] = None, budget: Optional[int] = None, *, heavy: Optional[int] = None,
            recent: Optional[int] = None, sinks: Optional[int] = None, query_window: Optional[int] = None,
            probe: Optional[str] = None, question: Optional[int] = None, **options: Any) -> Policy:
    """The policy value meant by `Llama`'s arguments: a value as it is, or a registered name with a budget split
    (and, for snapkv, a `query_window` in tokens; for a scorer, a `probe` (one of PROBES; `question` tokens for
    the question probe) and the OPTIONS by name: `pool` and `follow` in entries, `block` in positions,
    `probe_share` in percent, `per_head`).

    A label (`"tova-256+s4"`, as `Policy.label` writes it) is parsed as `parse` does.

    `policy=None` is the default policy (cpp/policy_config.h: fields given override its choices; with
    `per_head=True` and no probe asked for, without the default's probe, which per-head choice does not take). None or
    "h2o" with no budget, heavy or recent means the full cache (`Llama(path)` keeps everything).
    """
    for key in options:
        if key not in OPTION_NAMES:
            raise TypeError(f"unknown policy option {key!r} (expected one of: {', '.join(OPTION_NAMES)})")
    given = {"budget": budget, "heavy": heavy, "recent": recent, "sinks": sinks, "query_window": query_window,
             "probe": probe, "question": question, **options}
    asks_nothing = budget is None and heavy is None and recent is None and not sinks and \
        all(given[k] is None for k in PROBE_FIELDS + tuple(options))
    if isinstance(policy, Policy):
        if any(v is not None for v in given.values()):
            raise ValueError("give budget, heavy, recent and sinks inside the policy value, not beside it")
        return policy
    if policy is not None and not isinstance(policy, str):
        raise TypeError(f"policy must be a name or a policy value (h2o_local.policies), got {policy!r}")
    if isinstance(policy, str) and policy not in REGISTRY and "-" in policy:  # a label: "tova-256+s4"
        if any(v is not None for v in given.values()):
            raise ValueError(f"the label {policy!r} carries its budget and fields: give none beside it")
        return parse(policy)
    if policy is not None and policy not in REGISTRY:
        raise ValueError(f"unknown policy {policy!r} (expected one of: {', '.join(sorted(REGISTRY))})")
    if policy is None and asks_nothing:
        return Full()
    for key, value in given.items():
        check_field(key, value)
    cfg = _config(policy or "", given)
    if policy is None:
        cfg = _engine.default_policy_config(cfg)
    # the C++ policy validates every combination (with its own messages) and resolves it, once
    cls = REGISTRY[cfg.name]
    given = _config_fields(cfg)
    return cls._of(_engine.Policy(cfg), {k: v for k, v in given.items() if k in cls._field_names()})


def suffix_fields(suffix: str) -> Optional[Dict[str, Any]]:
    """The policy fields one label suffix stands for ("s4" -> sinks=4, "q32" -> the question probe of 32 tokens,
    "repeat" -> the repeat probe, and each option's: "p7" -> pool=7, "ph" -> per_head=True); None when it is not a
    policy suffix. C++ reads it (apply_label_suffix)."""
    cfg = _engine.PolicyConfig()
    if not isinstance(suffix, str) or not _engine.apply_label_suffix(cfg, suffix):
        return None
    return {k: v for k, v in _config_fields(cfg).items() if k != "budget"}


def parse(text: str) -> Policy:
    """A policy from its short label: "full", "local-256", "sink-64", "h2o-128", "h2o-128+s4" (4 sinks),
    "snapkv-256+w64" (a query window of 64), "tova-256+s4+r192" (192 recent entries), "tova-256+q32" (the question
    probe, 32 tokens), "tova-256+repeat" / "+catalyst" (the query-agnostic probes), and the options' suffixes:
    "tova-256+p7" (a pool of 7), "+f12" (a follow of 12), "+b16" (blocks), "tova-256+q32+m50" (half the heavy entries
    by the probe), "h2o-128+ph" (per-head choice). C++ reads it (parse_policy_label)."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"not a policy label: {text!r}")
    cfg = _engine.parse_policy_label(text)
    if cfg.name == "full":
        return Full()
    fields = _config_fields(cfg)
    return resolve(cfg.name, fields.pop("budget"), **fields)
