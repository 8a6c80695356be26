set -u
# The second prepared call of session 61 (docs/results/2026-12-05-route-rows-2-prepared/): the
# batched routing launch with two router rows per block for steps of up to 16 tokens (rr2), 16 and
# 4 rows against main, and rr2's decode timeline (moe_route_batch's us per launch: 12.5 at 16 rows
# on 2026-12-04). No tests: the first call's test binaries carry this patch too.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
SKIP_TESTS=1 bash scripts/device_check.sh .device/arms-b.txt 2>&1 | tail -10
grep -A40 "CUDA timeline" $OUT/bench-stderr.log | grep -E "timeline over|rout" | head -6
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
