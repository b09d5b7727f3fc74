"""How close two runs must be when they add the same numbers in another order or on another backend: on the CPU
backend, within itself, the float order's own rounding (each test states what it measured); on a device (Vulkan,
CUDA, Metal), which computes attention in its own precision and order (F16 products, flash attention's blocked sums,
on by default there), the device's, as tests/engine/test_device.py compares it: logits within 2% of their spread, exported
scores within 2% relative L1 (docs/gpu.md), rankings rather than bits. Measured on lavapipe with flash attention:
moving cells changed the tiny model's logits by up to 1.3e-2 (spread ~5) and one small TOVA score by 2.4%."""
from __future__ import annotations

import numpy as np

# the CPU backend of the same build: layers on the CPU, and their large batches not sent to a device either
# (llama.cpp's op_offload), for the checks of the CPU's own arithmetic
CPU_BACKEND = dict(n_gpu_layers=0, op_offload=False)

DEVICE_LOGITS_REL = 2e-2  # of the logits' spread (max - min)
DEVICE_VALUES_REL_L1 = 2e-2  # sum |a - b| / sum |b|: exported scores, cached keys


def on_device(llm) -> bool:
    """True when any layer of `llm` runs on a device rather than the CPU backend."""
    return any(d != "CPU" for d in llm.layer_devices)


def approximate(llm) -> bool:
    """True where `llm`'s attention adds in a device's precision: a layer on a device, or flash attention, whose CPU
    kernel multiplies in F16 as a device does (the suite with H2O_LOCAL_TEST_FLASH_ATTN=1 runs CUDA's default on the
    CPU): two of its runs that add in another order are compared at the device's tolerance."""
    return on_device(llm) or bool(llm.flash_attn)


def assert_logits_close(got: np.ndarray, expected: np.ndarray, *, device: bool, cpu_atol: float,
                        cpu_rtol: float = 0.0) -> None:
    if device:
        np.testing.assert_allclose(got, expected, atol=DEVICE_LOGITS_REL * float(np.ptp(expected)))
    else:
        np.testing.assert_allclose(got, expected, rtol=cpu_rtol, atol=cpu_atol)


def assert_values_close(got: np.ndarray, expected: np.ndarray, *, device: bool, cpu_rtol: float,
                        cpu_atol: float = 1e-5) -> None:
    """Scores, keys: elementwise on the CPU; on a device as a whole (relative L1), since a small entry's relative
    error says little there."""
    if device:
        rel_l1 = float(np.abs(got - expected).sum() / np.abs(expected).sum())
        assert rel_l1 <= DEVICE_VALUES_REL_L1, f"{rel_l1:.2e} apart (relative L1)"
    else:
        np.testing.assert_allclose(got, expected, rtol=cpu_rtol, atol=cpu_atol)


def assert_same_choice(kept, expected, ranking: np.ndarray, *, device: bool) -> None:
    """The positions a policy kept against those a reference keeps, by the reference's `ranking` (its scores, by
    position). Exactly on the CPU backend; on a device, whose scores round otherwise, only a near tie at the cut may
    differ: as many entries kept on each side alone, and by the reference, the best entry the device dropped scoring
    at most DEVICE_VALUES_REL_L1 times the largest score of all above the worst it kept instead."""
    kept, expected = [int(p) for p in kept], [int(p) for p in expected]
    if not device:
        assert kept == expected
        return
    assert len(kept) == len(expected)
    gained, lost = sorted(set(kept) - set(expected)), sorted(set(expected) - set(kept))
    if gained:
        tolerance = DEVICE_VALUES_REL_L1 * float(np.abs(ranking[np.isfinite(ranking)]).max())
        gap = float(ranking[lost].max() - ranking[gained].min())
        assert gap <= tolerance, f"kept {gained} instead of {lost}: {gap:.3g} apart by the reference (> {tolerance:.3g})"
