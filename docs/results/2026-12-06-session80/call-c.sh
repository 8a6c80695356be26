set -u
# Session 80, call c (one GPU, ~200 s): base = main (bac97b0's kernels); di = base + fewer
# instructions per wgmma expert step (bit-identical): the B descriptors as one add on a fixed
# descriptor (WgmmaDescs) instead of mask / shift / or per wgmma, and the scales and biases
# loaded as bf16 pairs (v, v) straight from shared memory (the products read them as .H0_H0)
# instead of an IMAD each: pf_moe_wg_glu_f's loop 370 -> 336 instructions per two steps; and the
# down kernel's row-block epilogue with one shuffle per row pair, 32-bit offsets and predicated
# stores (its loop with the epilogue 1,868 -> 1,244).
# 1. di's cuda_prefill; 2. lily-bench base / di alternating (4,096 x2, 8,192, 16 x 700);
# 3. the 4K profiles. Carry [".device-base", ".device-di"]. Build: main's lily and lily-bench
# into .device-base; with ../2026-12-06-session80-prepared/wg-step-diet.patch applied, lily-bench
# and cuda_prefill into .device-di (`. scripts/arm_pack.sh; arm_bins .device-di lily-bench;
# arm_test .device-di cuda_prefill`). Session 80 started it once with DEADLINE=175 and no
# 16 x 700 arms (150 s of device time left); the machine was taken back before it finished.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-260}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in di base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-di/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base di; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base di; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base di; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 100)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -10
el arms
for a in base di; do
  [ "$(left 20)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 5)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(gdn[.]proj|moe[.]route|moe[.]gate_up|moe[.]down) ' "$OUT/profile-$a-4096.txt" | tail -4 | tr -s ' ' | tr '\n' ' ')"
done
el done
bash scripts/out_bundle.sh
