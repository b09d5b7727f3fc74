"""scripts/gpu.sh, the GPU check in one command: which GPU it finds and what it would build for it (`detect`, which
runs nothing else), on a PATH of stand-ins for nvidia-smi, vulkaninfo, uname and sysctl, so that the machine's own
GPU, if any, plays no part."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "dirname", "grep", "sed", "tr", "head", "mkdir", "ln", "python3", "python")


def fake_tool(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(0o755)


def run_detect(tmp_path: Path, fakes: dict, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        real = shutil.which(tool)
        if real and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(real)
    fake_tool(bin_dir, "uname", 'echo Linux\n')
    for name, script in fakes.items():
        fake_tool(bin_dir, name, script)
    environ = {"PATH": str(bin_dir), "HOME": str(tmp_path), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "detect"], env=environ, capture_output=True,
                          text=True, timeout=60)


NVIDIA_SMI = """case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)" ;;
  *name*) echo "NVIDIA H200" ;;
  *compute_cap*) echo "9.0" ;;
esac
"""


def test_an_nvidia_card_is_built_for_its_own_architecture_and_named_in_the_results(tmp_path):
    out = run_detect(tmp_path, {"nvidia-smi": NVIDIA_SMI})
    assert out.returncode == 0, out.stderr
    assert "GPU: NVIDIA H200 (cuda)" in out.stdout
    assert '-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"' in out.stdout
    assert "results: results/gpu/h200" in out.stdout
    assert not (ROOT / "results" / "gpu" / "h200").exists()  # detect writes nothing


def test_cuda_arch_and_the_results_folder_can_be_named(tmp_path):
    out = run_detect(tmp_path, {"nvidia-smi": NVIDIA_SMI}, CUDA_ARCH="89", OUT="/tmp/elsewhere")
    assert "-DCMAKE_CUDA_ARCHITECTURES=89" in out.stdout and "results: /tmp/elsewhere" in out.stdout


def test_a_driver_without_compute_cap_builds_for_the_native_architecture(tmp_path):
    old_smi = NVIDIA_SMI.replace('*compute_cap*) echo "9.0" ;;', '*compute_cap*) exit 2 ;;')
    out = run_detect(tmp_path, {"nvidia-smi": old_smi})
    assert "-DCMAKE_CUDA_ARCHITECTURES=native" in out.stdout


VULKANINFO = """echo "GPU0:"
echo "    deviceType         = PHYSICAL_DEVICE_TYPE_{kind}"
echo "    deviceName         = {name}"
"""


def test_a_vulkan_gpu_is_found_but_a_vulkan_device_on_the_cpu_is_not(tmp_path):
    amd = VULKANINFO.format(kind="DISCRETE_GPU", name="AMD Radeon RX 7900 XTX (RADV NAVI31)")
    out = run_detect(tmp_path, {"vulkaninfo": amd})
    assert out.returncode == 0, out.stderr
    assert 'GPU: AMD Radeon RX 7900 XTX (RADV NAVI31) (vulkan); build: CMAKE_ARGS="-DGGML_VULKAN=on"' in out.stdout
    assert "results: results/gpu/rx-7900-xtx-radv-navi31" in out.stdout

    lavapipe = VULKANINFO.format(kind="CPU", name="llvmpipe (LLVM 15.0.6, 256 bits)")
    (tmp_path / "cpu").mkdir()
    out = run_detect(tmp_path / "cpu", {"vulkaninfo": lavapipe})
    assert out.returncode == 2 and "no GPU found" in out.stderr


def test_a_mac_builds_metal(tmp_path):
    out = run_detect(tmp_path, {"uname": 'echo Darwin\n', "sysctl": 'echo "Apple M3 Max"\n'})
    assert out.returncode == 0, out.stderr
    assert 'GPU: Apple M3 Max (metal); build: CMAKE_ARGS="-DGGML_METAL=on"' in out.stdout
    assert "results: results/gpu/m3-max" in out.stdout


@pytest.mark.parametrize("env", [{}, {"GPU_BACKEND": "opencl"}])
def test_no_gpu_is_a_clear_error_that_runs_nothing(tmp_path, env):
    out = run_detect(tmp_path, {}, **env)
    assert out.returncode == 2 and out.stdout == ""
    assert "no GPU found" in out.stderr and "GPU_BACKEND=cuda|metal|vulkan" in out.stderr
    if env:
        assert "unknown GPU_BACKEND 'opencl'" in out.stderr


def test_a_backend_can_be_named_where_detection_finds_none(tmp_path):
    out = run_detect(tmp_path, {}, GPU_BACKEND="vulkan")
    assert out.returncode == 0 and '(vulkan); build: CMAKE_ARGS="-DGGML_VULKAN=on"' in out.stdout
