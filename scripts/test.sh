#!/usr/bin/env bash
# The test command (README.md): every Rust test (unit, integration, CPU model vs transformers and
# mlx-lm goldens, server over real HTTP, load test, CUDA kernels compiled for sm_90a by NVRTC),
# then the Python suites: `lily serve` driven by the official openai client, and the peer
# benchmark harness (bench/) on canned results. GPU-only tests
# are #[ignore]d here; they run on the GPU machine (docs/cuda.md).
#
# CI runs this on a clean clone with two cores, so the steps overlap where they can: the Python
# packages install while Rust compiles, and the Python suites run beside the Rust tests (both
# logs are printed when both are done).
set -euo pipefail
cd "$(dirname "$0")/.."

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# NVRTC from PyPI compile-checks every kernel without a GPU (tests/cuda_compile.rs); it must be
# there before the Rust tests run, the rest only before the Python suites.
python3 -m pip install -q --disable-pip-version-check nvidia-cuda-nvrtc==13.0.88 openai langchain-openai sglang-router pytest \
    >"$logs/pip.txt" 2>&1 &
pip_pid=$!

# A clean build gains nothing from incremental compilation's bookkeeping.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# cuda-testing compiles the GPU tests' hooks (src/backend/cuda/testing.rs), so their tests build
# here too. One build of every target (the binaries the Python suites start included).
cargo test --locked --no-run --features cuda-testing

if ! wait "$pip_pid"; then
    cat "$logs/pip.txt" >&2
    echo "test.sh: pip install failed" >&2
    exit 1
fi
NVRTC_LIB=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}"
export LILY_REQUIRE_NVRTC=1

python3 -m pytest -q -p no:cacheprovider tests/openai_client tests/gateway tests/bench >"$logs/python.txt" 2>&1 &
py_pid=$!
rust_rc=0
cargo test --locked --no-fail-fast --features cuda-testing || rust_rc=$?
py_rc=0
wait "$py_pid" || py_rc=$?
echo "---- Python suites ----"
cat "$logs/python.txt"
if [ "$rust_rc" -ne 0 ] || [ "$py_rc" -ne 0 ]; then
    echo "test.sh: Rust tests exit $rust_rc, Python suites exit $py_rc" >&2
    exit 1
fi
