set -eu
# Builds what call-c.sh / call-d.sh carry, from a clean main (run from the repository root):
# .device-all (lily-bench and the cuda_batch / cuda_prefill suites with batched-35b-shapes.patch)
# and .device-lilyall (its lily), then takes the patch back out. The peer's .whl/llama-bin.tar.xz
# comes from bench/build_llama_batched.sh, .whl/gguf-py.tar.xz from
#   tar -xJf .whl/llama-src.tar.xz llama.cpp/gguf-py && tar -cf - llama.cpp/gguf-py | xz -9 > .whl/gguf-py.tar.xz
# and .whl/openai as bench/h200_serve.sh says.
P=docs/results/2026-12-05-session71-prepared
git apply "$P/batched-35b-shapes.patch"
cargo build --release --features cuda-testing --bin lily --bin lily-bench
. scripts/arm_pack.sh
rm -rf .device-all .device-lilyall
arm_bins .device-all lily-bench
arm_bins .device-lilyall lily
arm_test .device-all cuda_batch
arm_test .device-all cuda_prefill
git apply -R "$P/batched-35b-shapes.patch"
