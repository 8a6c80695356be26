#!/usr/bin/env bash
# Builds what call E carries, from a clean main at or after the session-70 landing (69e0336):
# .device-new (lily, lily-bench of main) and .device-rr (lily-bench and the cuda_batch test with
# route-35b.patch on top). .device-base (lily, lily-bench of main before the landing, 013c1a8's
# code) is build-d.sh's and is kept. Run from the repository root (~2 min); leaves the working
# tree as it found it.
set -euo pipefail
P=docs/results/2026-12-05-session70-prepared
[ -z "$(git status --porcelain -- kernels src tests)" ] || { echo "build-e: kernels/, src/ or tests/ has changes" >&2; exit 1; }
[ -d .device-base/bin ] || { echo "build-e: .device-base missing (build-d.sh builds it)" >&2; exit 1; }
trap 'git checkout -q -- kernels src tests' EXIT
build() { cargo build --release --features cuda-testing "$@" 2>&1 | tail -1; }
. scripts/arm_pack.sh
rm -rf .device-new .device-rr
build --bin lily --bin lily-bench; arm_bins .device-new lily lily-bench
git apply "$P/route-35b.patch"
build --bin lily-bench; arm_bins .device-rr lily-bench
arm_test .device-rr cuda_batch
du -sh .device-base .device-new .device-rr
