"""h2o_local: H2O (Heavy-Hitter Oracle) KV-cache eviction for local inference on a patched llama.cpp.

    from h2o_local import Llama
    llm = Llama("model.gguf", budget=128)          # at most 128 KV entries per sequence
    print(llm.generate("The capital of France is", max_tokens=32))
"""
__version__ = "0.1.0"  # first: modules of the package read it while they load

from . import llama_types, models, policies
from .backends import Device, devices, gpu_offload_supported
from .llama import KVState, Llama, Snapshot
from .model_info import ModelInfo
from .policies import H2O, TOVA, Full, H2OHeadNorm, H2OMaxHead, H2ONorm, KeyDiff, Local, Policy, Sink, SnapKV
from .sampling import SamplingParams

__all__ = ["Llama", "KVState", "Snapshot", "ModelInfo", "SamplingParams", "Policy", "H2O", "H2ONorm", "H2OMaxHead", "H2OHeadNorm", "TOVA", "SnapKV", "KeyDiff", "Local", "Sink", "Full", "policies",
           "llama_types", "models", "Device", "devices", "gpu_offload_supported", "__version__"]
