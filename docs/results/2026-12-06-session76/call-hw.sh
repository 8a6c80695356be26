set -u
# Session 76, call hw (one H100, ~200 s): hw = main + walk-copy-offsets.patch (the chunked GDN
# walk's copies from per-thread offsets computed once: 1,936 -> 1,080 instructions in
# pf_gdn_chunk_walk_128_f16; the same copies, so every digest must equal base's); nc = hw +
# walk-no-copies-timing.patch (timing only, wrong outputs: no copies past the first two chunks,
# so its gdn.scan phase bounds what the walk's products and barriers take alone).
# 1. hw's cuda_prefill suite; 2. lily-bench prefill, base / hw alternating: 4,096 (two rounds),
# 8,192, 16 x 700; 3. the 4K phase profile of base, hw and nc (gdn.scan lines).
# Carry [".device-base", ".device-hw", ".device-nc"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-230}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in hw nc base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-hw/tests/cuda_prefill --include-ignored --test-threads 2 > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 120)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base hw; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base hw; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base hw; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms-hw.txt
SKIP_TESTS=1 timeout "$(left 60)" bash scripts/device_check.sh /tmp/arms-hw.txt 2>&1 | grep -v "cannot access" | tail -8
el arms
for a in base hw nc; do
  [ "$(left 8)" -gt 10 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep 'gdn.scan' "$OUT/profile-$a-4096.txt" | tail -1)"
done
bash scripts/out_bundle.sh
