set -u
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -45
for f in $OUT/ab.jsonl $OUT/bench-stderr.log; do mv $f $OUT/call-$(basename $f); done
grep -A40 "CUDA timeline" $OUT/call-bench-stderr.log | grep -v "^      " | head -50
grep -E "Tcs|grouped gate" $OUT/tests-cuda_prefill.log | head -20
grep -E "gdn_step_kernels|Pausing|decode_greedy_matches" $OUT/tests-cuda_batch.log $OUT/tests-cuda_gpu.log | head -6
