set -u
# Session 82, call a (one GPU, ~360 s). base = main (29bc9f5); d3 = gate|up 7 stages 3 ahead
# (warps drift 3 groups), down 4 ahead (d3.patch); l4 = gate|up 7 stages 4 ahead, down 6 ahead
# (l4.patch); u = every wide gate|up tile on the mbarrier kernel, the block-barrier wide path
# deleted (u.patch); rc = the per-expert counts by pf_scan's shared-memory counters instead of
# pf_route's 32K global atomics, no memset (rc.patch) + the attention prep as a block per row
# (RoPE angles once per row, not per head; a warp per head; pr.patch) + the GDN convs over runs
# of rows with each input row read once into registers (8 rows per thread, 4 per q|k warp;
# cv.patch): x, all three bit-identical, each its own profile phase.
# 1. u's and x's cuda_prefill side by side; 2. lily-bench 4,096 x2 and 8,192 per arm,
# alternating; 3. the 4K profiles. Carry [".device-base", ".device-d3", ".device-l4", ".device-u", ".device-x"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-360}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in base d3 l4 u x; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily-bench --model $LILY_CK --synth-preset 35b-a3b > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
pids=""
for a in u x; do
  ( timeout 150 ./.device-$a/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-$a-cuda_prefill.log" 2>&1
    echo "rc=$?" >> "$OUT/tests-$a-cuda_prefill.log" ) &
  pids="$pids $!"
done
wait $pids
for a in u x; do el "cuda_prefill $a"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$a-cuda_prefill.log" | tail -6; done
ok() { grep -q "^rc=0" "$OUT/tests-$1-cuda_prefill.log"; }
arms="base d3 l4"; for a in u x; do ok $a && arms="$arms $a"; done
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in $arms; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in $arms; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 70)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -16
el arms
for a in $arms; do
  [ "$(left 20)" -gt 12 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 5)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(gdn[.]conv|attn[.]prep|moe[.]route|moe[.]gate_up|moe[.]down) ' "$OUT/profile-$a-4096.txt" | tail -5 | tr -s ' ' | tr '\n' ' ')"
done
el done
bash scripts/out_bundle.sh
