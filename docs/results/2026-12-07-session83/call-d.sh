set -u
# Prepared in session 82 for a later one, call d (one GPU, ~300 s): y (calls b and c, which
# could not start) and z.
# base = main (f182bca: the counts by pf_scan); y = the routing's count, scan and scatter in one
# block (pf_slot_lists) and pf_route over two tokens per warp (y.patch); z = the router's
# few-row product with two 16-token tiles per warp from 4,096 tokens (pf_few_tc_m2_8_4: 32-row
# chunks, the A fragments staged 8 groups at a time, the codes read once per 32 tokens instead
# of 16; z.patch). All bit-identical by construction. 1. y's and z's cuda_prefill side by side;
# 2. lily-bench 4,096 x2, 8,192 and 16 x 700 per arm, alternating, 32,768 once on base;
# 3. the 4K profiles. Run in session 83 with base's cuda_prefill too (the conv test's new form)
# and base at 131,072 last. Carry [".device-base", ".device-y", ".device-z"] (rebuild them from the
# patches if the folders are gone: scripts/arm_pack.sh).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-360}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in base y z; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily-bench --model $LILY_CK --synth-preset 35b-a3b > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
pids=""
for a in base y z; do
  ( timeout 150 ./.device-$a/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-$a-cuda_prefill.log" 2>&1
    echo "rc=$?" >> "$OUT/tests-$a-cuda_prefill.log" ) &
  pids="$pids $!"
done
wait $pids
for a in base y z; do el "cuda_prefill $a"; grep -E "^test result|FAILED|panicked|rc=|prefill route|few rows" "$OUT/tests-$a-cuda_prefill.log" | tail -8; done
arms="base"; for a in y z; do grep -q "^rc=0" "$OUT/tests-$a-cuda_prefill.log" && arms="$arms $a"; done
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in $arms; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in $arms; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in $arms; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
  arm "base p32768" base "--prompt-len 32768 --decode-steps 16"
  arm "base p131072" base "--prompt-len 131072 --decode-steps 16"
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 40)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in $arms; do
  [ "$(left 20)" -gt 12 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 5)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(moe[.]route) ' "$OUT/profile-$a-4096.txt" | tail -1 | tr -s ' ')"
done
el done
bash scripts/out_bundle.sh
