set -u
# Session 78, call tl (one GPU, ~400 s): tl = main (4ae5b79) + the wgmma gate|up kernel's tiles
# with tails (an expert's last tile takes up to 32 slots past 128 on the full tile's dequantised
# A fragments; down walks the lists without tails; bit-identical: every digest must equal base's);
# td = tl + the down kernel's tiles with the same tails (one list; its code ring 8 -> 6 stages);
# tda = td + session 77's prepared attn-staged.patch (the attention core's output staged in bf16
# for its out-projection on unsplit launches; bit-identical).
# 1. tda's cuda_prefill suite (covers all three); 2. lily-bench prefill, base / tl / td / tda
# alternating: 4,096 (two rounds), 8,192; 16 x 700 and 32,768 base / tda; 3. the 4K phase profiles
# (what the deadline leaves).
# Carry [".device-base", ".device-tl", ".device-td", ".device-tda"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-480}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in tda td tl base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 110 ./.device-tda/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base tl td tda; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base tl td tda; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base tda; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
  for a in base tda; do arm "$a p32768" $a "--prompt-len 32768 --decode-steps 16"; done
} > /tmp/arms-tl.txt
SKIP_TESTS=1 timeout "$(left 40)" bash scripts/device_check.sh /tmp/arms-tl.txt 2>&1 | grep -v "cannot access" | tail -14
el arms
for a in base td tl tda; do
  [ "$(left 8)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(moe[.](gate_up|down)|attn[.](core|out)) ' "$OUT/profile-$a-4096.txt" | tail -4 | tr -s ' ' | tr '\n' ' ')"
done
bash scripts/out_bundle.sh
