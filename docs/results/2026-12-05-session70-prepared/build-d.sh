#!/usr/bin/env bash
# Builds what call D carries, from a clean main (0f65465 or later with the same kernels and
# backend): .device-base (lily, lily-bench on main), .device-rn (lily-bench with session 69's
# few-tc.patch and norms.patch) and .device-rng (lily, lily-bench and the cuda_prefill / cuda_gpu /
# cuda_batch tests with those two and this session's gdn-step-once.patch, gdn-step-35b.patch,
# route-35b.patch and gdn-persist-35b.patch). Run from the
# repository root on the development machine (~3 min); leaves the working tree as it found it.
set -euo pipefail
P69=docs/results/2026-12-05-session69-prepared
P=docs/results/2026-12-05-session70-prepared
[ -z "$(git status --porcelain -- kernels src tests)" ] || { echo "build-d: kernels/, src/ or tests/ has changes" >&2; exit 1; }
trap 'git checkout -q -- kernels src tests docs/cuda-prefill.md' EXIT
build() { cargo build --release --features cuda-testing "$@" 2>&1 | tail -1; }
. scripts/arm_pack.sh
rm -rf .device-base .device-rn .device-rng
build --bin lily --bin lily-bench; arm_bins .device-base lily lily-bench
git apply "$P69/few-tc.patch" "$P69/norms.patch"
build --bin lily-bench; arm_bins .device-rn lily-bench
git apply "$P/gdn-step-once.patch" "$P/gdn-step-35b.patch" "$P/route-35b.patch" "$P/gdn-persist-35b.patch"
build --bin lily --bin lily-bench; arm_bins .device-rng lily lily-bench
arm_test .device-rng cuda_prefill
arm_test .device-rng cuda_gpu
arm_test .device-rng cuda_batch
du -sh .device-base .device-rn .device-rng
