set -u
# Prepared in session 77 (not run): as = main + attn-staged.patch (the prefill attention core
# writing, on unsplit launches whose out-projection runs on cuBLAS, only that GEMM's bf16 operand;
# bit-identical: every digest must equal base's). Build: git apply the patch, cargo build --release
# --features cuda-testing --bin lily --bin lily-bench, then `. scripts/arm_pack.sh; arm_bins
# .device-as lily lily-bench; arm_test .device-as cuda_prefill` (and main's bins into .device-base).
# 1. as's cuda_prefill suite (its attention-segment tests also check the staged outputs against
# the f32 ones rounded, bit for bit); 2. lily-bench prefill, base / as alternating: 4,096 (two
# rounds), 8,192, 16 x 700, 32,768; 3. the 4K phase profile of base and as (attn.core, attn.out).
# Carry [".device-base", ".device-as"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-400}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in as base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-as/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base as; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base as; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base as; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
  for a in base as; do arm "$a p32768" $a "--prompt-len 32768 --decode-steps 16"; done
} > /tmp/arms-as.txt
SKIP_TESTS=1 timeout "$(left 50)" bash scripts/device_check.sh /tmp/arms-as.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in base as; do
  [ "$(left 8)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +attn[.](core|out) ' "$OUT/profile-$a-4096.txt" | head -2 | tr -s ' ' | tr '\n' ' ')"
done
bash scripts/out_bundle.sh
