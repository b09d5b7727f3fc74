"""How many threads a CPU run should use by default: the physical cores this process may run on (as llama.cpp's
cpu_get_num_physical_cores and llama-cpp-python do; hyper-threads share a core's arithmetic units and slow
matrix products down)."""
from __future__ import annotations

import os
import subprocess
import sys


def physical_cores() -> int:
    """Physical cores available to this process (at least 1): on Linux the distinct sibling sets of the CPUs in
    its affinity mask, on macOS the performance cores, elsewhere half the logical CPUs."""
    if hasattr(os, "sched_getaffinity"):
        try:
            cpus = os.sched_getaffinity(0)
            cores = set()
            for cpu in cpus:
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                    cores.add(f.read().strip())
            return max(1, len(cores))
        except OSError:
            return max(1, len(os.sched_getaffinity(0)) // 2 or 1)
    if sys.platform == "darwin":
        for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
                if out.returncode == 0 and out.stdout.strip().isdigit():
                    return max(1, int(out.stdout))
            except (OSError, subprocess.SubprocessError):
                pass
    return max(1, (os.cpu_count() or 2) // 2)
