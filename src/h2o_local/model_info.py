"""What a GGUF model is, read from its header without loading its weights or creating a context."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from . import _engine


@dataclass(frozen=True)
class ModelInfo:
    """Facts of one GGUF model. `ModelInfo.load(path)` reads them in milliseconds (metadata only).

    kv_bytes_per_cell: bytes one token takes in an F16 KV cache (K and V of every layer with a full-context cache);
    layers with a sliding window (iSWA models) are not counted, their cache has a fixed size.
    """

    path: str
    arch: str
    n_ctx_train: int       # tokens the model was trained with
    n_vocab: int
    n_layer: int
    n_head: int            # query heads
    n_head_kv: int
    n_embd: int
    kv_bytes_per_cell: int
    model_bytes: int
    n_params: int
    add_bos: bool          # the tokenizer adds BOS to a prompt
    token_bos: int
    token_eos: int
    token_nl: int          # the newline token (-1: none)
    fim: Tuple[int, ...]   # fill-in-the-middle tokens: prefix, suffix, middle, repository, file separator (-1: none)
    chat_template: Optional[str]  # the GGUF's Jinja chat template; None when it has none

    def __repr__(self) -> str:
        """The facts one reads, not the template's body (`info.chat_template` holds it)."""
        template = "none" if self.chat_template is None else f"{len(self.chat_template)} characters"
        return (f"ModelInfo({os.path.basename(self.path)!r}, arch={self.arch}, params={self.n_params / 1e6:.0f}M, "
                f"file={self.model_bytes / 2**20:.0f} MiB, n_ctx_train={self.n_ctx_train}, n_vocab={self.n_vocab}, "
                f"layers={self.n_layer}, heads={self.n_head}/{self.n_head_kv} kv, "
                f"kv_bytes_per_cell={self.kv_bytes_per_cell}, chat_template={template})")

    @classmethod
    def load(cls, model_path: Union[str, os.PathLike]) -> "ModelInfo":
        path = os.fspath(model_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file not found: {path}")
        return cls.from_facts(path, _engine.Model(path).facts())

    @classmethod
    def from_facts(cls, path: str, facts: Dict[str, Any]) -> "ModelInfo":
        facts = {**facts, "fim": tuple(facts.get("fim") or (-1,) * 5)}
        return cls(path=path, **{k: v for k, v in facts.items() if k in cls.__dataclass_fields__})
