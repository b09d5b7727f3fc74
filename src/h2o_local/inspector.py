"""What a policy keeps: feed a text through a bounded cache and report, per token, kept or evicted and its score.

`inspect_text` runs each policy on its own `Llama` (the prompt fed as a user's would be, with the bounded prefill);
`to_html` writes a self-contained page (tokens shaded by score, evicted ones struck through) and `to_png` a heat map
(kept scores per position for every policy, and per head for the first policy that has per-head scores).
"""
from __future__ import annotations

import functools
import html
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import numpy as np

from .llama import Llama
from .policies import Policy, parse


@dataclass
class Inspection:
    """One policy on one text."""

    label: str
    pieces: List[str]            # the text of each token, in order
    kept: np.ndarray             # bool [n]: the token is in the cache at the end
    scores: np.ndarray           # float32 [n]: its score at the end (0 for evicted tokens)
    head_scores: np.ndarray      # float32 [n, n_head]: per head (zeros when the policy keeps no scores)
    n_evicted: int
    n_tokens: int
    # a per-head policy: float [n], the share of the (layer, KV head) parts that hold the token (kept = share > 0;
    # scores is then this share); None for a policy that keeps whole tokens
    head_share: Optional[np.ndarray] = None
    # with recall: bool [n], the token's entry waits in host memory (evicted from the device, recallable); None
    # without recall
    in_host: Optional[np.ndarray] = None

    @property
    def has_scores(self) -> bool:
        return bool(np.any(self.scores[self.kept] != 0))


def inspect_text(model_path: str, text: str, policies: Sequence[Union[str, Policy]], *, max_tokens: int = 0,
                 n_batch: int = 128, n_threads: Optional[int] = None, chat: bool = False, recall: bool = False,
                 question: Optional[str] = None,
                 progress: Optional[Callable[[str, int, int], None]] = None) -> List[Inspection]:
    """Feed `text` (wrapped in the chat template with `chat`) and `max_tokens` greedy tokens after it through each
    policy ("h2o-64", "sink-64", a Policy value, ...); one Inspection per policy. With `recall`, evicted entries wait
    in host memory (`Inspection.in_host`); a `question` fed after them brings back what it asks about.
    `progress(label, fed, total)`: called while each policy reads the text (whole batches)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text is empty")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise ValueError("the question is empty")
    out = []
    for spec in policies:
        policy = parse(spec) if isinstance(spec, str) else spec
        llm = Llama(model_path, policy=policy, n_batch=n_batch, n_threads=n_threads, export_scores=True,
                    recall=recall)
        if chat:
            tokens = llm.chat_tokens([{"role": "user", "content": text}])[0]
        else:
            tokens = llm.tokenize(text, add_bos=llm.info.add_bos)
        reading = None if progress is None else functools.partial(progress, policy.label)
        generated = [e.token for e in llm.generate_events(tokens, max_tokens=max_tokens, temperature=0,
                                                          progress=reading)
                     if e.token is not None] if max_tokens else llm.eval(tokens, progress=reading) or []
        fed = (tokens + generated)[: llm.kv_state().n_seen]  # a last generated token is shown but not fed
        asked = llm.tokenize(question, add_bos=False) if question is not None else []
        if asked:
            llm.eval(asked)
        st = llm.kv_state()
        all_tokens = fed + asked
        n = len(all_tokens)
        kept = np.zeros(n, bool)
        scores = np.zeros(n, np.float32)
        head = np.zeros((n, st.head_scores.shape[1]), np.float32)
        share = None
        if st.head_positions is not None:
            # each (layer, KV head) holds its own tokens: a cell's position is not what every head holds there
            held, held_share = st.held()
            share = np.zeros(n)
            share[held[held < n]] = held_share[held < n]
            kept, scores = share > 0, share.astype(np.float32)
        else:
            pos = st.origins[st.origins < n]
            kept[pos] = True
            scores[pos] = st.scores[: len(pos)]
            head[pos] = st.head_scores[: len(pos)]
        pieces = [llm.token_to_piece(t, special=True).decode("utf-8", errors="replace") for t in all_tokens]
        in_host = None
        if recall:
            in_host = np.zeros(n, bool)
            in_host[st.host_origins[st.host_origins < n]] = True
        out.append(Inspection(policy.label, pieces, kept, scores, head, st.n_evicted, n, share, in_host))
    return out


def _shade(scores: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """0..1 per token: the rank of its score among the kept ones (scores span orders of magnitude)."""
    shade = np.zeros(len(scores))
    idx = np.flatnonzero(kept)
    if len(idx) > 1:
        order = np.argsort(np.argsort(scores[idx], kind="stable"), kind="stable")
        shade[idx] = order / (len(idx) - 1)
    elif len(idx) == 1:
        shade[idx] = 1.0
    return shade


def to_html(inspections: Sequence[Inspection], title: str = "h2o_local inspect") -> str:
    """A self-contained HTML page: one section per policy, each token shaded by its score's rank among the kept
    tokens (darker = more attention kept), evicted tokens grey and struck through; hover shows position and score."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
             "body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;line-height:1.7}"
             ".t{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:0.9em}"
             ".e{color:#aaa;text-decoration:line-through}.k{border-radius:2px}"
             ".h{color:#357;text-decoration:underline dotted}"
             "h2{font-size:1.1em;margin-top:2em}.legend span{padding:0 .4em}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><p class='legend'>kept, by score rank: "
             + "".join(f"<span class='k' style='background:{_color(x)}'>{int(x * 100)}%</span>" for x in (0, .25, .5, .75, 1))
             + " &nbsp; <span class='e'>evicted</span> &nbsp; <span class='h'>in host memory (recall)</span></p>"]
    for ins in inspections:
        shade = _shade(ins.scores, ins.kept) if ins.has_scores else np.where(ins.kept, 0.5, 0.0)
        held = " by at least one layer's KV head" if ins.head_share is not None else ""
        host = f", {int(ins.in_host.sum())} of them in host memory" if ins.in_host is not None else ""
        parts.append(f"<h2>{html.escape(ins.label)}: {int(ins.kept.sum())} of {ins.n_tokens} tokens kept{held}, "
                     f"{ins.n_evicted} evicted{host}</h2><div class='t'>")
        for i, piece in enumerate(ins.pieces):
            text = html.escape(piece)
            if ins.kept[i]:
                what = (f"held by {ins.head_share[i]:.0%} of the layers' KV heads" if ins.head_share is not None
                        else f"score {ins.scores[i]:.4g}")
                parts.append(f"<span class='k' style='background:{_color(shade[i])}' "
                             f"title='position {i}, {what}'>{text}</span>")
            elif ins.in_host is not None and ins.in_host[i]:
                parts.append(f"<span class='h' title='position {i}, evicted to host memory'>{text}</span>")
            else:
                parts.append(f"<span class='e' title='position {i}, evicted'>{text}</span>")
        parts.append("</div>")
    parts.append("</body></html>")
    return "".join(parts)


