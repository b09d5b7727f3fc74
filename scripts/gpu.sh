#!/usr/bin/env bash
# On a CUDA machine with no registry, with .devicetree and .devicepkgs carried beside the repository (made here by
# scripts/gpu-carry.sh: the patched tree, the wheels the machine lacks, and the peer, llama-cpp-python 0.3.36's sdist,
# the same llama.cpp unpatched): build the CUDA extension, run the suite with every layer offloaded, write a
# random-weight Qwen2.5-1.5B-shaped GGUF and benchmark the given settings on it. Results go to $OUT (or results/gpu).
# scripts/gpu-lease.sh runs these steps within one lease of the device tool.
# SHAPE picks the random model (benchmarks/random_model.py: qwen2.5-1.5b by default, llama-3.1-8b the laptop case).
#
#   bash scripts/gpu.sh deps build tests peer bench                 # the default settings and depths below
#   bash scripts/gpu.sh graphs                                      # decode with and without CUDA graphs (issue 51.6)
#   bash scripts/gpu.sh bench -- --depths 8192 32768 --settings full h2o-256 snapkv-256
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
SHAPE=${SHAPE:-qwen2.5-1.5b}
TAG=${SHAPE//./}  # in report names, whose suffix Path.with_suffix would take the shape's dots for
# full and the default policy at 256, each with and without flash attention (the library's default on CUDA), h2o
DEFAULT_BENCH=(--depths 8192 32768 65536 131072 --settings full full+fa h2o-256 tova-256+s4+q32+p9+f12+r32
               tova-256+s4+q32+p9+f12+r32+fa)
mkdir -p "$OUT"
# the image's python is python3 only
command -v python >/dev/null || { mkdir -p /tmp/pybin; ln -sf "$(command -v python3)" /tmp/pybin/python; export PATH=/tmp/pybin:$PATH; }
# the pruned, patched llama.cpp tree carried beside the repository (scripts/gpu-carry.sh)
[ -d .devicetree/llama.cpp ] && export H2O_LOCAL_LLAMA_CPP_DIR=${H2O_LOCAL_LLAMA_CPP_DIR:-$PWD/.devicetree/llama.cpp}
steps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do steps+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift

for step in "${steps[@]}"; do
    case "$step" in
    deps)
        python -m pip install -q --no-index --find-links .devicepkgs scikit-build-core pybind11 gguf hypothesis tqdm jinja2 pexpect fastapi uvicorn sse-starlette openai ollama anthropic pydantic-settings prometheus-client diskcache 2>&1 | tail -3
        ;;
    build)
        start=$(date +%s)
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" \
            python -m pip install --no-deps --no-build-isolation . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
        echo "build: $(( $(date +%s) - start )) s"
        ;;
    tests)
        # first the sequence that aborted (a Llama after an RPC server died), then the rest, a file per worker
        # each failure's traceback is written as it comes (tests/conftest.py), so a run cut off still says why
        # no registry there: the tests of SmolLM2 (pip's download) skip rather than fail
        export H2O_LOCAL_SKIP_SLOW=1 H2O_LOCAL_TEST_N_GPU_LAYERS=-1 H2O_LOCAL_FAILURES_LOG=$OUT/failures.log \
            H2O_LOCAL_OFFLINE=1
        python -m pytest -q -p no:cacheprovider tests/engine/test_rpc.py tests/engine/test_scores.py \
            > "$OUT/tests-rpc-then-scores.log" 2>&1
        echo "rpc then scores: rc $?"; tail -3 "$OUT/tests-rpc-then-scores.log"
        # -v names each result as it comes (a run cut off at the lease's limit still says which failed); a test that
        # hangs is stopped after 90 s (pytest-timeout, in the image)
        timeout "${TESTS_TIMEOUT:-600}" python -m pytest -v --tb=short -p no:cacheprovider -p no:benchmark \
            -n "${TESTS_WORKERS:-4}" --dist loadfile --timeout 90 tests --ignore=tests/experiments/test_experiments.py > "$OUT/tests.log" 2>&1
        echo "suite: rc $?"; grep -E " (FAILED|ERROR) |crashed|Timeout| passed| failed" "$OUT/tests.log" | tail -40
        ;;
    peer)
        start=$(date +%s)
        # without its multimodal library, which the benchmark never loads
        CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" python -m pip install --no-deps --no-build-isolation \
            --no-index --find-links .devicepkgs "llama-cpp-python==0.3.36" > "$OUT/peer-build.log" 2>&1 \
            || { tail -20 "$OUT/peer-build.log"; echo "peer: not built (bench runs without it)"; }
        echo "peer build: $(( $(date +%s) - start )) s"
        ;;
    bench)
        model=/tmp/$SHAPE-random.gguf
        [ -f "$model" ] || python benchmarks/random_model.py --shape "$SHAPE" --out "$model"
        [ $# -gt 0 ] || set -- "${DEFAULT_BENCH[@]}"
        # beside ours: llama.cpp's own API in this build (the "llama.cpp" settings), and llama-cpp-python (plain
        # llama.cpp) when step peer installed it
        python -m benchmarks.bench --model "$model" --n-gpu-layers -1 --repeats 1 --out "$OUT/bench-$TAG" "$@" 2>&1 \
            | tail -60
        ;;
    graphs)
        # where decode's time goes: the same settings at 8k with llama.cpp's CUDA graphs allowed and disabled; a
        # setting whose decode does not change was launched op by op anyway (its graph changed every step)
        model=/tmp/$SHAPE-random.gguf
        [ -f "$model" ] || python benchmarks/random_model.py --shape "$SHAPE" --out "$model"
        for graphs in on off; do
            env $([ "$graphs" = off ] && echo GGML_CUDA_DISABLE_GRAPHS=1) python -m benchmarks.bench --model "$model" \
                --n-gpu-layers -1 --repeats 1 --decode-tokens 128 --depths 8192 --no-peer \
                --out "$OUT/graphs-$graphs-$TAG" --settings full+fa tova-256+s4+q32+p9+f12+r32+fa 2>&1 | tail -12
        done
        # and why: ggml-cuda's log of a 32-token decode per setting (captured once and replayed, or reset every step)
        python -m benchmarks.cuda_graphs --model "$model" --depth 2048 --steps 32 --out "$OUT/cuda-graphs-$TAG" \
            --settings full+fa tova-256+s4+q32+p9+f12+r32+fa h2o-256 full \
            $(python -c "import llama_cpp" 2>/dev/null && echo llama-cpp-python+fa) 2>&1 | tail -8
        ;;
    *) echo "unknown step $step (deps, build, tests, peer, bench, graphs)"; exit 2 ;;
    esac
done
