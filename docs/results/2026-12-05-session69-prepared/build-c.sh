#!/usr/bin/env bash
# Builds what call C carries, from a clean main (1b1dad2 or later with the same kernels and
# backend): .device-base (lily, lily-bench on main), .device-r (lily-bench with few-tc.patch) and
# .device-rn (lily, lily-bench and the cuda_prefill / cuda_gpu tests with few-tc.patch and
# norms.patch). Run from the repository root on the development machine (~3 min); leaves the
# working tree as it found it.
set -euo pipefail
P=docs/results/2026-12-05-session69-prepared
[ -z "$(git status --porcelain -- kernels src tests)" ] || { echo "build-c: kernels/, src/ or tests/ has changes" >&2; exit 1; }
trap 'git checkout -q -- kernels src tests docs/cuda-prefill.md' EXIT
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
rm -rf .device-base .device-r .device-rn
build --bin lily --bin lily-bench; pack .device-base lily lily-bench
git apply "$P/few-tc.patch"
build --bin lily-bench; pack .device-r lily-bench
git apply "$P/norms.patch"
build --bin lily --bin lily-bench; pack .device-rn lily lily-bench
test_bin .device-rn cuda_prefill
test_bin .device-rn cuda_gpu
du -sh .device-base .device-r .device-rn
