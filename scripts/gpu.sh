#!/usr/bin/env bash
# The GPU check in one command, on a machine with an NVIDIA (CUDA), Apple (Metal) or other Vulkan GPU:
#
#   bash scripts/gpu.sh
#
# finds the GPU, builds the extension for it, runs the whole suite with every layer on it, and benchmarks full, h2o
# and the default policy (with and without flash attention) at 8k-128k tokens beside llama.cpp's own API in the same
# build, on a random-weight GGUF in Qwen2.5-1.5B's shapes (SHAPE=llama-3.1-8b: the laptop case). Results go to $OUT
# (default results/gpu/<card>). Steps can be named instead (`detect deps build tests peer bench graphs`; the default
# is all but peer; graphs only on CUDA), and what follows `--` goes to benchmarks.bench:
#
#   bash scripts/gpu.sh detect                                      # which GPU, backend and build flags: nothing else
#   bash scripts/gpu.sh graphs                                      # decode with and without CUDA graphs (issue 51.6)
#   bash scripts/gpu.sh bench -- --depths 8192 32768 --settings full h2o-256 snapkv-256
#
# GPU_BACKEND=cuda|metal|vulkan overrides what detect finds, CUDA_ARCH the CUDA architecture (default: the card's own,
# from nvidia-smi). With PyPI at hand it installs what it needs itself; on a machine with no registry (the device tool's)
# it reads .devicetree and .devicepkgs carried beside the repository, made by scripts/gpu-carry.sh, and
# scripts/gpu-lease.sh runs these steps within one lease.
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE=${SHAPE:-qwen2.5-1.5b}
TAG=${SHAPE//./}  # in report names, whose suffix Path.with_suffix would take the shape's dots for
# full and the default policy at 256, each with and without flash attention (the library's default on a GPU), h2o;
# the bench adds llama.cpp's own API in this build both ways (and llama-cpp-python where step peer installed it)
DEFAULT_BENCH=(--depths 8192 32768 65536 131072 --settings full full+fa h2o-256 tova-256+s4+q32+p9+f12+r32
               tova-256+s4+q32+p9+f12+r32+fa)
# the image's python is python3 only
command -v python >/dev/null || { mkdir -p /tmp/pybin; ln -sf "$(command -v python3)" /tmp/pybin/python; export PATH=/tmp/pybin:$PATH; }
# no registry: the pruned, patched llama.cpp tree and the wheels carried beside the repository (scripts/gpu-carry.sh)
OFFLINE=0
[ -d .devicepkgs ] && OFFLINE=1

detect_backend() {  # cuda, metal or vulkan: the first GPU found (a Vulkan device on the CPU, lavapipe, is none)
    if [ -n "${GPU_BACKEND:-}" ]; then
        echo "$GPU_BACKEND"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
        echo cuda
    elif [ "$(uname -s)" = Darwin ]; then
        echo metal
    elif command -v vulkaninfo >/dev/null 2>&1 \
            && vulkaninfo --summary 2>/dev/null | grep -Eq "PHYSICAL_DEVICE_TYPE_(DISCRETE|INTEGRATED)_GPU"; then
        echo vulkan
    fi
}

card_name() {
    case "$1" in
    cuda)   nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 ;;
    metal)  sysctl -n machdep.cpu.brand_string 2>/dev/null || echo "Apple GPU" ;;
    vulkan) vulkaninfo --summary 2>/dev/null | grep -A3 -E "PHYSICAL_DEVICE_TYPE_(DISCRETE|INTEGRATED)_GPU" \
                | sed -n 's/.*deviceName *= *//p' | head -1 ;;
    esac
}

cmake_args() {
    case "$1" in
    cuda)
        # the card's own architecture only (a build for every one takes several times as long)
        local arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')}
        echo "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${arch:-native}" ;;
    metal)  echo "-DGGML_METAL=on" ;;
    vulkan) echo "-DGGML_VULKAN=on" ;;
    *)      return 1 ;;
    esac
}

BACKEND=$(detect_backend)
if [ -z "$BACKEND" ] || ! CMAKE_GPU_ARGS=$(cmake_args "$BACKEND"); then
    echo "scripts/gpu.sh: no GPU found${BACKEND:+ (unknown GPU_BACKEND '$BACKEND')}: it needs an NVIDIA GPU with nvidia-smi," \
         "a Mac, or a Vulkan GPU that vulkaninfo lists (GPU_BACKEND=cuda|metal|vulkan to name one)" >&2
    exit 2
