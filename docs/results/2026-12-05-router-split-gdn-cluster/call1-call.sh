set -u
# Router split + GDN step cluster (~5 min on a fresh machine): the GPU tests of main + both patches
# (cuda_gpu, cuda_batch), one sequence on main, each patch alone and both, the decode timeline of both.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck TEST_TIMEOUT=90
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -30
grep -E "gdn step|gemv\+norm|gemv \[257" $OUT/tests-cuda_gpu.log | head -12
grep -A40 "CUDA timeline" $OUT/bench-stderr.log | grep -E "timeline over|router|gemv_q|gdn" | head -8
python3 scripts/call_summary.py "$OUT"
