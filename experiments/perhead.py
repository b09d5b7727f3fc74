"""The published per-head H2O rule in Hugging Face transformers, as the reference for our per-token eviction.

    pip install ".[experiments]"     # transformers, accelerate and torch==2.13.0 (CPU)
    python -m experiments.perhead --input-path ../shared/data/xsum.jsonl \\
        --output-path results/quality/xsum-smollm2-perhead.jsonl --budgets 64 128 256 512 1024 full --sample-num 20 \\
        --seeds 0 1 2 --greedy

llama.cpp shares one KV cell across all layers and heads, so h2o_local evicts whole tokens by the sum of their
scores over heads and layers. The llama-recipes code evicts per layer and per KV head. This module loads the same
GGUF file in transformers (its GGUF loader dequantizes the weights to float32) and simulates that rule with
attention masks: the full K/V stay in the cache, an evicted (layer, KV head, token) gets -inf before the softmax
from then on. The rule, as llama-recipes' HHCache (docs: ../shared/docs/h2o_reference.md section 3.2):

- scores are accumulated post-softmax probabilities summed over query rows, per layer and KV head; with GQA either
  the first query head of each group (`--gqa first`, what llama-recipes does) or the sum over the group (`sum`);
- after every forward (the prompt, then each generated token), a head that holds more than `budget` tokens keeps
  the `budget - budget // 2` most recent and the `budget // 2` highest-scoring older ones.

Everything else is section 1's setting (summarization.py): prompt without BOS, positions absolute (no rolling),
64 new tokens, cut at `###`, the same llama.cpp sampler chain and seeds on these logits, tokens and text through the
same llama.cpp tokenizer. The prompt is run once per row with full attention and every setting branches from it
(the prompt's scores do not depend on the budget: prefill attention is full in the reference too). The output
jsonl has summarization.py's schema (policies `hf-full`, `hf-h2o-first`, `hf-h2o-sum`), so the two tables can be
put side by side: `python -m experiments.summarization --summary-only --output-path A.jsonl --also B.jsonl`.
"""
from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from experiments.models import model_path
from .common import experiment_parser
from .hf import load_gguf_eager
from .summarization import GEN, decodings, rouge_scores, rows_and_records, summarize


