set -u
# Call R: the gate|up ring with fewer instructions per stage (tcr-issue.patch). .device-r:
# lily-bench and the cuda_prefill / cuda_batch tests built with the patch; .device-base: main's
# lily-bench. Carry [".device-r", ".device-base"]. ~3 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-r
bash scripts/device_unpack.sh .device-base
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-r/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
for suite in cuda_prefill cuda_batch; do
  timeout 200 "./.device-r/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  echo "$suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
cat > /tmp/arms-r.txt <<'ARMS'
base b16 | BENCH=./.device-base/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16
new b16 | BENCH=./.device-r/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16
base b64 | BENCH=./.device-base/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64
new b64 | BENCH=./.device-r/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64
base b16 r2 | BENCH=./.device-base/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16
new b16 r2 | BENCH=./.device-r/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16
base b64 r2 | BENCH=./.device-base/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64
new b64 r2 | BENCH=./.device-r/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64
ARMS
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-r.txt 2>&1 | tail -9
