"""A GGUF file in Hugging Face transformers with our own attention: the references of experiments/perhead.py (the
published per-head H2O) and experiments/kvzip.py (KVzip's rule). Needs the experiments extra (torch, transformers)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Optional


def load_gguf_eager(gguf_path: str, attention: Callable, threads: Optional[int] = None):
    """The model of `gguf_path` (weights dequantized to float32, eval mode), its eager attention replaced by
    `attention` (transformers' `eager_attention_forward` signature: module, query, key, value, mask, scaling, ...)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    if model.config.model_type not in ("llama", "qwen2"):
        raise SystemExit(f"llama and qwen2 models are wired up, not {model.config.model_type}")
    # the attention module looks its eager function up in its own module's globals at call time
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    module.eager_attention_forward = attention
    return model
