#!/usr/bin/env bash
# Made here, on a machine with PyPI, for a GPU machine with none (../shared/docs/cuda.md): what scripts/gpu.sh and
# scripts/gpu-lease.sh read beside the repository, both ignored by git, about 45 MB together:
#   .devicetree/llama.cpp  the patched tree (vendor/prepare.py), without the backends other than CPU, CUDA and RPC
#   .devicepkgs            wheels the image lacks (Python 3.12, manylinux), and the peer: llama-cpp-python's sdist
#                          (the same llama.cpp, unpatched) without what its build never reads
# Then, with the device tool: run(command="bash scripts/gpu-lease.sh 1", carry=[".devicetree", ".devicepkgs"]).
set -euo pipefail
cd "$(dirname "$0")/.."
for path in /.devicetree/ /.devicepkgs/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
OTHER_BACKENDS="ggml-cann ggml-et ggml-hexagon ggml-hip ggml-metal ggml-musa ggml-opencl ggml-openvino ggml-sycl
                ggml-virtgpu ggml-vulkan ggml-webgpu ggml-zdnn ggml-zendnn"

rm -rf .devicetree .devicepkgs
python vendor/prepare.py --out "$PWD/.devicetree/llama.cpp"
(cd .devicetree/llama.cpp/ggml/src && rm -rf $OTHER_BACKENDS)

python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .devicepkgs \
    gguf pexpect openai ollama anthropic fastapi uvicorn sse-starlette pydantic pydantic-settings diskcache
# what the image has (KINDS.md's package list)
(cd .devicepkgs && rm -f numpy-* pyyaml-* PyYAML-* requests-* urllib3-* certifi-* charset_normalizer-* tqdm-* click-* idna-*)

sdist=$(python -c "import sys; sys.path.insert(0, 'vendor'); import prepare; print(prepare.fetch_sdist())")
name=$(basename "$sdist" .tar.gz)
work=$(mktemp -d)
tar xzf "$sdist" -C "$work"
(cd "$work/$name" && rm -rf .git docs docker examples \
    vendor/llama.cpp/{.git,.github,docs,models,benches,tests,examples,media,conversion,gguf-py,tools/ui,tools/server} \
    && cd vendor/llama.cpp/ggml/src && rm -rf $OTHER_BACKENDS)
tar czf ".devicepkgs/$name.tar.gz" -C "$work" "$name"
rm -rf "$work"
du -sh .devicetree .devicepkgs
