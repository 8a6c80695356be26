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
# here too. One build of every target (the binaries the Python suites start included); cargo's
# JSON messages name the test executables.
cargo test --locked --no-run --features cuda-testing --message-format=json-render-diagnostics >"$logs/build.json"
tests=$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["executable"])' "$logs/build.json")

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

# The Rust test binaries two at a time, the slowest first: several spend much of their time in
# one thread (a process per `lily` command, scoring on the host), so a second binary fills the
# other core (test binaries run one after another under `cargo test`). Each binary's output is
# printed when all are done, in cargo's order; the tests run from the package root as there.
export CARGO_MANIFEST_DIR="$PWD"
slow_first="serving server_http cuda_compile perplexity cpu_model fixture_ppl server_load tokenizer quantize synth"
ordered=$( { for name in $slow_first; do grep "/deps/${name}-" <<<"$tests" || true; done; grep -v -E "/deps/($(tr ' ' '|' <<<"$slow_first"))-" <<<"$tests" || true; } )
run_one() {
    local exe=$1 name
    name=$(basename "$exe")
    "$exe" >"$LOGS/$name.txt" 2>&1
    echo $? >"$LOGS/$name.rc"
}
export -f run_one
LOGS=$logs xargs -P 2 -I{} bash -c 'run_one "$1"' _ {} <<<"$ordered"
rust_failed=()
while read -r exe; do
    name=$(basename "$exe")
    echo "---- $exe ----"
    cat "$logs/$name.txt"
    [ "$(cat "$logs/$name.rc" 2>/dev/null || echo missing)" = 0 ] || rust_failed+=("$name")
done <<<"$tests"
py_rc=0
wait "$py_pid" || py_rc=$?
echo "---- Python suites ----"
cat "$logs/python.txt"
if [ ${#rust_failed[@]} -ne 0 ] || [ "$py_rc" -ne 0 ]; then
    echo "test.sh: failed Rust test binaries: ${rust_failed[*]:-none}; Python suites exit $py_rc" >&2
    exit 1
fi
echo "test.sh: $(wc -l <<<"$tests") Rust test binaries and the Python suites passed"
