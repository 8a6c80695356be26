set -u
# The f16 GDN states in their landing form (gdn-state-f16-default.patch: f16 by default,
# LILY_GDN_STATE=f32 for the other arm, one binary). Carry [".device-gs"] (built as README says).
# First cuda_batch's warm-up test alone, then cuda_batch on one test thread (on 2026-12-05 the
# warm-up test failed in the two-thread run of this patch's build, f32 states, capture
# invalidated: alone or not is what decides whether the patch or the test's concurrency is at
# fault), then the rest of the suites and f32 / f16 arms at one sequence after 4K and 16 / 64 rows.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-gs
[ -f "$LILY_CK/config.json" ] || (./.device-gs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
suite() {
  local log=$1 bin=$2; shift 2
  timeout "${TEST_TIMEOUT:-150}" "./.device-gs/tests/$bin" --include-ignored "$@" > "$OUT/tests-$log.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$log.log"
  echo "[+$(( $(date +%s) - t0 ))s] $log"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$log.log" | tail -4
}
suite warm-up-alone cuda_batch --exact cuda_batch_warm_up_captures_every_batch_size_and_changes_no_token
suite cuda_batch-1thread cuda_batch --test-threads 1
suite cuda_batch cuda_batch --test-threads 2 --nocapture
suite cuda_gpu cuda_gpu --test-threads 2
suite cuda_prefill cuda_prefill --test-threads 2
suite cuda_sampling cuda_sampling --test-threads 2
suite cuda_memory cuda_memory --test-threads 2
suite cuda_fixture cuda_fixture --test-threads 2 --nocapture
grep -hE ": PPL|KL" "$OUT"/tests-cuda_fixture.log | head -12
grep -c "capturing again" "$OUT"/tests-*.log
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-gdn-state-f16-landed/arms-g.txt 2>&1 | tail -12
python3 scripts/call_summary.py "$OUT" --base f32
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
