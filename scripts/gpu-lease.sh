#!/usr/bin/env bash
# What one lease of a GPU machine runs (the device tool: one command of at most 10 minutes, at most 8 files back), in
# two parts a warm machine runs back to back: part 1 builds ours and the peer side by side, runs the suite and the
# 8k / 32k benchmark; part 2 the 128k benchmark and the CUDA-graphs comparison. Everything goes to /tmp/gpuout and is
# packed into $OUT/gpu.tgz after each step, so a step cut off at the limit still leaves the ones before it.
#
#   bash scripts/gpu-lease.sh 1        # carry .devicetree and .devicepkgs (scripts/gpu.sh says what they hold)
#   bash scripts/gpu-lease.sh 2
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
    nproc
    bash scripts/gpu.sh deps
    command -v python >/dev/null || { mkdir -p /tmp/pybin; ln -sf "$(command -v python3)" /tmp/pybin/python; export PATH=/tmp/pybin:$PATH; }
    (python benchmarks/random_model.py --shape qwen2.5-1.5b --out $MODEL.part > "$OUT/model.log" 2>&1 \
        && mv $MODEL.part $MODEL) &
    model_pid=$!
    (CMAKE_BUILD_PARALLEL_LEVEL=8 nice -n 10 bash scripts/gpu.sh peer > "$OUT/peer.out" 2>&1) &
    peer_pid=$!
    CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 360 bash scripts/gpu.sh build
    python -c "import h2o_local; print(h2o_local.devices())"
    pack build
    TESTS_TIMEOUT=${TESTS_TIMEOUT:-170} TESTS_WORKERS=6 bash scripts/gpu.sh tests
    pack tests
    wait $model_pid; wait $peer_pid; cat "$OUT/peer.out"
    python -c "import llama_cpp; print('peer', llama_cpp.__version__)"
    bash scripts/gpu.sh bench -- --depths 8192 32768 --settings full full+fa h2o-256 $DEFAULT $DEFAULT+fa
    pack bench-8k-32k
    ;;
2)
    command -v python >/dev/null || export PATH=/tmp/pybin:$PATH
    OUT=$OUT/128k bash scripts/gpu.sh bench -- --depths 131072 --settings full+fa h2o-256 $DEFAULT+fa \
        --only full+fa h2o-256 $DEFAULT+fa llama-cpp-python+fa
    pack bench-128k
    bash scripts/gpu.sh graphs
    pack graphs
    ;;
esac
