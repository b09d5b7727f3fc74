"""KVzip's query-agnostic compression (arXiv 2505.23416) in transformers, on the long-context suite's rows: what the
repeat probe can reach on our models when nothing of llama.cpp's shared cells constrains it.

    pip install ".[experiments]"
    python -m experiments.kvzip --model smollm2 --input-path ../shared/data/xsum_0shot_dev.jsonl \\
        --tasks single kv --rows 8 --context 1000 --ratios 0.25 0.10 --out results/quality/kvzip-smollm2

For each row of experiments/longctx.py (same seeds, formats, prompts, tokens), query-agnostic:
1. the context (the first turn's prompt up to its question) is prefilled with full attention;
2. the repeat probe, KVzip's reconstruction, is decoded after it: "Repeat the previous context exactly." then the
   context's own tokens; each context entry's score in (layer, KV head) is the largest attention probability any
   probe query of the head's GQA group gives it (KVzip's max over queries and the group); the probe's K/V are
   dropped;
3. the context is cut to a share of its entries by one of these selections:
   - `global`: KVzip's rule, the top share over all (layer, KV head, entry) triples (heads keep different counts);
   - `head`: every (layer, KV head) keeps the same count, its own top entries (what composite cells can hold);
   - `token-max` / `token-sum`: whole entries, ranked by the max / sum of their scores over layers and heads (what
     shared cells hold);
   the first `--sinks` entries are always kept;
4. the questions are asked (turn after turn for kv) with the evicted (layer, head, entry) masked, greedy answers.
The full cache runs the same rows. Records go to OUT.jsonl as they come (resumable); OUT.md has the table.
"""
from __future__ import annotations

import copy
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments.models import model_path
from .common import JsonlRecords, experiment_parser, table
from .hf import load_gguf_eager
from .longctx import haystack_sentences, mean_se, row_prompt, score

SELECTIONS = ("global", "head", "token-max", "token-sum")
REPEAT = "\n\nRepeat the previous context exactly.\n\n"


