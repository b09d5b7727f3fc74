"""The attention of a GGUF llama read another way: a NumPy forward pass over the file's own weights.

It shares nothing with llama.cpp but the GGUF file: RMS norm, RoPE (llama.cpp's "normal" mode: adjacent pairs),
grouped-query causal attention and the SwiGLU feed-forward, in float64. `column_sums(tokens)` gives, for a fresh
cache holding tokens at positions 0..n-1, the per-head sum over queries and layers of the softmax probabilities each
position received: what the patch exports for a prefill. `visible` narrows what each query attends to (a cache that
holds only some of the earlier entries). Quantized weights are dequantized with the gguf package.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np


class LlamaReference:
    def __init__(self, path: str):
        import gguf

        r = gguf.GGUFReader(path)
        arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

        def field(key: str, default=None):
            f = r.fields.get(f"{arch}.{key}")
            return default if f is None else f.parts[-1][0]

        self.n_layer = int(field("block_count"))
        self.n_head = int(field("attention.head_count"))
        self.n_head_kv = int(field("attention.head_count_kv", self.n_head))
        self.eps = float(field("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field("rope.freq_base", 10000.0))
        self.w: Dict[str, np.ndarray] = {}
        for t in r.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.asarray(data, dtype=np.float64).reshape([int(n) for n in reversed(t.shape)])

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x: [n, heads, head_dim] at positions 0..n-1, pairs (2i, 2i+1) rotated by pos * base^(-2i/d)."""
        n, _, d = x.shape
        theta = self.rope_base ** (-np.arange(0, d, 2) / d)
        ang = np.arange(n)[:, None] * theta[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def attention(self, tokens: List[int], visible: Optional[np.ndarray] = None) -> List[np.ndarray]:
        """Per layer, the softmax probabilities [n_head, n_query, n_key] of a causal pass over `tokens`; `visible`
        ([n, n] booleans, query by key) removes the keys a query cannot see, beside the causal mask."""
        return self.forward(tokens, visible)[0]

    def keys(self, tokens: List[int]) -> List[np.ndarray]:
        """Per layer, the keys [n, n_head_kv, head_dim] after RoPE: what the KV cache holds for `tokens`."""
        return self.forward(tokens)[1]

    def queries(self, tokens: List[int], visible: Optional[np.ndarray] = None) -> List[np.ndarray]:
        """Per layer, the queries [n, n_head, head_dim] after RoPE (before the 1/sqrt(head_dim) scale)."""
        self.forward(tokens, visible)
        return self.last_queries

    def forward(self, tokens: List[int], visible: Optional[np.ndarray] = None):
        w = self.w
        keys = []
        self.last_queries = []
        x = w["token_embd.weight"][tokens]
        n = len(tokens)
        allowed = np.tril(np.ones((n, n), dtype=bool))
        if visible is not None:
            allowed &= visible
        probs = []
        for il in range(self.n_layer):
            h = self.rms(x, w[f"blk.{il}.attn_norm.weight"])
            q = h @ w[f"blk.{il}.attn_q.weight"].T
            k = h @ w[f"blk.{il}.attn_k.weight"].T
            v = h @ w[f"blk.{il}.attn_v.weight"].T
            for name, t in (("q", q), ("k", k), ("v", v)):
                bias = w.get(f"blk.{il}.attn_{name}.bias")
                if bias is not None:
                    t += bias
            d = q.shape[1] // self.n_head
            q = self._rope(q.reshape(n, self.n_head, d))
            k = self._rope(k.reshape(n, self.n_head_kv, d))
            v = v.reshape(n, self.n_head_kv, d)
            keys.append(k)
            self.last_queries.append(q)
            group = self.n_head // self.n_head_kv
            kh = np.repeat(k, group, axis=1)            # query head h reads KV head h // group
            vh = np.repeat(v, group, axis=1)
            logits = np.einsum("qhd,khd->hqk", q, kh) / np.sqrt(d)
            logits = np.where(allowed, logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            probs.append(p)
            att = np.einsum("hqk,khd->qhd", p, vh).reshape(n, -1)
            x = x + att @ w[f"blk.{il}.attn_output.weight"].T
            h = self.rms(x, w[f"blk.{il}.ffn_norm.weight"])
            g = h @ w[f"blk.{il}.ffn_gate.weight"].T
            u = h @ w[f"blk.{il}.ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[f"blk.{il}.ffn_down.weight"].T
        return probs, keys

    def column_sums(self, tokens: List[int], queries: slice = slice(None)) -> np.ndarray:
        """[n_key, n_head]: probabilities each position received from the chosen queries, summed over layers."""
        total = sum(p[:, queries, :].sum(axis=1) for p in self.attention(tokens))
        return np.asarray(total).T