class PerHeadH2O:
    """Per (layer, KV head) H2O state for one sequence: accumulated scores and which tokens each head keeps.

    `attend` replaces transformers' eager attention: it masks what was evicted, records the probabilities and, when
    `budget` is set, evicts down to it. `budget=None` keeps everything (still recording scores).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, gqa: str = "first", budget: Optional[int] = None):
        if gqa not in ("first", "sum"):
            raise ValueError("gqa must be 'first' or 'sum'")
        self.gqa = gqa
        self.budget = budget
        self.scores: List = [None] * n_layers  # float32 [n_kv, T]: accumulated probability per token and head
        self.keep: List = [None] * n_layers    # bool [n_kv, T]
        self.n_kv_heads = n_kv_heads

    def with_budget(self, budget: Optional[int]) -> "PerHeadH2O":
        """A copy that evicts to `budget` from now on (evicting at once what is over it)."""
        other = copy.copy(self)
        other.scores = [s.clone() for s in self.scores]
        other.keep = [k.clone() for k in self.keep]
        other.budget = budget
        for layer in range(len(other.scores)):
            other._evict(layer)
        return other

    def kept(self) -> List[int]:
        """Tokens kept per layer, summed over KV heads (a check: at most budget x heads)."""
        return [int(k.sum()) for k in self.keep]

    def attend(self, module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
        import torch

        layer, groups = module.layer_idx, module.num_key_value_groups
        n_kv, n_tok, n_new = key.shape[1], key.shape[2], query.shape[2]
        keep = self.keep[layer]
        if keep is None:
            keep = torch.ones(n_kv, 0, dtype=torch.bool)
        keep = torch.cat([keep, torch.ones(n_kv, n_tok - keep.shape[1], dtype=torch.bool)], dim=1)

        # query heads h * groups .. h * groups + groups - 1 share KV head h: attend per KV head, no K/V copies
        bsz, n_heads, _, dim = query.shape
        w = torch.matmul(query.reshape(bsz, n_kv, groups * n_new, dim), key.transpose(2, 3)) * scaling
        w = w.view(bsz, n_kv, groups, n_new, n_tok)
        if attention_mask is not None:
            w = w + attention_mask[:, :, None, :, :n_tok]
        w = w.masked_fill(~keep[None, :, None, None, :], float("-inf"))
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(p.view(bsz, n_kv, groups * n_new, n_tok), value)
        out = out.view(bsz, n_heads, n_new, dim).transpose(1, 2).contiguous()

        col = p[0].sum(dim=2)  # [n_kv, groups, T]: summed over this forward's query rows
        col = col[:, 0] if self.gqa == "first" else col.sum(dim=1)
        old = self.scores[layer]
        if old is not None:
            col[:, : old.shape[1]] += old
        self.scores[layer] = col * keep
        self.keep[layer] = keep
        self._evict(layer)
        return out, p.view(bsz, n_heads, n_new, n_tok)

    def _evict(self, layer: int) -> None:
        import torch

        keep, budget = self.keep[layer], self.budget
        if budget is None or int(keep.sum(dim=1).max()) <= budget:
            return
        heavy = budget // 2
        recent = budget - heavy
        n_tok = keep.shape[1]
        new = torch.zeros_like(keep)
        new[:, n_tok - recent:] = True
        if heavy > 0:
            cand = self.scores[layer][:, : n_tok - recent].masked_fill(~keep[:, : n_tok - recent], float("-inf"))
            top = torch.topk(cand, min(heavy, n_tok - recent), dim=1).indices
            new[:, : n_tok - recent].scatter_(1, top, True)
            new &= keep | (torch.arange(n_tok) >= n_tok - recent)
        self.keep[layer] = new
        self.scores[layer] = self.scores[layer] * new


class HFModel:
    """A GGUF file loaded in transformers with `PerHeadH2O` as its attention, fed llama.cpp's token ids."""

    def __init__(self, gguf_path: str, threads: Optional[int] = None):
        self.model = load_gguf_eager(gguf_path, self._attention, threads)
        cfg = self.model.config
        self.n_layers, self.n_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.h2o: Optional[PerHeadH2O] = None

    def _attention(self, *args, **kwargs):
        return self.h2o.attend(*args, **kwargs)

    def prefill(self, tokens: List[int], gqa: str):
        """Run the prompt with full attention; returns (cache, h2o state, last logits) to branch settings from."""
        import torch
        from transformers import DynamicCache

        self.h2o = PerHeadH2O(self.n_layers, self.n_kv_heads, gqa=gqa)
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0, -1]
        return cache, self.h2o, logits

    def decode(self, cache, h2o: PerHeadH2O, logits, sampler, eog, piece, max_tokens: int, stop: List[str]) -> str:
        """Sample up to `max_tokens` tokens from `logits` on, feeding each back; text cut at the first stop string."""
        import torch
        from h2o_local.text import TextAssembler

        self.h2o = h2o
        text = TextAssembler(stop)
        out = ""
        for n in range(max_tokens):
            token = sampler.sample(logits.numpy())
            if eog(token):
                break
            out += text.push(piece(token))
            if text.stopped or n + 1 == max_tokens:
                break
            with torch.no_grad():
                logits = self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
        return out + text.flush()


