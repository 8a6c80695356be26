set -u
# Call R: three prepared instruction cuts (README.md). .device-base: main's lily-bench; .device-r:
# with tcr-issue.patch; .device-s: + gdn-conv-slots.patch; .device-t: + gdn-prescale.patch, and
# the cuda_prefill / cuda_batch / cuda_gpu tests. Carry [".device-base", ".device-r", ".device-s",
# ".device-t"]. ~5 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
for d in .device-base .device-r .device-s .device-t; do bash scripts/device_unpack.sh $d; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
for suite in cuda_prefill cuda_batch cuda_gpu; do
  timeout 200 "./.device-t/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  echo "$suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
: > /tmp/arms-r.txt
for round in 1 2; do
  for args in "p4096|--prompt-len 4096 --decode-steps 64" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in base r s t; do
      echo "$arm ${args%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${args#*|}" >> /tmp/arms-r.txt
    done
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-r.txt 2>&1 | tail -20
