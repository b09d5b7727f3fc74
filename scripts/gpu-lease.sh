#!/usr/bin/env bash
# What one lease of a GPU machine runs (the device tool: one command of at most 10 minutes, at most 8 files back, 15
# minutes of device time in all, the machine's start included), in two parts a warm machine runs back to back (it is
# given back 30 s after a call). Everything goes to /tmp/gpuout and is packed into $OUT/gpu.tgz after each step, so a
# step cut off at the limit still leaves the ones before it.
#
#   bash scripts/gpu-lease.sh 1   # build, the suite (14 workers), the 8k / 32k table: about 9 minutes on an H100
#   bash scripts/gpu-lease.sh 2   # the peer (plain llama.cpp through llama-cpp-python) and the table beside it
#
# Carry .devicetree and .devicepkgs (scripts/gpu.sh says what they hold). The H100 lease of 2026-11-26 measured what
# this is sized by: our CUDA build 328 s with the peer compiling beside it (so the peer waits for part 2), the suite
# with 6 workers not done in 170 s nor with 14 in 185 s, the 8k / 32k table of four settings 30 s.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
LEASE_OUT=${OUT:-/tmp/lease-out}
export OUT=/tmp/gpuout
mkdir -p "$OUT" "$LEASE_OUT"
MODEL=/tmp/qwen2.5-1.5b-random.gguf
DEFAULT=tova-256+s4+q32+p9+f12+r32
pack() { tar czf "$LEASE_OUT/gpu.tgz" -C /tmp gpuout; echo "[$(date +%T)] $1"; }

case "${1:-1}" in
1)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
    bash scripts/gpu.sh deps
    command -v python >/dev/null || { mkdir -p /tmp/pybin; ln -sf "$(command -v python3)" /tmp/pybin/python; export PATH=/tmp/pybin:$PATH; }
    (python benchmarks/random_model.py --shape qwen2.5-1.5b --out $MODEL.part > "$OUT/model.log" 2>&1 \
        && mv $MODEL.part $MODEL) &
    model_pid=$!
    CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 bash scripts/gpu.sh build
    python -c "import h2o_local; print(h2o_local.devices())"
    pack build
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-200} TESTS_WORKERS=14 bash scripts/gpu.sh tests
    pack tests
    wait $model_pid
    # the probe's cost (the default without it: tova-256+s4+r32) and the chunk size's (+batch2048) beside the rest
    bash scripts/gpu.sh bench -- --depths 8192 32768 --no-peer --settings full+fa $DEFAULT+fa h2o-256 $DEFAULT \
        tova-256+s4+r32+fa full+fa+batch2048 $DEFAULT+fa+batch2048
    pack bench-8k-32k
    ;;
2)
    command -v python >/dev/null || export PATH=/tmp/pybin:$PATH
    CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 bash scripts/gpu.sh peer
    pack peer
    OUT=$OUT/peer bash scripts/gpu.sh bench -- --depths 8192 131072 --settings full+fa $DEFAULT+fa \
        --only full+fa $DEFAULT+fa llama-cpp-python+fa
    pack bench-peer
    bash scripts/gpu.sh graphs
    pack graphs
    ;;
esac
