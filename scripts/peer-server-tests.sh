#!/usr/bin/env bash
# llama.cpp's own server tests against `h2o-local serve` (benchmarks/peer_server_tests.py): from the repository
# root, after `pip install ".[server,test]"`; installs the tests' few extra packages, writes results/serving/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q wget aiohttp filelock
python -m benchmarks.peer_server_tests "$@"
