set -u
# Call E (session 71, the last of the device time): the GPU suites cuda_batch and cuda_prefill on
# `all` (as call C), nothing timed. Carry [".device-all"].
export OUT=${OUT:-/tmp/out} LILY_CACHE_DIR=/tmp/lilycache CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-all >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for t in cuda_batch cuda_prefill; do
  timeout 50 ./.device-all/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
