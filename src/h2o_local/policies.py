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

import re

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Type, Union

import numpy as np

from . import _engine

REGISTRY: Dict[str, Type["Policy"]] = {}
# the fields a policy value passes to its C++ factory (PolicyConfig), in order
ENGINE_FIELDS = ("budget", "heavy", "recent", "sinks", "query_window", "probe", "question", "pool", "follow",
                 "probe_share", "per_head", "block")
# the optional fields beside the split; a name with none of them and no budget is the full cache
OPTION_FIELDS = ("query_window", "probe", "question", "pool", "follow", "probe_share", "per_head", "block")
# what a probe decodes after a piece of a prompt to rank it before eviction (cpp/policy.h ProbeSource)
PROBES = ("question", "repeat", "catalyst")


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


def _engine_int(value: Optional[int]) -> int:
    return -1 if value is None else int(value)


def _engine_args(values: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """ENGINE_FIELDS' values as the C++ factory takes them: -1 for an int left out, "" for no probe, False for no
    per-head choice."""
    return tuple(("" if v is None else v) if k == "probe" else bool(v) if k == "per_head" else _engine_int(v)
                 for k, v in zip(ENGINE_FIELDS, values))


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
            if f.name == "probe":
                check_probe(self.probe)  # type: ignore[attr-defined]
            elif f.name == "per_head":
                check_per_head(self.per_head)  # type: ignore[attr-defined]
            else:
                check_int(f.name, getattr(self, f.name), minimum=0)
        self._adopt(_engine.Policy(self.name, *_engine_args(self._request())))

    def _adopt(self, cpp: "_engine.Policy") -> None:
        """Hold the resolved C++ policy and show its resolution (the split, the query window) in the fields."""
        for key in ("sinks", "heavy", "recent"):
            if key in self._field_names():
                object.__setattr__(self, key, getattr(cpp, key))
        if "query_window" in self._field_names():
            object.__setattr__(self, "query_window", cpp.query_window)
        if "probe" in self._field_names():
            object.__setattr__(self, "probe", cpp.probe or None)
            object.__setattr__(self, "question", cpp.question or None)
            object.__setattr__(self, "pool", cpp.pool if cpp.pool > 1 else None)
            object.__setattr__(self, "follow", cpp.follow or None)
            object.__setattr__(self, "block", cpp.block if cpp.block > 1 else None)
            object.__setattr__(self, "probe_share", cpp.probe_share if cpp.probe_share < 100 else None)
        if "per_head" in self._field_names():
            object.__setattr__(self, "per_head", True if cpp.per_head else None)
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

    def _request(self) -> Tuple[Optional[int], ...]:
        """ENGINE_FIELDS as given; None where the policy has no such field or it was left out."""
        return tuple(getattr(self, k, None) for k in ENGINE_FIELDS)

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
        """A short name for reports: "full", "local-256", "h2o-128", "h2o-128+s4", "tova-256+s4+r192" (a recent
        window other than the policy's default split), "tova-256+q32" / "+repeat" / "+catalyst" (a probe), "+p7" (a
        pool), "+f12" (a follow), "+b16" (blocks), "+m50" (the probe's share of the heavy entries), "+ph" (per-head choice); `parse`
        reads it back."""
        if not self.bounded:
            return self.name
        sinks = getattr(self, "sinks", 0)
        extra = f"+s{sinks}" if isinstance(self, Scored) and sinks else ""
        window = self.query_window if "query_window" in self._field_names() else None
        if window is not None and window != _engine.Policy(self.name, self.budget).query_window:  # C++'s default
            extra += f"+w{window}"
        probe = getattr(self, "probe", None)
        if probe == "question":
            extra += f"+q{self.question}"  # type: ignore[attr-defined]
        elif probe:
            extra += f"+{probe}"
        if getattr(self, "pool", None):
            extra += f"+p{self.pool}"  # type: ignore[attr-defined]
        if getattr(self, "follow", None):
            extra += f"+f{self.follow}"  # type: ignore[attr-defined]
        if getattr(self, "block", None):
            extra += f"+b{self.block}"  # type: ignore[attr-defined]
        if getattr(self, "probe_share", None) is not None:
            extra += f"+m{self.probe_share}"  # type: ignore[attr-defined]
        recent = getattr(self, "recent", None)
        if isinstance(self, Scored) and recent is not None:
            default = resolve(self.name, self.budget, sinks=sinks or None, query_window=window)  # probes split nothing
            if default.recent != recent:  # type: ignore[attr-defined]
                extra += f"+r{recent}"
        if getattr(self, "per_head", None):
            extra += "+ph"
        return f"{self.name}-{self.budget}{extra}"  # type: ignore[attr-defined]


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
    # rank each entry by the best of the `pool` entries centred on it, so a fact's neighbours go with it
    pool: Optional[int] = None
    # and by the best of the `follow` entries before it: what follows an entry a probe found (a value after its
    # key) is kept with it
    follow: Optional[int] = None
    # and by the best entry of its block of `block` positions: what is kept (and recalled) comes in whole blocks,
    # as the pages of paged caches do
    block: Optional[int] = None
    # with a probe: the percent of the heavy entries the probe's ranking chooses (default 100); the rest are chosen
    # by the scorer's own rank (tova: what the newest query looks at), so that a chat's continuation keeps what it
    # reads besides what the question found
    probe_share: Optional[int] = None
    # H2O's published rule: every layer and KV head keeps its own `budget` entries by its own scores (the paper's
    # per-head heavy hitters), inside the same `budget` cells per sequence ("composite cells": a cell holds a
    # different token in each layer and head). Sinks, recent window and keep= stay shared by all heads. Attention
    # scorers only (not keydiff), no probe, no position_rolling. Label suffix `+ph`.
    per_head: Optional[bool] = None

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
        if any(getattr(self, k) is not None for k in ("probe", "question", "pool", "follow", "probe_share", "per_head",
                                                       "block")):
            raise ValueError("a PythonRanked policy takes no probe, pool, follow, block or per_head (yet)")
        # resolved once, in C++ (the split), as a RankedPolicy whose rank() is this value's
        self._adopt(_PythonRank(self, self.name, *map(_engine_int, (self.budget, self.heavy, self.recent, self.sinks))))

    @property
    def label(self) -> str:
        return f"{self.name}-{self.budget}" + (f"+s{self.sinks}" if self.sinks else "")


class _PythonRank(_engine.RankedPolicy):
    """The C++ RankedPolicy whose rank() calls the Python value's (which holds it, and so keeps it alive)."""

    def __init__(self, owner: PythonRanked, *args: Any):
        super().__init__(*args)
        self._rank = owner.rank  # a bound method: no cycle through the frozen value's fields

    def rank(self, total: np.ndarray, head: np.ndarray, queries: np.ndarray) -> np.ndarray:
        return self._rank(total, head, queries)


# The default policy of `Llama(path, budget=B)`, `h2o-local chat` and `serve`: the best mean score relative to the
# full cache over the whole quality suite (docs/quality-log.md, "The default"): heavy hitters ranked by TOVA's score and
# by the prompt's own question (the question probe, pooled over 9 entries and the 12 before each), a recent window
# of min(32, B // 2) and min(4, B // 8) attention sinks. Plain H2O stays available by name ("h2o").
DEFAULT_POLICY = "tova"
DEFAULT_FIELDS: Dict[str, Any] = {"probe": "question", "pool": 9, "follow": 12}
DEFAULT_RECENT = 32
DEFAULT_SINKS = 4


def default_recent(budget: int) -> int:
    """The default policy's recent window for a budget of `budget` entries."""
    return max(1, min(DEFAULT_RECENT, budget // 2))


def default_sinks(budget: int) -> int:
    """The default policy's attention sinks (the first entries, always kept) for a budget of `budget` entries: the
    question probe ranks by lift over the attention an entry usually gets, so the sinks, which get the most, would
    rank last."""
    return min(DEFAULT_SINKS, budget // 8)


def resolve(policy: Union[str, Policy, None] = None, budget: Optional[int] = None, *, heavy: Optional[int] = None,
            recent: Optional[int] = None, sinks: Optional[int] = None, query_window: Optional[int] = None,
            probe: Optional[str] = None, question: Optional[int] = None, pool: Optional[int] = None,
            follow: Optional[int] = None, probe_share: Optional[int] = None, per_head: Optional[bool] = None,
            block: Optional[int] = None) -> Policy:
    """The policy value meant by `Llama`'s arguments: a value as it is, or a registered name with a budget split
    (and, for snapkv, a `query_window` in tokens; for a scorer, a `probe` (one of PROBES; `question` tokens for
    the question probe), a `pool` width and a `follow` reach in entries, and the `probe_share` of the heavy entries
    the probe chooses, in percent).

    A label (`"tova-256+s4"`, as `Policy.label` writes it) is parsed as `parse` does.

    `policy=None` is the default policy (DEFAULT_POLICY with DEFAULT_FIELDS; fields given override them; with
    `per_head=True` and no probe asked for, without the default's probe, which per-head choice does not take). None or
    "h2o" with no budget, heavy or recent means the full cache (`Llama(path)` keeps everything).
    """
    given = {"budget": budget, "heavy": heavy, "recent": recent, "sinks": sinks, "query_window": query_window, "probe": probe,
             "question": question, "pool": pool, "follow": follow, "probe_share": probe_share, "per_head": per_head,
             "block": block}
    if policy is None:
        if budget is None and heavy is None and recent is None and not sinks and \
                all(given[k] is None for k in OPTION_FIELDS):
            return Full()
        fields = {k: v for k, v in given.items() if k != "budget"}
        for key, value in DEFAULT_FIELDS.items():
            fields[key] = value if fields[key] is None else fields[key]
        if per_head and probe is None and question is None and probe_share is None:
            fields["probe"] = None  # per-head choice takes no probe yet: the default's probe gives way to it
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            if sinks is None and heavy is None and recent is None:
                fields["sinks"] = sinks = default_sinks(budget)
            if recent is None and heavy is None:
                fields["recent"] = min(default_recent(budget), budget - (sinks or 0)) if (sinks or 0) < budget else None
        return resolve(DEFAULT_POLICY, budget, **fields)
    if isinstance(policy, Policy):
        if any(v is not None for v in given.values()):
            raise ValueError("give budget, heavy, recent and sinks inside the policy value, not beside it")
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or a policy value (h2o_local.policies), got {policy!r}")
    if policy not in REGISTRY and "-" in policy:  # a label, as the CLI and the server print them: "tova-256+s4"
        if any(v is not None for v in given.values()):
            raise ValueError(f"the label {policy!r} carries its budget and fields: give none beside it")
        return parse(policy)
    if policy not in REGISTRY:
        raise ValueError(f"unknown policy {policy!r} (expected one of: {', '.join(sorted(REGISTRY))})")
    for key, value in given.items():
        if key == "probe":
            check_probe(value)
        elif key == "per_head":
            check_per_head(value)
        else:
            check_int(key, value, minimum=1 if key == "budget" else 0)
    if policy == "h2o" and budget is None and heavy is None and recent is None and not sinks and \
            all(given[k] is None for k in OPTION_FIELDS):
        return Full()
    # the C++ policy validates every combination (with its own messages) and resolves it, once
    cpp = _engine.Policy(policy, *_engine_args(tuple(given.values())))
    cls = REGISTRY[policy]
    return cls._of(cpp, {k: v for k, v in given.items() if k in cls._field_names() and v is not None})


_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII digits only ("²".isdigit() is True), and below 2^31


_SUFFIX_FIELDS = {"s": "sinks", "w": "query_window", "r": "recent", "q": "question", "p": "pool", "f": "follow",
                  "m": "probe_share", "b": "block"}


def suffix_fields(suffix: str) -> Optional[Dict[str, Any]]:
    """The policy fields one label suffix stands for ("s4" -> sinks=4, "q32" -> the question probe of 32 tokens,
    "repeat" -> the repeat probe, "p7" -> pool=7, "f12" -> follow=12, "b16" -> block=16, "m50" -> probe_share=50); None when it is not a
    policy suffix."""
    if suffix in PROBES:
        return {"probe": suffix}
    if suffix == "ph":
        return {"per_head": True}
    key = _SUFFIX_FIELDS.get(suffix[:1])
    if key is None or not _DIGITS.fullmatch(suffix[1:]):
        return None
    return {key: int(suffix[1:]), **({"probe": "question"} if key == "question" else {})}


def parse(text: str) -> Policy:
    """A policy from its short label: "full", "local-256", "sink-64", "h2o-128", "h2o-128+s4" (4 sinks),
    "snapkv-256+w64" (a query window of 64), "tova-256+s4+r192" (192 recent entries), "tova-256+q32" (the question
    probe, 32 tokens), "tova-256+repeat" / "+catalyst" (the query-agnostic probes), "tova-256+p7" (a pool of 7), "tova-256+p9+f12" (and a follow of 12), "tova-256+q32+m50" (half the heavy entries by the probe), "h2o-128+ph" (per-head choice)."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"not a policy label: {text!r}")
    if text == "full":
        return Full()
    name, _, rest = text.partition("-")
    budget_text, *suffixes = rest.split("+")
    extra: Dict[str, Any] = {}
    for suffix in suffixes:
        fields = suffix_fields(suffix)
        if fields is None or any(k in extra for k in fields):
            budget_text = ""  # not a label
            break
        extra.update(fields)
    if not _DIGITS.fullmatch(budget_text):
        raise ValueError(f"not a policy label: {text!r} (expected NAME-BUDGET with optional +sN (sinks), +wN "
                         "(query window), +rN (recent entries), +qN (the question probe), +repeat or +catalyst (the "
                         "query-agnostic probes), +pN (pool), +fN (follow), +mN (the probe's share) and +ph (per head), for example h2o-128, h2o-128+s4, snapkv-256+w64, "
                         "tova-256+s4+r192, tova-256+repeat+p5)")
    return resolve(name, int(budget_text), **extra)
