set -u
# Call 3: the expert down launch routing the token itself and loading its rows before its wait (v1 =
# main + down-routes-itself; v2 = v1 without the gate|up launch's L2 prefetch of the down rows):
# GPU tests of v1, one sequence against main, the decode timelines.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck TEST_TIMEOUT=120
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -16
for f in $OUT/bench-stderr.log; do grep -A40 "CUDA timeline" $f | grep -E "timeline over|moe experts|moe_gate_up|moe_down|moe router" ; done
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
