#!/usr/bin/env bash
# Builds what call V carries (README.md), from a clean main: .device-base, -p, -q, -q3, -g, -d
# (lily-bench with one patch each; base also lily) and -all (the four patches stacked: lily-bench
# and the cuda_prefill / cuda_batch / cuda_gpu tests).
# Run from the repository root on the development machine; leaves the working tree as it found it.
set -euo pipefail
P=docs/results/2026-12-05-session67-prepared
[ -z "$(git status --porcelain -- kernels src)" ] || { echo "build-v: kernels/ or src/ has changes" >&2; exit 1; }
trap 'git checkout -q -- kernels src' EXIT
build() { cargo build --release --features cuda-testing "$@" 2>&1 | tail -1; }
pack() {  # DIR FILE...: stripped, xz-compressed copies of target/release binaries
  local dir=$1; shift
  mkdir -p "$dir/bin"
  for b in "$@"; do strip -o "$dir/bin/$b" "target/release/$b"; xz -9 -T2 -f "$dir/bin/$b"; done
}
tests() {  # DIR SUITE...: the suites' test binaries
  local dir=$1; shift
  mkdir -p "$dir/tests"
  for t in "$@"; do
    f=$(cargo test --release --features cuda-testing --test "$t" --no-run --message-format=json 2>/dev/null \
      | python3 -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == '$t': print(m['executable'])")
    strip -o "$dir/tests/$t" "$f"; xz -9 -T2 -f "$dir/tests/$t"
  done
}
rm -rf .device-base .device-p .device-q .device-q3 .device-g .device-d .device-all
build --bin lily --bin lily-bench; pack .device-base lily lily-bench
one() {  # DIR PATCH...: lily-bench with the patches applied to main
  local dir=$1; shift
  git checkout -q -- kernels src
  for p in "$@"; do git apply "$P/$p.patch"; done
  build --bin lily-bench; pack "$dir" lily-bench
}
one .device-p pf-scan-full-first
one .device-q tcq-down-ring
one .device-q3 tcq-down-ring tcq-three-blocks
one .device-g gemv-sets-first-item
one .device-d gdn-step-pairs
one .device-all pf-scan-full-first tcq-down-ring gemv-sets-first-item gdn-step-pairs
tests .device-all cuda_prefill cuda_batch cuda_gpu
du -sh .device-base .device-p .device-q .device-q3 .device-g .device-d .device-all
