set -eu
# Builds call-g.sh's carry from main (run from the repository root): .device-lilymain (main's
# lily) and .device-lilyburst (with burst-32k.patch), then takes the patch back out.
# .whl/llama-bin.tar.xz: bench/build_llama_batched.sh; .whl/gguf-py.tar.xz and .whl/openai: see
# docs/results/2026-12-05-session71-prepared/build-c.sh.
P=docs/results/2026-12-06-session72-prepared
. scripts/arm_pack.sh
rm -rf .device-lilymain .device-lilyburst
cargo build --release --features cuda-testing --bin lily
arm_bins .device-lilymain lily
git apply "$P/burst-32k.patch"
cargo build --release --features cuda-testing --bin lily
arm_bins .device-lilyburst lily
git apply -R "$P/burst-32k.patch"
