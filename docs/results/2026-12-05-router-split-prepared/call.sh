set -u
# The router split's call (~4 min on a fresh machine): the GPU tests of main + router-split.patch
# (cuda_gpu, cuda_batch), the arms beside main, the decode timeline of the split build.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck TEST_TIMEOUT=90
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -24
grep -E "gemv\+norm|gemv \[257" $OUT/tests-cuda_gpu.log | head -8
grep -A30 "CUDA timeline" $OUT/bench-stderr.log | grep -E "timeline over|router|gemv_q" | head -6
python3 scripts/call_summary.py "$OUT"
