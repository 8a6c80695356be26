set -eu
# Builds call-1.sh's carry (run from the repository root): .device-bf (lily, lily-bench, the
# cuda_batch and cuda_prefill suites) from the working tree with the bf16-copy GEMV sets, and
# .device-base (lily, lily-bench) from main without them (the change stashed meanwhile).
. scripts/arm_pack.sh
rm -rf .device-bf .device-base
cargo build --release --features cuda-testing --bin lily --bin lily-bench
arm_bins .device-bf lily lily-bench; arm_test .device-bf cuda_batch; arm_test .device-bf cuda_prefill
git stash -q
cargo build --release --features cuda-testing --bin lily --bin lily-bench
arm_bins .device-base lily lily-bench
git stash pop -q
