#!/usr/bin/env bash
# Download the llama-cpp-python sdist (through pip) and pack the parts of its vendor/llama.cpp needed on the
# GPU machine (CMake sources of ggml (CPU + CUDA backends), llama, common, tools; gguf-py;
# convert_hf_to_gguf.py) into .whl/llama-src.tar.xz (~5 MB), small enough for one `carry`.
# Run on the development machine.
#   bash bench/pack_llama_src.sh [VERSION]      (default 0.3.36, the version the harness was built against)
# The sdist comes through pip as this machine has it configured (its index / find-links). `pip download`
# prepares the sdist's metadata, which needs its build backend (scikit-build-core) and CMake: with
# `--no-binary` limited to llama-cpp-python, pip's isolated build environment (a temp dir of pip's own,
# nothing installed into the system) takes their ready-made wheels instead of building CMake from source.
set -euo pipefail
VER=${1:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$TMP/dl" \
  || { echo "pack_llama_src: pip could not download the llama-cpp-python $VER sdist" >&2; exit 1; }
sdist="$TMP/dl/llama_cpp_python-$VER.tar.gz"
[ -f "$sdist" ] || { echo "pack_llama_src: pip saved no llama_cpp_python-$VER.tar.gz" >&2; exit 1; }
tar -C "$TMP" -xzf "$sdist"
SRC="$TMP/llama_cpp_python-$VER/vendor/llama.cpp"
# Not needed for llama-bench / llama-quantize with GGML_CUDA=ON and the server, tests, examples off.
rm -rf "$SRC/models" "$SRC/media" "$SRC/docs" "$SRC/benches" "$SRC/tools/ui" "$SRC"/build* "$SRC/tests/"*.gguf
for b in et metal hexagon sycl vulkan opencl cann musa hip webgpu zdnn openvino virtgpu; do rm -rf "$SRC/ggml/src/ggml-$b"; done
mkdir -p "$SRC/models"   # some CMake files glob it
mkdir -p "$ROOT/.whl"
tar -C "$SRC/.." -cf - llama.cpp | xz -6 -T0 > "$ROOT/.whl/llama-src.tar.xz"
ls -la "$ROOT/.whl/llama-src.tar.xz"
