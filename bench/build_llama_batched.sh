#!/usr/bin/env bash
# llama-batched-bench (the batched-decode peer, issue 15) built with CUDA for sm_90 on a machine
# without a GPU, so a device call spends none of its minutes on the ~10-minute build: CUDA 13.0's
# compiler, runtime and cuBLAS from their pip wheels in a standalone root, a libcuda stub for the
# link (the driver's libcuda.so.1 is found at run time), one static executable (sm_90 cubins only,
# no PTX; the fatbin left uncompressed so that xz packs it), RUNPATH /usr/local/cuda/lib64.
# Needs gcc/g++ 12 (nvcc 13.0 accepts it) and .whl/llama-src.tar.xz (bench/pack_llama_src.sh).
# Writes .whl/llama-bin.tar.xz (~15 MB: llama-bin/bin/llama-batched-bench), which
# `bash bench/h200_steps.sh batched-prebuilt` unpacks on the GPU machine. ~25 minutes on 2 cores.
# The binary needs glibc 2.36 or newer there (the static libstdc++).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
T=${BUILD_DIR:-/tmp/llama-batched}
CU=$T/cuda13/nvidia/cu13
mkdir -p "$T/wheels" "$T/cuda13" "$T/tools"
pip download -q --no-deps -d "$T/wheels" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
  nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
(cd "$T/cuda13" && for w in "$T"/wheels/*.whl; do python3 -m zipfile -e "$w" .; done)
chmod +x "$CU"/bin/* "$CU"/nvvm/bin/*
[ -e "$CU/lib64" ] || ln -s lib "$CU/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$CU/lib/lib$l.so"; done
echo '{"cuda": {"name": "CUDA SDK", "version": "13.0.2"}}' > "$CU/version.json"
echo 'CUDA Version 13.0.2' > "$CU/version.txt"
# The link-time libcuda: an empty function for every cu* name cuda.h declares, soname libcuda.so.1.
mkdir -p "$CU/lib/stubs"
gcc -E -P -I"$CU/include" "$CU/include/cuda.h" | grep -o '\bcu[A-Z][A-Za-z0-9_]*\s*(' | tr -d ' (' | sort -u \
  | sed 's/.*/void &(void) {}/' > "$T/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$T/cuda_stub.c"
pip install -q --target "$T/tools" cmake==3.31.6
CMAKE=$T/tools/cmake/data/bin/cmake
rm -rf "$T/src" && mkdir -p "$T/src" && tar -C "$T/src" -xJf "$ROOT/.whl/llama-src.tar.xz"
cd "$T/src/llama.cpp"
"$CMAKE" -S . -B build -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_COMPRESSION_MODE=none \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=OFF \
  -DBUILD_SHARED_LIBS=OFF -DCUDAToolkit_ROOT="$CU" -DCMAKE_CUDA_COMPILER="$CU/bin/nvcc" -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++ \
  -DCMAKE_SKIP_BUILD_RPATH=ON -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath,/usr/local/cuda/lib64 -static-libstdc++ -static-libgcc"
nice -n 19 "$CMAKE" --build build -j"$(nproc)" --target llama-batched-bench
rm -rf "$T/pkg" && mkdir -p "$T/pkg/llama-bin/bin"
strip -o "$T/pkg/llama-bin/bin/llama-batched-bench" build/bin/llama-batched-bench
tar -C "$T/pkg" -cf - llama-bin | xz -9 -T1 > "$ROOT/.whl/llama-bin.tar.xz"
ls -la "$ROOT/.whl/llama-bin.tar.xz"
