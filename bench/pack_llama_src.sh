#!/usr/bin/env bash
# Download the llama-cpp-python sdist (PyPI) and pack the parts of its vendor/llama.cpp needed on the
# GPU machine (CMake sources of ggml (CPU + CUDA backends), llama, common, tools; gguf-py;
# convert_hf_to_gguf.py) into .whl/llama-src.tar.xz (~5 MB), small enough for one `carry`.
# Run on the development machine.
#   bash bench/pack_llama_src.sh [VERSION]      (default 0.3.36, the version the harness was built against)
# The sdist is fetched as a file from PyPI's simple index: `pip download` of this sdist would first
# build its build dependencies (CMake from source) just to read its metadata.
set -euo pipefail
VER=${1:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
url=$(curl -fsSL https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"#]*llama_cpp_python-$VER\.tar\.gz" | head -1)
[ -n "$url" ] || { echo "pack_llama_src: llama_cpp_python-$VER.tar.gz not on PyPI's simple index" >&2; exit 1; }
curl -fsSL -o "$TMP/sdist.tar.gz" "$url"
tar -C "$TMP" -xzf "$TMP/sdist.tar.gz"
SRC="$TMP/llama_cpp_python-$VER/vendor/llama.cpp"
# Not needed for llama-bench / llama-quantize with GGML_CUDA=ON and the server, tests, examples off.
rm -rf "$SRC/models" "$SRC/media" "$SRC/docs" "$SRC/benches" "$SRC/tools/ui" "$SRC"/build* "$SRC/tests/"*.gguf
for b in et metal hexagon sycl vulkan opencl cann musa hip webgpu zdnn openvino virtgpu; do rm -rf "$SRC/ggml/src/ggml-$b"; done
mkdir -p "$SRC/models"   # some CMake files glob it
mkdir -p "$ROOT/.whl"
tar -C "$SRC/.." -cf - llama.cpp | xz -6 -T0 > "$ROOT/.whl/llama-src.tar.xz"
ls -la "$ROOT/.whl/llama-src.tar.xz"
