#!/usr/bin/env bash
# What one lease of a GPU machine runs (the device tool: one command of at most 10 minutes, at most 8 files back, 15
# minutes of device time in all, the machine's start included), in two parts a warm machine runs back to back (it is
# given back 30 s after a call, and kills what a call left running unless it started a session of its own).
# Everything goes to /tmp/gpuout and is packed into $OUT/gpu.tgz after each step, so a step cut off at the limit
# still leaves the ones before it.
#
#   bash scripts/gpu-lease.sh 1   # our build, the suite (14 workers, each failure's traceback as it comes): ~9 min
#   bash scripts/gpu-lease.sh 2   # the table at 8k / 32k and at 128k beside llama.cpp's own API in this build, then
#                                 # decode with and without CUDA graphs, then what compaction and recall transfer
#
# Carry .devicetree and .devicepkgs, made here first by scripts/gpu-carry.sh (again whenever vendor/patches change).
# What sized it: the H200 lease of 2026-11-27, the machine's start about 35 s, our CUDA build 252 s, the suite with 14
# workers 99% done in 200 s, the 8k / 32k table of eight settings about 60 s. The peer (llama-cpp-python, unpatched)
# was not built in time on two leases (its compile starved by ours and the suite's): PEER=1 starts it anyway, and
# the "llama.cpp" settings (llama.cpp's own API in our build, nothing of ours around it) stand in for it.
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
    # in sessions of their own, so that they outlive this call: the model, and the peer's build (low priority) if asked
    [ "${PEER:-0}" = 1 ] && setsid bash -c "CMAKE_BUILD_PARALLEL_LEVEL=6 nice -n 10 bash scripts/gpu.sh peer > $OUT/peer.out 2>&1" &
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
    for _ in $(seq 60); do [ -f $MODEL ] && break; sleep 2; done
    # the probe's cost (the default without it: tova-256+s4+r32; +noride: the probe in a decode of its own, as before
    # patch 0014), the score export's (local-256 evicts without scores) and the chunk size's (+batch2048) beside the
    # rest; the time by part says which of the prompt's decodes,
    # compaction or the host's bookkeeping a 512-token chunk pays over the full cache's (14 ms on the H200)
    # and llama.cpp's own default batches (n_batch 2048 in ubatches of 512: four times fewer evictions and probes,
    # the compute buffers of 512)
    SETTINGS="full+fa $DEFAULT+fa $DEFAULT+fa+noride h2o-256 $DEFAULT tova-256+s4+r32+fa local-256+fa full+fa+batch2048 $DEFAULT+fa+batch2048
              full+fa+batch2048+ubatch512 $DEFAULT+fa+batch2048+ubatch512"
    bash scripts/gpu.sh bench -- --depths 8192 32768 --settings $SETTINGS --only $SETTINGS llama.cpp+fa \
        llama-cpp-python+fa
    pack bench-8k-32k
    # issue 51's decode target at depth (>= 2x the full cache at 128k), each beside llama.cpp's own
    OUT=$OUT/deep bash scripts/gpu.sh bench -- --depths 131072 --settings full+fa $DEFAULT+fa \
        --only full+fa $DEFAULT+fa llama.cpp+fa
    pack bench-128k
    # each run above follows a warm-up of the same prompt (llama-bench's way); cold, the first prompt of a process
    # also loads the kernels it uses first: the 8k figures of the last lease (0.50x) were cold, device_copies' warm
    OUT=$OUT/cold bash scripts/gpu.sh bench -- --depths 8192 --warmup-tokens 0 --settings full+fa $DEFAULT+fa \
        --only full+fa $DEFAULT+fa llama.cpp+fa
    pack bench-cold
    # chat and serve read prompts in chunks of 128 tokens (their --n-batch): what that costs a GPU's prompt
    OUT=$OUT/batch128 bash scripts/gpu.sh bench -- --depths 8192 --n-batch 128 --settings full+fa $DEFAULT+fa \
        --only full+fa $DEFAULT+fa llama.cpp+fa
    pack bench-batch128
    bash scripts/gpu.sh graphs
    pack graphs
    # what compaction and recall pay in transfers (patch 0013: a few per tensor; thousands per prompt before it)
    python -m benchmarks.device_copies --model "$MODEL" --depth 8192 --repeats 2 --out "$OUT/device-copies"
    pack device-copies
    ;;
esac
