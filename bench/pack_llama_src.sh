#!/usr/bin/env bash
# Download the llama-cpp-python sdist (PyPI) and pack the parts of its vendor/llama.cpp needed on the
# GPU machine (CMake sources of ggml/llama/common/tools, gguf-py, convert_hf_to_gguf.py) into
# .whl/llama-src.tar.xz, small enough for one `carry` (< 64 MiB). Run on the development machine.
#   bash bench/pack_llama_src.sh [VERSION]      (default 0.3.36, the version the harness was built against)
set -euo pipefail
VER=${1:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
PY=${PYTHON:-python3}
"$PY" -m pip download "llama-cpp-python==$VER" --no-binary :all: --no-deps --no-build-isolation -d "$TMP" >/dev/null 2>&1 \
  || "$PY" -m pip download "llama-cpp-python==$VER" --no-binary :all: --no-deps -d "$TMP"
tar -C "$TMP" -xzf "$TMP/llama_cpp_python-$VER.tar.gz"
SRC="$TMP/llama_cpp_python-$VER/vendor/llama.cpp"
rm -rf "$SRC/models" "$SRC/media" "$SRC/docs" "$SRC/examples/"*/*.gguf "$SRC"/build* 2>/dev/null || true
mkdir -p "$SRC/models"   # some CMake files glob it
mkdir -p "$ROOT/.whl"
tar -C "$SRC/.." -cJf "$ROOT/.whl/llama-src.tar.xz" llama.cpp
ls -la "$ROOT/.whl/llama-src.tar.xz"
rm -rf "$TMP"
