#!/usr/bin/env bash
# Builds what call Z carries, from a clean main: .device-base (lily-bench on main) and
# .device-q4 (lily-bench with gdn-step-quads.patch, and the cuda_batch test binary with it).
# Run from the repository root on the development machine; leaves the working tree as it found it.
set -euo pipefail
P=docs/results/2026-12-05-session68-prepared
[ -z "$(git status --porcelain -- kernels src)" ] || { echo "build-z: kernels/ or src/ has changes" >&2; exit 1; }
trap 'git checkout -q -- kernels src' EXIT
build() { cargo build --release --features cuda-testing "$@" 2>&1 | tail -1; }
pack() {  # DIR FILE...: stripped, xz-compressed copies of target/release binaries
  local dir=$1; shift
  mkdir -p "$dir/bin"
  for b in "$@"; do strip -o "$dir/bin/$b" "target/release/$b"; xz -9 -T2 -f "$dir/bin/$b"; done
}
test_bin() {  # DIR SUITE: the suite's test binary
  local dir=$1 t=$2 f
  mkdir -p "$dir/tests"
  f=$(cargo test --release --features cuda-testing --test "$t" --no-run --message-format=json 2>/dev/null \
    | python3 -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == '$t': print(m['executable'])")
  strip -o "$dir/tests/$t" "$f"; xz -9 -T2 -f "$dir/tests/$t"
}
rm -rf .device-base .device-q4
build --bin lily-bench; pack .device-base lily-bench
git apply "$P/gdn-step-quads.patch"
build --bin lily-bench; pack .device-q4 lily-bench
test_bin .device-q4 cuda_batch
du -sh .device-base .device-q4