fi
# (the carried tree keeps the CPU, CUDA and RPC backends only)
[ "$BACKEND" = cuda ] && [ -d .devicetree/llama.cpp ] \
    && export H2O_LOCAL_LLAMA_CPP_DIR=${H2O_LOCAL_LLAMA_CPP_DIR:-$PWD/.devicetree/llama.cpp}
CARD=$(card_name "$BACKEND")
CARD=${CARD:-$BACKEND GPU}
SLUG=$(echo "$CARD" | tr 'A-Z' 'a-z' | sed -E 's/(nvidia|geforce|apple|amd|radeon)//g; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')
OUT=${OUT:-results/gpu/${SLUG:-$BACKEND}}

steps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do steps+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#steps[@]} -eq 0 ]; then
    steps=(detect deps build tests bench)
    [ "$BACKEND" = cuda ] && steps+=(graphs)
fi

for step in "${steps[@]}"; do
    [ "$step" = detect ] || mkdir -p "$OUT"
    case "$step" in
    detect)
        echo "GPU: $CARD ($BACKEND); build: CMAKE_ARGS=\"$CMAKE_GPU_ARGS\"; packages: $([ $OFFLINE = 1 ] && echo .devicepkgs || echo PyPI); results: $OUT"
        ;;
    deps)
        if [ $OFFLINE = 1 ]; then
            python -m pip install -q --no-index --find-links .devicepkgs scikit-build-core pybind11 gguf hypothesis tqdm jinja2 pexpect fastapi uvicorn sse-starlette openai ollama anthropic pydantic-settings prometheus-client diskcache 2>&1 | tail -3
        else  # the test extra comes with the build
            python -m pip install -q scikit-build-core pybind11 pytest-xdist pytest-timeout 2>&1 | tail -3
        fi
        ;;
    build)
        start=$(date +%s)
        [ -f "$OUT/card.txt" ] || echo "$CARD ($BACKEND)" > "$OUT/card.txt"
        if [ $OFFLINE = 1 ]; then target=(--no-deps .); else target=(".[test]"); fi
        CMAKE_ARGS="$CMAKE_GPU_ARGS" python -m pip install --no-build-isolation --config-settings=build-dir="build/$BACKEND" \
            "${target[@]}" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
        echo "build: $(( $(date +%s) - start )) s"
        ;;
    tests)
        # first the sequence that aborted (a Llama after an RPC server died), then the rest, a file per worker
        # each failure's traceback is written as it comes (tests/conftest.py), so a run cut off still says why
        # no registry: the tests of SmolLM2 (pip's download) skip rather than fail
        export H2O_LOCAL_SKIP_SLOW=1 H2O_LOCAL_TEST_N_GPU_LAYERS=-1 H2O_LOCAL_FAILURES_LOG=$OUT/failures.log \
            H2O_LOCAL_REQUIRE_DEVICE=1
        [ $OFFLINE = 1 ] && export H2O_LOCAL_OFFLINE=1
        rm -f "$OUT/failures.log"
        python -m pytest -q -p no:cacheprovider tests/engine/test_rpc.py tests/engine/test_scores.py \
            > "$OUT/tests-rpc-then-scores.log" 2>&1
        echo "rpc then scores: rc $?"; tail -3 "$OUT/tests-rpc-then-scores.log"
        # -v names each result as it comes (a run cut off at the lease's limit still says which failed); a test that
        # hangs is stopped after 90 s (pytest-timeout)
        timeout "${TESTS_TIMEOUT:-1800}" python -m pytest -v --tb=short -p no:cacheprovider -p no:benchmark \
            -n "${TESTS_WORKERS:-4}" --dist loadfile --timeout 90 tests --ignore=tests/experiments/test_experiments.py > "$OUT/tests.log" 2>&1
        echo "suite: rc $?"; grep -E " (FAILED|ERROR) |crashed|Timeout| passed| failed" "$OUT/tests.log" | tail -40
        ;;
    peer)
        start=$(date +%s)
        # llama-cpp-python (plain llama.cpp) for the same GPU, without its multimodal library, which the benchmark
        # never loads
        if [ $OFFLINE = 1 ]; then source=(--no-index --find-links .devicepkgs); else source=(); fi
        CMAKE_ARGS="$CMAKE_GPU_ARGS -DLLAVA_BUILD=OFF" python -m pip install --no-deps --no-build-isolation \
            "${source[@]}" "llama-cpp-python==0.3.36" > "$OUT/peer-build.log" 2>&1 \
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
        [ "$BACKEND" = cuda ] || { echo "graphs: CUDA graphs are CUDA's (this GPU runs $BACKEND)"; continue; }
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
    *) echo "unknown step $step (detect, deps, build, tests, peer, bench, graphs)"; exit 2 ;;
    esac
done
