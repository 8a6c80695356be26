set -u
# The prepared call of session 61 (docs/results/2026-12-05-down-routes-itself-prepared/ and
# ../2026-12-05-graph-key-prepared/): the expert down launch routing the token itself and loading
# its rows before its wait (v1 = main + down-routes-itself; v2 = v1 without the gate|up launch's L2
# prefetch of the down rows), and decode graphs keyed by their addresses (gk). GPU tests of main +
# v1 + gk, one sequence against main, the decode timelines of v1 and v2, the 700-token prefill
# (first token included) of gk.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck TEST_TIMEOUT=120
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -16
for f in $OUT/bench-stderr.log; do grep -A40 "CUDA timeline" $f | grep -E "timeline over|moe experts|moe_gate_up|moe_down|moe router" ; done
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