class MaskedAttention:
    """Eager attention that records each (layer, KV head)'s largest probability per context entry (`record`) and
    masks the evicted (layer, KV head, entry) triples (`keep`: per layer a bool [n_kv, n_ctx])."""

    def __init__(self, n_layers: int):
        self.n_ctx = 0
        self.record = False
        self.scores: List = [None] * n_layers  # float32 [n_kv, n_ctx]
        self.keep: Optional[List] = None

    def attend(self, module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
        import torch

        layer, groups = module.layer_idx, module.num_key_value_groups
        n_kv, n_tok, n_new = key.shape[1], key.shape[2], query.shape[2]
        bsz, n_heads, _, dim = query.shape
        w = torch.matmul(query.reshape(bsz, n_kv, groups * n_new, dim), key.transpose(2, 3)) * scaling
        w = w.view(bsz, n_kv, groups, n_new, n_tok)
        if attention_mask is not None:
            w = w + attention_mask[:, :, None, :, :n_tok]
        if self.keep is not None:
            masked = torch.zeros(n_kv, n_tok, dtype=torch.bool)
            masked[:, : self.n_ctx] = ~self.keep[layer]
            w = w.masked_fill(masked[None, :, None, None, :], float("-inf"))
        p = torch.softmax(w, dim=-1, dtype=torch.float32)
        if self.record:
            best = p[0, :, :, :, : self.n_ctx].amax(dim=(1, 2))  # [n_kv, n_ctx]
            old = self.scores[layer]
            self.scores[layer] = best if old is None else torch.maximum(old, best)
        out = torch.matmul(p.to(query.dtype).view(bsz, n_kv, groups * n_new, n_tok), value)
        out = out.view(bsz, n_heads, n_new, dim).transpose(1, 2).contiguous()
        return out, None


class HFModel:
    def __init__(self, gguf_path: str, threads: Optional[int] = None):
        self.attn = MaskedAttention(0)
        self.model = load_gguf_eager(gguf_path, lambda *a, **k: self.attn.attend(*a, **k), threads)
        self.n_layers = self.model.config.num_hidden_layers
        self.attn.scores = [None] * self.n_layers

    def forward(self, tokens: List[int], cache, chunk: int = 512):
        import torch

        logits = None
        with torch.no_grad():
            for i in range(0, len(tokens), chunk):
                logits = self.model(torch.tensor([tokens[i:i + chunk]]), past_key_values=cache,
                                    use_cache=True).logits[0, -1]
        return logits

    def greedy(self, cache, logits, max_tokens: int, eog) -> List[int]:
        out = []
        for _ in range(max_tokens):
            t = int(logits.argmax())
            if eog(t):
                break
            out.append(t)
            logits = self.forward([t], cache)
        return out


def select(scores: List, share: float, how: str, sinks: int) -> List:
    """Per layer a bool [n_kv, n_ctx] of the kept entries: `share` of them (counted over every layer and head)."""
    import torch

    s = torch.stack(scores)  # [L, H, n]
    L, H, n = s.shape
    s = s.clone()
    s[:, :, :sinks] = float("inf")
    k = max(sinks, int(round(share * n)))
    if how == "global":
        flat = s.flatten()
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[flat.topk(k * L * H).indices] = True
        keep = keep.view(L, H, n)
    elif how == "head":
        keep = torch.zeros(L, H, n, dtype=torch.bool)
        keep.scatter_(2, s.topk(k, dim=2).indices, True)
    else:
        tok = s.amax(dim=(0, 1)) if how == "token-max" else s.sum(dim=(0, 1))
        keep1 = torch.zeros(n, dtype=torch.bool)
        keep1[tok.topk(k).indices] = True
        keep = keep1.expand(L, H, n).clone()
    return list(keep)


def run(args) -> None:
    from transformers import DynamicCache

    from h2o_local import Llama

    records = JsonlRecords(args.out.with_suffix(".jsonl"))
    settings = ["full"] + [f"{how}-{int(round(r * 100))}%" for r in args.ratios for how in args.selections]
    if args.report:
        return report(args, records.rows, settings)
    tok = Llama(args.model, budget=8, n_threads=args.threads)
    hf = HFModel(args.model, threads=args.threads)
    sentences = haystack_sentences(args.input_path)
    repeat = tok.tokenize(REPEAT, add_bos=False, special=True)
    for task in args.tasks:
        for row in range(args.rows):
            todo = [s for s in settings if f"{task}/{row}/{s}" not in records.done]
            if not todo:
                continue
            fmt, spec, head_ids, tail_ids, later = row_prompt(tok, sentences, task, row, args.seed, args.context)
            turns = [tail_ids] + later
            n = len(head_ids)
            hf.attn.keep, hf.attn.record, hf.attn.n_ctx = None, False, n
            cache = DynamicCache(config=hf.model.config)
            hf.forward(head_ids, cache)
            hf.attn.scores = [None] * hf.n_layers
            hf.attn.record = True
            hf.forward(repeat + head_ids[1:], cache)  # the reconstruction: every context token after the BOS
            hf.attn.record = False
            cache.crop(n - cache.get_seq_length())
            scores = list(hf.attn.scores)
            for setting in todo:
                if setting == "full":
                    hf.attn.keep = None
                else:
                    how, pct = setting.rsplit("-", 1)
                    hf.attn.keep = select(scores, float(pct[:-1]) / 100, how, args.sinks)
                c = copy.deepcopy(cache)
                answers = []
                for ids in turns:
                    logits = hf.forward(ids, c)
                    out = hf.greedy(c, logits, args.max_tokens, tok.is_eog)
                    answers.append(tok.detokenize(out).decode("utf-8", "replace"))
                    if out:
                        hf.forward(out, c)
                scores_row = [score(a, e) for a, e in zip(answers, spec["answers"])]
                extra = {}
                if hf.attn.keep is not None:  # the share of the context each (layer, KV head) keeps
                    share = np.sort(np.stack([k.float().mean(dim=1).numpy() for k in hf.attn.keep]).ravel())
                    extra = {"head_share_quantiles": [round(float(np.quantile(share, q)), 3)
                                                      for q in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)]}
                records.add({"key": f"{task}/{row}/{setting}", "task": task, "row": row, "setting": setting,
                             **fmt, "context_tokens": n, **extra, "score": scores_row[0], "turn_scores": scores_row,
                             "answers": answers})
                print(f"{task} {row} {setting}: {scores_row} {answers[0][:40]!r}", file=sys.stderr, flush=True)
    report(args, records.rows, settings)


def report(args, rows: List[Dict], settings: Sequence[str]) -> None:
    by = defaultdict(list)
    turns = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by[(r["task"], r["setting"])].append(r["score"])
        for i, s in enumerate(r["turn_scores"]):
            turns[(r["task"], r["setting"])][i].append(s)
    lines = [f"# KVzip in transformers: {Path(args.model).name}, query-agnostic", "",
             f"{args.rows} rows per task, context about {args.context} tokens, repeat-probe scores (max over "
             f"queries and the GQA group), {args.sinks} sinks kept, greedy answers of up to {args.max_tokens} tokens; share = kept entries over context entries, "
             "counted over every layer and KV head.", ""]
    head = ["setting"] + [f"{t}" for t in args.tasks] + (["kv turns 2-3"] if "kv" in args.tasks else [])
    body = []
    for s in settings:
        if not any(by[(t, s)] for t in args.tasks):
            continue
        cells = [s]
        for t in args.tasks:
            m, se = mean_se(by[(t, s)])
            cells.append(f"{m:.2f} ± {se:.2f} ({len(by[(t, s)])})" if by[(t, s)] else "")
        if "kv" in args.tasks:
            later = turns[("kv", s)][1] + turns[("kv", s)][2]
            m, se = mean_se(later)
            cells.append(f"{m:.2f} ± {se:.2f}" if later else "")
        body.append(cells)
    lines += table(head, body) + [""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = experiment_parser("experiments.kvzip", __doc__)
    ap.add_argument("--tasks", nargs="+", default=["single", "kv"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.10])
    ap.add_argument("--selections", nargs="+", default=list(SELECTIONS), choices=SELECTIONS)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="only write the report of the records so far")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.model = model_path(args.model)
    args.input_path = Path(args.input_path)
    run(args)


if __name__ == "__main__":
    main()
