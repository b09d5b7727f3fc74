"""A random-weight GGUF with a real model's shapes, for speed measurements where the real file cannot be had
(a GPU machine with no registry). Its text is noise; its cost per token is the real model's (F16 weights).

    python benchmarks/random_model.py --shape qwen2.5-1.5b --out /tmp/qwen15b-random.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train (from the GGUF headers of ../shared/docs/models.md)
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, 8192),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, 32768),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, 32768),
}


def write_random_llama(path: Path, shape: str, seed: int = 0) -> Path:
    import gguf

    n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train = SHAPES[shape]
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    # an SPM byte vocabulary padded with plain tokens to the real vocabulary size (the output matmul's cost)
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)] + ["\u2581".encode()]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256 \
        + [gguf.TokenType.NORMAL]
    tokens += [f"<pad{i}>".encode() for i in range(n_vocab - len(tokens))]
    types += [gguf.TokenType.UNUSED] * (n_vocab - len(types))

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-{shape}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def t(name: str, *shape_: int, scale: float = 0.02):
        w.add_tensor(name, (rng.standard_normal(shape_, dtype=np.float32) * scale).astype(np.float16))

    def ones(name: str, n: int):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd)
    ones("output_norm.weight", n_embd)
    t("output.weight", n_vocab, n_embd)
    for il in range(n_layer):
        ones(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_output.weight", n_embd, n_embd)
        ones(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
