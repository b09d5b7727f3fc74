#!/usr/bin/env bash
# Build the extension (and llama.cpp inside it) with AddressSanitizer + UndefinedBehaviorSanitizer into its own
# folder, then run the test suite against that build. Any report fails the run.
#
#   bash scripts/sanitizers.sh                       # the whole suite
#   bash scripts/sanitizers.sh -m "not slow" tests   # without the real-model tests (about 10x slower under ASan)
#   bash scripts/sanitizers.sh tests/api/test_reliability.py tests/api/test_state_machine.py
#
# Needs gcc's libasan / libubsan (Debian: part of gcc). Leak detection is off: CPython itself keeps memory at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${H2O_SANITIZE_DIR:-build/sanitize}
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
mkdir -p "$OUT"
CMAKE_ARGS="-DCMAKE_C_FLAGS='$FLAGS' -DCMAKE_CXX_FLAGS='$FLAGS' -DCMAKE_SHARED_LINKER_FLAGS='-fsanitize=address,undefined' -DGGML_OPENMP=OFF" \
    pip install --no-deps --no-build-isolation --upgrade --target "$OUT/site" \
    --config-settings=build-dir="$OUT/build" . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }

ASAN_LIB=$(gcc -print-file-name=libasan.so)
UBSAN_LIB=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$ASAN_LIB:$UBSAN_LIB"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# python -S skips the .pth files, so an editable install of h2o_local cannot shadow the sanitized build; the
# installed packages (numpy, pytest, ...) stay reachable through PYTHONPATH
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export PYTHONPATH="$PWD/$OUT/site:$SITE"
python -S -c "import h2o_local._engine as e, sys; assert e.__file__.startswith('$PWD/$OUT'), e.__file__"
if [ $# -eq 0 ]; then set -- tests; fi
python -S -m pytest -q -p no:cacheprovider "$@"
