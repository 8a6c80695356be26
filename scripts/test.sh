#!/usr/bin/env bash
# The test command (README.md): every Rust test (unit, integration, CPU model vs transformers and
# mlx-lm goldens, server over real HTTP, load test, CUDA kernels compiled for sm_90a by NVRTC),
# then the Python suites: `lily serve` driven by the official openai client, and the peer
# benchmark harness (bench/) on canned results. GPU-only tests
# are #[ignore]d here; they run on the GPU machine (docs/cuda.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# NVRTC from PyPI compile-checks every kernel without a GPU (tests/cuda_compile.rs).
python3 -m pip install -q --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88 openai langchain-openai sglang-router pytest
NVRTC_LIB=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}"
export LILY_REQUIRE_NVRTC=1

# cuda-testing compiles the GPU tests' hooks (src/backend/cuda/testing.rs), so their tests build
# here too; both commands take it, so the library is built once.
cargo build --locked --bins --features cuda-testing
cargo test --locked --no-fail-fast --features cuda-testing

python3 -m pytest -q -p no:cacheprovider tests/openai_client tests/gateway tests/bench
