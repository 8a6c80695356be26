set -u
# Session 82, call c (one GPU, ~150 s): call b within the device time left. base = main (f182bca: the counts by pf_scan); y = the
# routing's count, scan and scatter in one block (pf_slot_lists: one launch instead of two, no
# scatter grid) and pf_route over two tokens per warp (warp_route_topk_n<2>, as the batched
# decode's), both bit-identical (y.patch). 1. y's cuda_prefill (with the new route test);
# 2. lily-bench 4,096 x2 and 16 x 700 per arm, alternating;
# 3. the 4K profiles. Carry [".device-base", ".device-y"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-160}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in base y; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily-bench --model $LILY_CK --synth-preset 35b-a3b > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 75 ./.device-y/tests/cuda_prefill --include-ignored --test-threads 4 --nocapture > "$OUT/tests-y-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-y-cuda_prefill.log"
el "cuda_prefill y"; grep -E "^test result|FAILED|panicked|rc=|prefill route" "$OUT/tests-y-cuda_prefill.log" | tail -8
arms="base"; grep -q "^rc=0" "$OUT/tests-y-cuda_prefill.log" && arms="$arms y"
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in $arms; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in $arms; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
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