def run(args) -> None:
    from h2o_local import Llama, SamplingParams

    rows, records = rows_and_records(args)
    path = model_path(args.model)
    vocab = Llama(path, budget=None, n_ctx=256)  # llama.cpp's tokenizer and sampler chain
    hf = HFModel(path, threads=args.threads)
    budgets = [None if b == "full" else int(b) for b in args.budgets]
    # the full cache does not depend on the GQA reduction: run it once, under the first variant
    todo = [(f"hf-h2o-{g}" if b is not None else "hf-full", g, b) for g in args.gqa for b in budgets
            if b is not None or g == args.gqa[0]]
    decs = decodings(args.seeds, args.greedy)
    greedy_only = set(args.greedy_only_gqa or [])
    t0, n_new = time.time(), 0
    for i, row in enumerate(rows):
        tokens = vocab.tokenize(row["article"], add_bos=False)
        for gqa in args.gqa:
            pending = [(p, b, d, s) for p, g, b in todo if g == gqa for d, s in decs
                       if (i, p, b, d) not in records.done and not (g in greedy_only and s is not None)]
            if not pending:
                continue
            cache0, h2o0, logits0 = hf.prefill(tokens, gqa)
            for policy, budget, dec, seed in pending:
                h2o = h2o0.with_budget(budget)
                kept = h2o.kept()
                temperature = 0.0 if seed is None else float(row.get("temperature", 0.3))
                params = SamplingParams(temperature=temperature, top_p=GEN["top_p"], top_k=GEN["top_k"],
                                        min_p=GEN["min_p"])
                sampler = params.sampler(vocab.n_vocab(), seed or 0)
                text = hf.decode(copy.deepcopy(cache0), h2o, logits0.clone(), sampler, vocab.is_eog,
                                 vocab.token_to_piece, GEN["max_tokens"],
                                 row.get("stop", GEN["stop"]))
                rec = {"row": i, "policy": policy, "budget": budget, "decoding": dec,
                       "prompt_tokens": len(tokens), "output": text, "summary_gt": row["summary_gt"],
                       "kept_after_prompt": kept[0], **rouge_scores(text, row["summary_gt"])}
                records.add(rec)
                n_new += 1
                rate = (time.time() - t0) / n_new
                print(f"\r[{n_new}] row {i} {policy}-{budget} {dec}: R2 {rec['rouge2']:.3f} "
                      f"({rate:.1f} s/sample)   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def compare_full_greedy(ours: Path, hf: Path) -> str:
    """How often the transformers model with the full cache writes llama.cpp's greedy summary (same GGUF weights)."""
    def greedy_full(path: Path, policy: str) -> Dict[int, str]:
        return {r["row"]: r["output"] for r in map(json.loads, open(path))
                if r["policy"] == policy and r["decoding"] == "greedy"}

    a, b = greedy_full(ours, "full"), greedy_full(hf, "hf-full")
    rows = sorted(set(a) & set(b))
    if not rows:
        return "no row has a greedy full-cache summary in both files"
    same = sum(a[r] == b[r] for r in rows)
    prefix = [len(_common_prefix(a[r].split(), b[r].split())) for r in rows]
    first = sum(p >= 5 for p in prefix)
    return (f"greedy, full cache, {len(rows)} rows: identical summaries {same}/{len(rows)}; the first 5 words equal "
            f"{first}/{len(rows)}; words in common before the first difference: mean {sum(prefix) / len(rows):.1f}")


def _common_prefix(x: List[str], y: List[str]) -> List[str]:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


def main(argv=None) -> int:
    ap = experiment_parser("experiments.perhead", __doc__)
    ap.add_argument("--output-path", required=True)
    ap.add_argument("--budgets", nargs="+", default=["64", "128", "256", "512", "1024", "full"])
    ap.add_argument("--gqa", nargs="+", default=["first", "sum"], choices=["first", "sum"],
                    help="how a KV head's score is read from its query heads: the first one, or their sum")
    ap.add_argument("--greedy-only-gqa", nargs="*", choices=["first", "sum"],
                    help="GQA variants run greedily only (saves time)")
    ap.add_argument("--sample-num", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--greedy", action="store_true", help="also decode greedily")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--check-against", metavar="JSONL",
                    help="summarization.py's results for the same rows: report how often the full-cache greedy "
                         "summaries agree (run first with --budgets full --greedy --seeds to check the model load)")
    ap.add_argument("--summary-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.summary_only:
        run(args)
    if args.check_against:
        print(compare_full_greedy(Path(args.check_against), Path(args.output_path)))
    print(summarize(Path(args.output_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
