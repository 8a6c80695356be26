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
. scripts/arm_pack.sh
rm -rf .device-base .device-r .device-rn
build --bin lily --bin lily-bench; arm_bins .device-base lily lily-bench
git apply "$P/few-tc.patch"
build --bin lily-bench; arm_bins .device-r lily-bench
git apply "$P/norms.patch"
build --bin lily --bin lily-bench; arm_bins .device-rn lily lily-bench
arm_test .device-rn cuda_prefill
arm_test .device-rn cuda_gpu
du -sh .device-base .device-r .device-rn
