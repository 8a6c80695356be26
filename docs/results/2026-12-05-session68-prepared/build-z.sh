#!/usr/bin/env bash
# Builds what call Z carries, from a clean main: .device-base (lily-bench on main) and
# .device-q4 (lily-bench with gdn-step-quads.patch, and the cuda_batch test binary with it).
# Run from the repository root on the development machine; leaves the working tree as it found it.
set -euo pipefail
P=docs/results/2026-12-05-session68-prepared
[ -z "$(git status --porcelain -- kernels src)" ] || { echo "build-z: kernels/ or src/ has changes" >&2; exit 1; }
trap 'git checkout -q -- kernels src' EXIT
build() { cargo build --release --features cuda-testing "$@" 2>&1 | tail -1; }
. scripts/arm_pack.sh
rm -rf .device-base .device-q4
build --bin lily-bench; arm_bins .device-base lily-bench
git apply "$P/gdn-step-quads.patch"
build --bin lily-bench; arm_bins .device-q4 lily-bench
arm_test .device-q4 cuda_batch
du -sh .device-base .device-q4