def _color(x: float) -> str:
    return f"rgba(255,{int(200 - 120 * x)},0,{0.15 + 0.75 * x:.2f})"


def to_png(inspections: Sequence[Inspection], path: Union[str, os.PathLike]) -> None:
    """A heat map: kept scores per position for each policy (log scale; evicted = blank), and per head for the
    first policy with per-head scores. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_head = next((ins for ins in inspections if ins.has_scores and ins.head_share is None), None)
    rows = len(inspections) + (1 if per_head is not None else 0)
    fig, axes = plt.subplots(rows, 1, figsize=(12, 1.0 + 1.2 * rows + (1.5 if per_head is not None else 0)),
                             squeeze=False, gridspec_kw={"height_ratios": [1] * len(inspections) + ([3] if per_head else [])})
    for ax, ins in zip(axes[:, 0], inspections):
        row = np.where(ins.kept, np.log10(np.maximum(ins.scores, 1e-6)) if ins.has_scores else 1.0, np.nan)
        ax.imshow(row[None, :], aspect="auto", cmap="YlOrRd", interpolation="nearest")
        ax.set_yticks([0], [ins.label])
        ax.set_xticks([])
    if per_head is not None:
        ax = axes[-1, 0]
        h = np.where(per_head.kept[:, None], np.log10(np.maximum(per_head.head_scores, 1e-6)), np.nan).T
        im = ax.imshow(h, aspect="auto", cmap="YlOrRd", interpolation="nearest")
        ax.set_ylabel(f"{per_head.label}\nhead")
        fig.colorbar(im, ax=ax, label="log10 score", pad=0.01)
    axes[-1, 0].set_xlabel("token position (blank: evicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
