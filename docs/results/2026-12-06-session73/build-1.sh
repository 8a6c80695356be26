set -eu
# Builds call-1.sh's carry from main (run from the repository root; session 72's prepared
# patches in P): .device-t32 (lily-bench with gemv-32-tokens.patch), .device-mainb (main's
# lily-bench), .device-lilymain (main's lily), .device-t32s (lily-bench, lily, cuda_batch and
# cuda_sampling with gemv-32-tokens + burst-32k + sampler-prefilter), then takes the patches out.
# .whl/openai as bench/h200_serve.sh says. gemv-32-tokens.patch and sampler-prefilter.patch are
# in git history at c1cb755 (the first lost, the second landed in f2370cc).
P=docs/results/2026-12-06-session72-prepared
S=docs/results/2026-12-06-session73
. scripts/arm_pack.sh
rm -rf .device-t32 .device-mainb .device-lilymain .device-t32s
cargo build --release --features cuda-testing --bin lily --bin lily-bench
arm_bins .device-mainb lily-bench; arm_bins .device-lilymain lily
git apply "$P/gemv-32-tokens.patch"
cargo build --release --features cuda-testing --bin lily-bench
arm_bins .device-t32 lily-bench
git apply "$P/burst-32k.patch"; git apply "$S/sampler-prefilter.patch"
cargo build --release --features cuda-testing --bin lily --bin lily-bench
arm_bins .device-t32s lily-bench lily; arm_test .device-t32s cuda_batch; arm_test .device-t32s cuda_sampling
git apply -R "$S/sampler-prefilter.patch"; git apply -R "$P/burst-32k.patch"; git apply -R "$P/gemv-32-tokens.patch"
