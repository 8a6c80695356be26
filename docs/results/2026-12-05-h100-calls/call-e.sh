set -u
# Prepared call (session 62, docs/results/2026-12-05-sampler-small-k-prepared/): the one-launch
# sampler for a top-k of at most 64 (sample_small_k), which must choose the general kernels'
# tokens. Carry [".device-sk"] (13 MB). The patch's cuda_sampling (its new test compares the two
# paths token for token, the chi-square tests now run the new kernel for top-k settings) and
# cuda_batch, then main against the patch with chat sampling (T 0.7, top-p 0.8, top-k 20) at one
# sequence after 4K and at 16 and 64 rows of 700-token prompts, the 4K and 64-row pairs twice;
# every digest must equal main's. ~6 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-sk
[ -f "$LILY_CK/config.json" ] || (./.device-sk/bin/lily-bench-sk --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
for bin in cuda_sampling cuda_batch; do
  timeout "${TEST_TIMEOUT:-150}" "./.device-sk/tests/$bin" --include-ignored --test-threads 2 > "$OUT/tests-$bin.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$bin.log"
  echo "[+$(( $(date +%s) - t0 ))s] $bin"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$bin.log" | tail -4
done
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh .device-sk/arms-e.txt 2>&1 | tail -12
python3 scripts/call_summary.py "$OUT" --base base --same sk=base
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
