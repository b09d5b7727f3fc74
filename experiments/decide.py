"""The default policy, chosen by the whole suite: every measured cell (model x task x mode x budget) as a score
relative to the same model's full cache, one mean per policy family over the cells every family was measured on.

    python -m experiments.decide --families sink h2o tova tova+q32+p9+f12+r32 \\
        --out results/quality/decision.md results/quality/longctx-*.jsonl results/quality/fidelity-*-probe.jsonl \\
        results/quality/chat-*-probe.jsonl

Cells (a record's file says its model: `longctx-smollm2-d.jsonl` -> smollm2):
- long-context suite (experiments.longctx): per task the full cache keeps (>= --min-full), mode (aware, agnostic)
  and budget, the family's mean over the full cache's; the kv task's turns 2-3 (asked after the context was
  compressed) are a task of their own, `kv-later`.
- fidelity and chat (experiments.quality): top-1 agreement with the full cache (the full cache's own is 1).
A family is a setting label without its size: `tova-25%+q32+p9+f12+r32` -> `tova+q32+p9+f12+r32` at `25%`.

`--paired A B` (repeatable) also writes, per model and budget, the paired difference A - B over the rows both
families ran (fidelity and chat: a row's top-1 agreement; retrieval: a row's score, per task and mode), mean ±
standard error, and whether A wins by more than two standard errors: issue #27's rule for per-head selection
(`--paired h2o+ph h2o --paired tova+ph tova`).
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .common import table

MODELS = ("smollm2", "qwen05b", "qwen15b")


def family_and_size(label: str) -> Tuple[str, str]:
    head, _, suffixes = label.partition("+")
    name, _, size = head.partition("-")
    return name + ("+" + suffixes if suffixes else ""), size


def model_of(path: Path) -> str:
    for m in MODELS:
        if m in path.name:
            return m
    raise ValueError(f"{path}: no model name ({', '.join(MODELS)}) in the file name")


def longctx_cells(rows: List[Dict], model: str, min_full: float) -> Dict[Tuple[str, str], Dict[str, float]]:
    """(cell, family) -> relative score, for one model's long-context records."""
    scores = defaultdict(list)  # (task, mode, label) -> scores
    for r in rows:
        for mode in (("aware", "agnostic") if r["setting"] == "full" else (r["mode"],)):
            scores[(r["task"], mode, r["setting"])].append(r["score"])
            if r["task"] == "kv" and len(r["turn_scores"]) > 1:
                scores[("kv-later", mode, r["setting"])].append(float(np.mean(r["turn_scores"][1:])))
    full = {t: np.mean(v) for (t, m, lab), v in scores.items() if lab == "full" and m == "aware"}
    kept = {t for t, v in full.items() if v >= min_full}
    cells = {}
    for (task, mode, lab), v in scores.items():
        if lab != "full" and task in kept:
            fam, size = family_and_size(lab)
            cells[(f"{model} {task} {mode} {size}", fam)] = float(np.mean(v) / full[task])
    return cells


def agreement_cells(rows: List[Dict], model: str, kind: str) -> Dict[Tuple[str, str], float]:
    per = defaultdict(list)
    for r in rows:
        if r["setting"] == "full":
            continue
        fam, size = family_and_size(r["setting"])
        per[(r.get("prefill", ""), size, fam)].append(r["agree"])
    return {(f"{model} {kind} {prefill} {size}", fam): float(np.mean(v))
            for (prefill, size, fam), v in per.items()}


def row_values(rows: List[Dict], kind: str) -> Dict[Tuple[str, str, Tuple], float]:
    """(family, size, row key) -> the row's value: top-1 agreement (fidelity, chat) or score (retrieval)."""
    out = {}
    for r in rows:
        if r["setting"] == "full":
            continue
        fam, size = family_and_size(r["setting"])
        if kind == "longctx":
            key = (r["task"], r["mode"], r["row"])
            out[(fam, size, key)] = float(r["score"])
        else:
            out[(fam, size, (kind, r.get("prefill", ""), r["row"]))] = float(r["agree"])
    return out


def paired(values: Dict[Tuple[str, str, Tuple], float], a: str, b: str, size: str) -> Tuple[float, float, int]:
    """Mean and standard error of A - B over the row keys both ran at this size."""
    diffs = [v - values[(b, sz, key)] for (fam, sz, key), v in values.items()
             if fam == a and sz == size and (b, sz, key) in values]
    if len(diffs) < 2:
        return float("nan"), float("nan"), len(diffs)
    return float(np.mean(diffs)), float(np.std(diffs, ddof=1) / np.sqrt(len(diffs))), len(diffs)


def paired_lines(by_kind: Dict[Tuple[str, str], List[Dict]], pairs: List[List[str]]) -> List[str]:
    lines = ["", "## Paired differences", "",
             "A - B over the rows both ran (fidelity and chat: top-1 agreement per row; retrieval: score per row, "
             "task and mode), pooled per model and budget; `wins` when the mean exceeds two standard errors.", ""]
    body = []
    for model in MODELS:
        values: Dict[Tuple[str, str, Tuple], float] = {}
        for (kind, m), rows in by_kind.items():
            if m == model:
                values.update(row_values(rows, kind))
        sizes = sorted({sz for (_, sz, _) in values}, key=lambda x: float(x.rstrip("%") or 0))
        for a, b in pairs:
            for size in sizes:
                mean, se, n = paired(values, a, b, size)
                if n >= 2:
                    verdict = "wins" if mean > 2 * se else ("loses" if mean < -2 * se else "no difference")
                    body.append([model, f"{a} - {b}", size, str(n), f"{mean:+.3f} ± {se:.3f}", verdict])
    return lines + table(["model", "A - B", "budget", "rows", "mean ± s.e.", "verdict"], body)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.decide", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--families", nargs="+", required=True)
    ap.add_argument("--min-full", type=float, default=0.8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--paired", nargs=2, action="append", default=[], metavar=("A", "B"),
                    help="also the paired difference of family A minus family B, per model and budget")
    args = ap.parse_args(argv)
    by_kind = defaultdict(list)  # (kind, model) -> records
    for path in args.files:
        kind = path.name.split("-")[0]
        by_kind[(kind, model_of(path))] += [json.loads(line) for line in open(path)]
    cells: Dict[Tuple[str, str], float] = {}
    for (kind, model), rows in sorted(by_kind.items()):
        if kind == "longctx":
            cells.update(longctx_cells(rows, model, args.min_full))
        elif kind in ("fidelity", "chat"):
            cells.update(agreement_cells(rows, model, kind))
    names = sorted({c for c, _ in cells})
    common = [c for c in names if all((c, f) in cells for f in args.families)]
    body = [[c] + [f"{cells[(c, f)]:.3f}" if (c, f) in cells else "" for f in args.families] for c in names]
    means = [float(np.mean([cells[(c, f)] for c in common])) if common else float("nan") for f in args.families]
    body.append([f"**mean over the {len(common)} cells every family has**"] + [f"**{m:.3f}**" for m in means])
    best = args.families[int(np.nanargmax(means))] if common else "none"
    lines = ["# The default, chosen by the whole suite", "",
             "Each cell: the family's score relative to the same model's full cache (retrieval: a task the full "
             f"cache keeps at >= {args.min_full}; fidelity and chat: top-1 agreement). Files: "
             + ", ".join(f"`{p.name}`" for p in args.files) + ".", "",
             *table(["cell"] + args.families, body), "", f"Best mean: `{best}`."]
    if args.paired:
        lines += paired_lines(by_kind, args.paired)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
