set -u
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_check.sh .device/arms1.txt 2>&1 | tail -40
for f in $OUT/ab.jsonl $OUT/bench-stderr.log; do mv $f $OUT/call1-$(basename $f); done
grep -A40 "CUDA timeline" $OUT/call1-bench-stderr.log | grep -v "^      " | head -24
grep -E "moe_tcs|grouped gate" $OUT/tests-cuda_prefill.log | head -20
