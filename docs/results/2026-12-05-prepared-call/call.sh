set -u
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
# moe_tcs waits on shared-memory counters (its buffers): if that deadlocked, every batched test and
# every batched arm of the patched binary would hang until its timeout and eat the call. So a short
# batched run of that binary goes first, alone; without its line the tests get 60 s each and the
# patched binary's batched arms are left out (its one-sequence arms stay).
printf 'smoke b16 | BENCH=./.device/bin/lily-bench | --prompt-len 64 --decode-steps 8 --batch 16\n' > /tmp/smoke.txt
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/smoke.txt 2>&1 | tail -3
arms=.device/arms.txt
if ! grep -q '"batch"' "$OUT/ab.jsonl" 2>/dev/null; then
  echo "SMOKE FAILED: the patched binary's batched step did not finish"
  grep -v 'BENCH=./.device/bin/lily-bench |.*--batch' .device/arms.txt > /tmp/arms-safe.txt
  arms=/tmp/arms-safe.txt
  export TEST_TIMEOUT=60
fi
for f in "$OUT/ab.jsonl" "$OUT/bench-stderr.log"; do [ -f "$f" ] && mv "$f" "$OUT/smoke-$(basename "$f")"; done
# Issue 18's design question, apart from the model (~15 s): one hand-over as a PDL kernel boundary
# against a flag in a persistent kernel (lily-bench --handover; docs/cuda.md).
bash scripts/device_unpack.sh >/dev/null 2>&1
LILY_CACHE_DIR=/tmp/lilycache LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-} \
  timeout 120 ./.device/bin/lily-bench --handover --json-out "$OUT/handover.jsonl" 2>&1 | grep -v '^{' | tail -62
bash scripts/device_check.sh "$arms" 2>&1 | tail -46
for f in $OUT/ab.jsonl $OUT/bench-stderr.log; do mv $f $OUT/call-$(basename $f); done
grep -E "Tcs|grouped gate|screened routing" $OUT/tests-cuda_prefill.log | head -20
grep -E "gdn_step_kernels|Pausing|decode_greedy_matches|handover" $OUT/tests-cuda_batch.log $OUT/tests-cuda_gpu.log | head -12
python3 scripts/call_summary.py "$OUT" --same all=all9 --same all9=all8 --same all7=oproj
