"""llama-cpp-python's names, as this library takes them: its chat formats, its ggml type numbers, its tokenizer object, and its keywords
for what this library does not do, accepted at the values that ask for nothing (scripts and wrappers pass them with
their defaults) and a ValueError naming them otherwise. Two users: `Llama(...)` and the completion calls."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .llama import Llama

# its chat_format names where llama.cpp's built-in templates are named otherwise
CHAT_FORMATS = {"llama-2": "llama2-sys", "llama-3": "llama3", "mistral-instruct": "mistral-v1", "qwen": "chatml"}

# ggml's type numbers, as its type_k / type_v take them (llama_cpp.GGML_TYPE_Q8_0 is 8)
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}

# Llama(...)'s keywords: model and context settings this library leaves at llama.cpp's defaults, LoRA,
# speculative decoding, its own tokenizer and chat handler objects
CONSTRUCTOR_NOT_DONE: Dict[str, Tuple[Any, ...]] = {
    "use_mmap": (True,), "use_mlock": (False,), "vocab_only": (False,), "kv_overrides": (None,),
    "split_mode": (1,), "main_gpu": (0,), "tensor_split": (None,), "offload_kqv": (True,), "numa": (False, 0),
    "attention_type": (-1,),
    "rope_scaling_type": (-1, None), "rope_freq_base": (0.0,), "rope_freq_scale": (0.0,),
    "yarn_ext_factor": (-1.0,), "yarn_attn_factor": (1.0,), "yarn_beta_fast": (32.0,), "yarn_beta_slow": (1.0,),
    "yarn_orig_ctx": (0,), "swa_full": (None,), "last_n_tokens_size": (64,),
    "lora_base": (None,), "lora_path": (None,), "lora_scale": (1.0,),
    "chat_handler": (None,), "draft_model": (None,), "tokenizer": (None,), "spm_infill": (False,),
}
# and those it ignores: logprobs need no logits_all here (the logits a call asks for are kept), no_perf turns off
# llama.cpp's timers, embed() works with or without embedding=True (its context is its own)
CONSTRUCTOR_IGNORED = ("logits_all", "no_perf", "embedding")

# create_completion / create_chat_completion / __call__'s keywords
CALL_NOT_DONE: Dict[str, Tuple[Any, ...]] = {
    "stopping_criteria": (None,), "logits_processor": (None,), "functions": (None, []),
    "function_call": (None, "none", "auto")}
# ignored as llama-cpp-python ignores it: llama.cpp removed tail-free sampling
CALL_IGNORED = ("tfs_z",)


def _asks_nothing(value: Any, ok: Any) -> bool:
    if value is ok or (type(value) is type(ok) and value == ok):
        return True
    # 0 for 0.0: a number given as an int
    return isinstance(ok, float) and type(value) is int and value == ok


def without_not_done(params: Mapping[str, Any], not_done: Mapping[str, Tuple[Any, ...]],
                     ignored: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """`params` less the keywords of `not_done` that ask for nothing and those `ignored`; one that asks for something
    raises ValueError naming it."""
    for name in not_done.keys() & params.keys():
        value = params[name]
        if not any(_asks_nothing(value, ok) for ok in not_done[name]):
            raise ValueError(f"{name} is not supported by h2o_local (got {value!r})")
    return {k: v for k, v in params.items() if k not in not_done and k not in ignored}


def check_constructor(keywords: Mapping[str, Any], *, n_threads: Optional[int]) -> None:
    """llama-cpp-python's `Llama(...)` keywords that this library's `Llama` has no parameter for: a name it does not
    know is a TypeError (as Python's own), one that asks for something not done here a ValueError."""
    rest = dict(keywords)
    unknown = sorted(rest.keys() - CONSTRUCTOR_NOT_DONE.keys() - set(CONSTRUCTOR_IGNORED))
    if unknown:
        raise TypeError(f"Llama.__init__() got an unexpected keyword argument {unknown[0]!r}")
    without_not_done(rest, CONSTRUCTOR_NOT_DONE, CONSTRUCTOR_IGNORED)


def ggml_type_name(name: str, value: Any) -> Optional[str]:
    """type_k / type_v as a ggml type name: a name as given, or llama-cpp-python's type number."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is int:
        if value not in GGML_TYPES:
            raise ValueError(f"{name}: ggml type {value} cannot hold a KV cache here; give one of "
                             + ", ".join(f"{n} ({t!r})" for n, t in GGML_TYPES.items()))
        return GGML_TYPES[value]
    raise TypeError(f"{name} must be a ggml type name such as 'q8_0' (or llama-cpp-python's number, 8), "
                    f"got {value!r}")


class LlamaTokenizer:
    """llama-cpp-python's tokenizer object (`Llama.tokenizer()`): the model's tokenize / detokenize on bytes, and
    `encode` / `decode` on text. Special tokens' text is parsed by default, as its `encode` does."""

    def __init__(self, llama: "Llama"):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> List[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Optional[Sequence[int]] = None,
                   special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, special, prev_tokens=prev_tokens)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> List[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")
