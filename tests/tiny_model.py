"""A tiny random llama GGUF for fast tests, written with the `gguf` package.

2 layers, n_embd 64, 4 query heads / 2 KV heads (GQA), a 260-token SPM byte vocabulary, F32 weights. The weights are
random but scaled so that attention is far from uniform (heavy hitters exist), and the trained context is short so
that tests can run past it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_vocab():
    """The 260-token SPM vocabulary: <unk>, <s>, </s>, the 256 byte tokens and the word marker."""
    import gguf

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)] + ["\u2581".encode()]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256 \
        + [gguf.TokenType.NORMAL]
    return tokens, types


def add_hparams(w, n_ctx_train: int, n_embd: int, n_layer: int, n_ff: int, n_head: int, n_head_kv: int) -> None:
    """The hyperparameters every tiny model has (F32 weights, RMS norm, RoPE over the whole head)."""
    import gguf

    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_tiny_llama(path: Path, *, n_ctx_train: int = 128, seed: int = 0, n_layer: int = 2,
                     chat_template: str = "", n_embd: int = 64) -> Path:
    import gguf

    n_head, n_head_kv, n_ff = 4, 2, 128
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    tokens, types = byte_vocab()
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    add_hparams(w, n_ctx_train, n_embd, n_layer, n_ff, n_head, n_head_kv)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    def t(name: str, *shape: int, scale: float = 1.0):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd)
    ones("output_norm.weight", n_embd)
    t("output.weight", n_vocab, n_embd, scale=0.2)
    for il in range(n_layer):
        ones(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", n_embd, n_embd, scale=0.5)        # large q/k: peaked attention
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd, scale=0.5)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd, scale=0.2)
        t(f"blk.{il}.attn_output.weight", n_embd, n_embd, scale=0.2)
        ones(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd, scale=0.2)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd, scale=0.2)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff, scale=0.2)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_qwen2vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL text model: M-RoPE, whose KV positions llama.cpp cannot shift."""
    import gguf

    n_embd, n_head, n_head_kv, n_ff, n_layer = 64, 4, 2, 128, 1
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    tokens, types = byte_vocab()

    w = gguf.GGUFWriter(str(path), "qwen2vl")
    add_hparams(w, 128, n_embd, n_layer, n_ff, n_head, n_head_kv)
    w.add_rope_dimension_sections([2, 3, 3, 0])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    t("token_embd.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    t("output.weight", len(tokens), n_embd)
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{il}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{il}.attn_q.bias", n_embd)
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_k.bias", n_head_kv * head_dim)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_v.bias", n_head_kv * head_dim)
        t(f"blk.{il}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{il}.ffn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
