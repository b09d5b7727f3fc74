#!/usr/bin/env bash
# What one lease of a GPU machine runs (the device tool: one command of at most 10 minutes, at most 8 files back, 15
# minutes of device time in all, the machine's start included), in two parts a warm machine runs back to back (it is
# given back 30 s after a call, and kills what a call left running unless it started a session of its own).
# Everything goes to /tmp/gpuout and is packed into $OUT/gpu.tgz after each step, so a step cut off at the limit
# still leaves the ones before it.
#
#   bash scripts/gpu-lease.sh 1   # the peer's build started aside; our build, the suite (14 workers): ~9 minutes
#   bash scripts/gpu-lease.sh 2   # the table at 8k / 32k beside the peer, then decode with and without CUDA graphs
#
# Carry .devicetree and .devicepkgs, made here first by scripts/gpu-carry.sh (again whenever vendor/patches change). The H100 lease of 2026-11-26 measured what
# this is sized by: the machine's start about 1 minute, our CUDA build 328 s with the peer compiling beside it, the
# suite not done with 6 workers in 170 s nor with 14 in 185 s, a table of four settings at 8k and 32k 30 s.
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
    # in sessions of their own, so that they outlive this call: the peer's build (low priority) and the model
    setsid bash -c "CMAKE_BUILD_PARALLEL_LEVEL=6 nice -n 10 bash scripts/gpu.sh peer > $OUT/peer.out 2>&1; touch /tmp/peer.done" &
    setsid bash -c "python benchmarks/random_model.py --shape qwen2.5-1.5b --out $MODEL.part > $OUT/model.log 2>&1 \
        && mv $MODEL.part $MODEL" &
    CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 330 bash scripts/gpu.sh build
    python -c "import h2o_local; print(h2o_local.devices())"
    pack build
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-240} TESTS_WORKERS=14 bash scripts/gpu.sh tests
    pack tests
    ;;
2)
    command -v python >/dev/null || export PATH=/tmp/pybin:$PATH
    for _ in $(seq 60); do [ -f /tmp/peer.done ] && [ -f $MODEL ] && break; sleep 2; done
    cat "$OUT/peer.out"
    # the probe's cost (the default without it: tova-256+s4+r32) and the chunk size's (+batch2048) beside the rest
    bash scripts/gpu.sh bench -- --depths 8192 32768 --settings full+fa $DEFAULT+fa h2o-256 $DEFAULT \
        tova-256+s4+r32+fa full+fa+batch2048 $DEFAULT+fa+batch2048 --only full+fa $DEFAULT+fa h2o-256 $DEFAULT \
        tova-256+s4+r32+fa full+fa+batch2048 $DEFAULT+fa+batch2048 llama-cpp-python+fa
    pack bench-8k-32k
    bash scripts/gpu.sh graphs
    pack graphs
    # what compaction and recall pay in transfers (patch 0013: a few per tensor; thousands per prompt before it)
    python -m benchmarks.device_copies --model "$MODEL" --depth 8192 --repeats 2 --out "$OUT/device-copies"
    pack device-copies
    ;;
esac
