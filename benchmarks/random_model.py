"""A random-weight GGUF with a real model's shapes, for speed measurements where the real file cannot be had
(a GPU machine with no registry). Its text is noise; its cost per token is the real model's (F16 weights).

    python benchmarks/random_model.py --shape qwen2.5-1.5b --out /tmp/qwen15b-random.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

# n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train (from the GGUF headers of ../shared/docs/models.md)
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, 8192),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, 32768),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, 32768),
    # almost no arithmetic: a step's time is the host's per-token cost (graph building, scheduling, the score read
    # and eviction, Python), what a GPU that computes the step in no time still pays
    "host-cost": (64, 2, 4, 2, 128, 512, 32768),
    # little arithmetic in Qwen2.5-1.5B's 28 layers (heads of 64, which flash attention takes on a device): what a
    # prompt pays per layer besides arithmetic (the cache's transfers for compaction and recall, a set per layer)
    "host-cost-28": (256, 28, 4, 2, 256, 512, 32768),
    # the laptop case of issue 51: 32k tokens of F16 KV take 4 GiB (16 GB of F16 weights written)
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, 131072),
}


def byte_vocab(n_vocab: int = 0, special_tokens: Sequence[str] = ()):
    """An SPM byte vocabulary: <unk>, <s>, </s>, the 256 byte tokens and the word marker, then `special_tokens`
    (control tokens: "<|im_start|>", ...), padded with unused tokens to `n_vocab` (a real vocabulary's size: the
    output matmul's cost)."""
    import gguf

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)] + ["\u2581".encode()]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256 \
        + [gguf.TokenType.NORMAL]
    tokens += [t.encode() for t in special_tokens]
    types += [gguf.TokenType.CONTROL] * len(special_tokens)
    tokens += [f"<pad{i}>".encode() for i in range(max(n_vocab - len(tokens), 0))]
    types += [gguf.TokenType.UNUSED] * (len(tokens) - len(types))
    return tokens, types


def add_byte_tokenizer(w, tokens, types) -> None:
    """Write byte_vocab()'s tokens as an SPM ("llama") tokenizer with zero scores."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)


def write_llama(path: Path, *, name: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int, n_ff: int,
                n_ctx_train: int, tensor: Callable[[Tuple[int, ...], float], np.ndarray], scales: Dict[str, float],
                f16: bool, n_vocab: int = 0, rms_eps: float = 1e-5, add_bos: bool = True, chat_template: str = "",
                special_tokens: Sequence[str] = ()) -> Path:
    """The one GGUF writer of a llama-architecture model with random weights (tests and benchmarks): `tensor(shape,
    scale)` draws each weight, in the order token_embd, output, then per layer q, k, v, output, gate, up, down;
    `scales` maps those names ("token_embd", "output", "attn_q", ...) to their scale; norms are ones."""
    import gguf

    head_dim = n_embd // n_head
    tokens, types = byte_vocab(n_vocab, special_tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    add_byte_tokenizer(w, tokens, types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)

    def t(tensor_name: str, kind: str, *shape: int):
        w.add_tensor(tensor_name, tensor(shape, scales[kind]))

    def ones(tensor_name: str, n: int):
        w.add_tensor(tensor_name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", "token_embd", len(tokens), n_embd)
    ones("output_norm.weight", n_embd)
    t("output.weight", "output", len(tokens), n_embd)
    for il in range(n_layer):
        ones(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", "attn_q", n_embd, n_embd)
        t(f"blk.{il}.attn_k.weight", "attn_k", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_v.weight", "attn_v", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_output.weight", "attn_output", n_embd, n_embd)
        ones(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", "ffn_gate", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", "ffn_up", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", "ffn_down", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_random_llama(path: Path, shape: str, seed: int = 0) -> Path:
    """A real model's shapes with F16 random weights (scale 0.02)."""
    n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train = SHAPES[shape]
    rng = np.random.default_rng(seed)
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return write_llama(path, name=f"random-{shape}", n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                       n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=n_ctx_train, n_vocab=n_vocab, rms_eps=1e-6,
                       add_bos=False, f16=True, scales=dict.fromkeys(kinds, 0.02),
                       tensor=lambda shape_, scale: (rng.standard_normal(shape_, dtype=np.float32) * scale).astype(np.float16))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_random_llama(args.out, args.shape, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
