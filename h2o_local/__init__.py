"""h2o_local: H2O (Heavy-Hitter Oracle) KV-cache eviction for local inference on a patched llama.cpp.

    from h2o_local import Llama
    llm = Llama("model.gguf", budget=128)          # at most 128 KV entries per sequence
    print(llm.generate("The capital of France is", max_tokens=32))
"""
from .llama import KVState, Llama
from . import models

__version__ = "0.1.0"
__all__ = ["Llama", "KVState", "models", "__version__"]
