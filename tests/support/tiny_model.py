"""A tiny random llama GGUF for fast tests, written with the `gguf` package.

2 layers, n_embd 64, 4 query heads / 2 KV heads (GQA), a 260-token SPM byte vocabulary, F32 weights. The weights are
random but scaled so that attention is far from uniform (heavy hitters exist), and the trained context is short so
that tests can run past it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks.random_model import add_byte_tokenizer, byte_vocab, write_llama


def write_tiny_llama(path: Path, *, n_ctx_train: int = 128, seed: int = 0, n_layer: int = 2,
                     chat_template: str = "", n_embd: int = 64, special_tokens: Sequence[str] = (),
                     add_bos: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    return write_llama(path, name="tiny-random-llama", n_embd=n_embd, n_layer=n_layer, n_head=4, n_head_kv=2, n_ff=128,
                       n_ctx_train=n_ctx_train, chat_template=chat_template, f16=False, add_bos=add_bos,
                       special_tokens=special_tokens,
                       # large q/k: peaked attention, so heavy hitters exist
                       scales={"token_embd": 1.0, "output": 0.2, "attn_q": 0.5, "attn_k": 0.5, "attn_v": 0.2,
                               "attn_output": 0.2, "ffn_gate": 0.2, "ffn_up": 0.2, "ffn_down": 0.2},
                       tensor=lambda shape, scale: (rng.standard_normal(shape) * scale).astype(np.float32))


def tiny_writer(path: Path, arch: str, *, n_ctx_train: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
                n_head_kv: int, rms_eps: float):
    """A GGUF writer for `arch` with the shape keys every tiny model has, F32, and the byte vocabulary: (writer,
    tokens)."""
    import gguf

    tokens, types = byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_byte_tokenizer(w, tokens, types)
    return w, tokens


def finish(w, path: Path) -> Path:
    """Write out a GGUFWriter's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_tensors(w, seed: int):
    """(t, norm): t(name, *shape, scale=0.2) adds a random F32 tensor (numpy's shape: ggml's reversed), norm(name, n)
    a vector of ones."""
    rng = np.random.default_rng(seed)

    def t(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(name, n):
        w.add_tensor(name, np.ones(n, np.float32))

    return t, norm


def embedding_and_ends(w, seed: int, n_vocab: int, n_embd: int, *, scale: float = 1.0, tied: bool = False):
    """The start every tiny writer shares: BOS 1 and EOS 2, the random tensors (`random_tensors`), the token embedding
    (its values times `scale`), the output norm and, unless `tied` to the embedding, the output matrix. Returns
    (t, norm) for the layers."""
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    t, norm = random_tensors(w, seed)
    t("token_embd.weight", n_vocab, n_embd, scale=scale)
    norm("output_norm.weight", n_embd)
    if not tied:
        t("output.weight", n_vocab, n_embd)
    return t, norm


def write_tiny_qwen2vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL text model: M-RoPE, whose KV positions llama.cpp cannot shift."""
    n_embd, n_head, n_head_kv, n_ff, n_layer = 64, 4, 2, 128, 1
    head_dim = n_embd // n_head
    w, tokens = tiny_writer(path, "qwen2vl", n_ctx_train=128, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                            n_head_kv=n_head_kv, rms_eps=1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_dimension_sections([2, 3, 3, 0])
    t, norm = random_tensors(w, seed)
    t("token_embd.weight", len(tokens), n_embd)
    norm("output_norm.weight", n_embd)
    t("output.weight", len(tokens), n_embd)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{il}.attn_q.bias", n_embd)
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_k.bias", n_head_kv * head_dim)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{il}.attn_v.bias", n_head_kv * head_dim)
        t(f"blk.{il}.attn_output.weight", n_embd, n_embd)
        norm(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    return finish(w, path)


def add_gemma_layers(t, norm, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int, *,
                     qk_norm: bool, qk_scale: float) -> None:
    """A Gemma 2 / 3 block per layer: norms after attention and after the feed-forward too; Gemma 3 adds q/k norms."""
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", n_head * head_dim, n_embd, scale=qk_scale)
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd, scale=qk_scale)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        if qk_norm:
            norm(f"blk.{il}.attn_q_norm.weight", head_dim)
            norm(f"blk.{il}.attn_k_norm.weight", head_dim)
        t(f"blk.{il}.attn_output.weight", n_embd, n_head * head_dim)
        norm(f"blk.{il}.post_attention_norm.weight", n_embd)
        norm(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
        norm(f"blk.{il}.post_ffw_norm.weight", n_embd)


def write_tiny_gemma3(path: Path, *, seed: int = 0, n_swa: int = 32) -> Path:
    """A tiny random Gemma 3 text model: 6 layers, the first 5 attend a sliding window of `n_swa` tokens, the 6th all
    of them (llama.cpp's iSWA cache: a window cache beside the base cache; the scores come from the base layer)."""
    n_embd, n_head, n_head_kv, n_ff, n_layer, head_dim = 64, 4, 1, 128, 6, 16
    w, tokens = tiny_writer(path, "gemma3", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                            n_head_kv=n_head_kv, rms_eps=1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(n_swa)
    # Gemma multiplies the embedding by sqrt(n_embd)
    t, norm = embedding_and_ends(w, seed, len(tokens), n_embd, scale=0.1, tied=True)
    add_gemma_layers(t, norm, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, qk_norm=True, qk_scale=0.2)
    return finish(w, path)


def write_tiny_mamba(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Mamba: a recurrent state instead of a KV cache (nothing can be evicted from it)."""
    n_embd, n_layer, d_inner, d_state, d_conv, dt_rank = 64, 2, 128, 16, 4, 4
    rng = np.random.default_rng(seed)
    w, tokens = tiny_writer(path, "mamba", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=0, n_head=0,
                            n_head_kv=0, rms_eps=1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    t("token_embd.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{il}.ssm_in.weight", 2 * d_inner, n_embd)
        t(f"blk.{il}.ssm_conv1d.weight", d_inner, d_conv)
        t(f"blk.{il}.ssm_conv1d.bias", d_inner)
        t(f"blk.{il}.ssm_x.weight", dt_rank + 2 * d_state, d_inner)
        t(f"blk.{il}.ssm_dt.weight", d_inner, dt_rank)
        t(f"blk.{il}.ssm_dt.bias", d_inner)
        w.add_tensor(f"blk.{il}.ssm_a", -np.exp(rng.standard_normal((d_inner, d_state))).astype(np.float32))
        w.add_tensor(f"blk.{il}.ssm_d", np.ones(d_inner, np.float32))
        t(f"blk.{il}.ssm_out.weight", n_embd, d_inner)
    return finish(w, path)


# One per attention design a user's GGUF may have (tests/engine/test_architectures.py): 2-4 layers, 4 query heads.

def write_tiny_qwen3(path: Path, *, seed: int = 0) -> Path:
    """Qwen3: norms on each head's q and k, and heads of 32 values, wider than n_embd / n_head."""
    n_embd, n_head, n_head_kv, n_ff, n_layer, head_dim = 64, 4, 2, 128, 2, 32
    w, tokens = tiny_writer(path, "qwen3", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                            n_head_kv=n_head_kv, rms_eps=1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    t, norm = embedding_and_ends(w, seed, len(tokens), n_embd, tied=True)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q.weight", n_head * head_dim, n_embd, scale=0.5)
        t(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd, scale=0.5)
        t(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        norm(f"blk.{il}.attn_q_norm.weight", head_dim)
        norm(f"blk.{il}.attn_k_norm.weight", head_dim)
        t(f"blk.{il}.attn_output.weight", n_embd, n_head * head_dim)
        norm(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    return finish(w, path)


def write_tiny_gemma2(path: Path, *, seed: int = 0, n_swa: int = 32) -> Path:
    """Gemma 2: every other layer attends a sliding window (the even ones, llama.cpp's iSWA cache), and the attention
    logits are soft-capped (tanh) before the softmax."""
    n_embd, n_head, n_head_kv, n_ff, n_layer, head_dim = 64, 4, 2, 128, 4, 16
    w, tokens = tiny_writer(path, "gemma2", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                            n_head_kv=n_head_kv, rms_eps=1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_sliding_window(n_swa)
    w.add_attn_logit_softcapping(50.0)
    w.add_final_logit_softcapping(30.0)
    t, norm = embedding_and_ends(w, seed, len(tokens), n_embd, scale=0.1, tied=True)
    add_gemma_layers(t, norm, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, qk_norm=False, qk_scale=0.5)
    return finish(w, path)


def write_tiny_phi3(path: Path, *, seed: int = 0) -> Path:
    """Phi-3: one fused q/k/v projection, a fused gate/up projection, and a sliding-window key that llama.cpp ignores
    (every layer attends all tokens)."""
    n_embd, n_head, n_ff, n_layer = 64, 4, 128, 2
    w, tokens = tiny_writer(path, "phi3", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                            n_head_kv=n_head, rms_eps=1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_sliding_window(2047)
    t, norm = embedding_and_ends(w, seed, len(tokens), n_embd)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_qkv.weight", 3 * n_embd, n_embd, scale=0.5)
        t(f"blk.{il}.attn_output.weight", n_embd, n_embd)
        norm(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_up.weight", 2 * n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    return finish(w, path)


def write_tiny_deepseek2(path: Path, *, seed: int = 0) -> Path:
    """DeepSeek-V2's multi-head latent attention (MLA; also Kimi, GLM-4.7-Flash): the KV cache holds one compressed
    latent row per token (32 values + 8 rotated ones) and no V; each head's keys and values are decompressed from
    it in the graph. Dense feed-forward layers only (no experts)."""
    n_embd, n_head, n_ff, n_layer = 64, 4, 128, 2
    q_lora, kv_lora, qk_nope, qk_rope, v_head = 32, 32, 16, 8, 16
    w, tokens = tiny_writer(path, "deepseek2", n_ctx_train=1024, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
                            n_head=n_head, n_head_kv=1, rms_eps=1e-6)
    w.add_key_length(kv_lora + qk_rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(qk_nope + qk_rope)
    w.add_value_length_mla(v_head)
    w.add_q_lora_rank(q_lora)
    w.add_kv_lora_rank(kv_lora)
    w.add_rope_dimension_count(qk_rope)
    w.add_leading_dense_block_count(n_layer)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_shared_count(0)
    w.add_expert_count(0)
    w.add_expert_used_count(0)
    t, norm = embedding_and_ends(w, seed, len(tokens), n_embd)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight", n_embd)
        t(f"blk.{il}.attn_q_a.weight", q_lora, n_embd, scale=0.5)
        norm(f"blk.{il}.attn_q_a_norm.weight", q_lora)
        t(f"blk.{il}.attn_q_b.weight", n_head * (qk_nope + qk_rope), q_lora, scale=0.5)
        t(f"blk.{il}.attn_kv_a_mqa.weight", kv_lora + qk_rope, n_embd, scale=0.5)
        norm(f"blk.{il}.attn_kv_a_norm.weight", kv_lora)
        t(f"blk.{il}.attn_k_b.weight", n_head, kv_lora, qk_nope, scale=0.5)
        t(f"blk.{il}.attn_v_b.weight", n_head, v_head, kv_lora)
        t(f"blk.{il}.attn_output.weight", n_embd, n_head * v_head)
        norm(f"blk.{il}.ffn_norm.weight", n_embd)
        t(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    return finish(w, path)
