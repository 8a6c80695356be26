set -u
# Session 83, call e (one GPU, ~300 s): the wide gate|up's inputs shared by a thread block cluster
# of the tile's row blocks (mc.patch: pf_moe_wg_glu_mc, tensor copies multicast to the cluster's
# 4 blocks, remote empty-barrier arrivals; bit-identical to pf_moe_wg_glu_mb by construction).
# base = main; mc = clusters of 4 at the 35B; mc2 = the same capped at clusters of 2 (bench only).
# 1. mc's cuda_prefill; 2. lily-bench 4,096 x2 per arm, alternating, and 8,192 (but y and z);
# 3. the 4K profiles. Carry [".device-base", ".device-mc", ".device-mc2"].
# TESTED: the arms with a cuda_prefill to pass before they are timed (each .device-NAME/tests);
# mc2 is timed where mc passed. TESTED="y z mc" with .device-y and .device-z carried too runs
# call d's arms in the same call.
TESTED=${TESTED:-mc}
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-360}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in base $TESTED mc2; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily-bench --model $LILY_CK --synth-preset 35b-a3b > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
pids=""
for a in $TESTED; do
  ( timeout 150 ./.device-$a/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-$a-cuda_prefill.log" 2>&1
    echo "rc=$?" >> "$OUT/tests-$a-cuda_prefill.log" ) &
  pids="$pids $!"
done
wait $pids
for a in $TESTED; do el "cuda_prefill $a"; grep -E "^test result|FAILED|panicked|rc=|swiglu|prefill route|few rows" "$OUT/tests-$a-cuda_prefill.log" | tail -8; done
arms="base"; for a in $TESTED; do grep -q "^rc=0" "$OUT/tests-$a-cuda_prefill.log" && arms="$arms $a"; done
case " $arms " in *" mc "*) [ -d .device-mc2 ] && arms="$arms mc2";; esac
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in $arms; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in $arms; do case $a in y|z) ;; *) arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16";; esac; done
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 40)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in $arms; do
  [ "$(left 20)" -gt 12 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 5)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(moe[.](gate_up|route)) ' "$OUT/profile-$a-4096.txt" | tr -s ' ' | tail -2 | tr '\n' ' ')"
done
el done
bash scripts/out_bundle.sh
