"""The compute devices this build of h2o_local can use (llama.cpp's ggml backends).

    >>> import h2o_local
    >>> [d.name for d in h2o_local.devices()]          # a CPU build: ['CPU']; a Vulkan build on a laptop: ['Vulkan0', 'CPU']
    >>> h2o_local.gpu_offload_supported()               # whether n_gpu_layers can put anything on a GPU here

Which backend is built in is chosen at install time (README, "GPU backends"). A Vulkan build leaves devices of type
CPU (Mesa's lavapipe) out unless `GGML_VK_VISIBLE_DEVICES` selects them, as llama.cpp does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from . import _engine


@dataclass(frozen=True)
class Device:
    name: str           # ggml's name: "CPU", "Vulkan0", "CUDA0", "Metal"
    description: str    # the driver's: "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H100 80GB HBM3"
    type: str           # "cpu", "gpu", "igpu" (integrated) or "accel"
    memory_free: int    # bytes
    memory_total: int   # bytes


def devices() -> List[Device]:
    """The devices this build and machine offer, in ggml's order (GPUs first)."""
    return [Device(**d) for d in _engine.backend_devices()]


def gpu_offload_supported() -> bool:
    """True when a GPU (discrete or integrated) is there for `n_gpu_layers` (llama.cpp's llama_supports_gpu_offload)."""
    return any(d.type in ("gpu", "igpu") for d in devices())


def where_layers_run(layer_devices: Sequence[str]) -> str:
    """`Llama.layer_devices` in a few words: "CPU", "Vulkan0", or "CPU + Vulkan0 (20 of 30 layers off the CPU)"."""
    names = sorted(set(layer_devices), key=list(layer_devices).index)
    if len(names) == 1:
        return names[0]
    off = sum(d != "CPU" for d in layer_devices)
    return f"{' + '.join(names)} ({off} of {len(layer_devices)} layers off the CPU)"
