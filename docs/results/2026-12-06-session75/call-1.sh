set -u
# Call 1 (session 75; one H100 or H200, ~450 s): rt = main + moe_route_batch with each warp
# taking two tokens over all of the hidden size (no block-wide reduction of the router's sums);
# rt8 = rt with 8 router rows per block past 16 tokens (an experiment, not for landing);
# base = main (4bfabe5's code).
# 1. rt's cuda_batch suite (the routing kernel against the CPU router and lists, the 35B-shaped
#    kernels against the general ones, batch invariance);
# 2. lily-bench, 700-token prompts, 128 steps: base / rt / rt8 at 64 rows greedy and
#    chat-sampled, base / rt at 16 and 4 rows; round 2 of 64 and 16 while the deadline allows;
# 3. rt's phase profile at 64 rows (direct launches, an event per phase).
# Carry [".device-base", ".device-rt", ".device-rt8"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-560}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in rt rt8 base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-rt/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout "$(left 420)" ./.device-rt/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=|routing kernel|rel RMS" "$OUT/tests-cuda_batch.log" | tail -14
while [ ! -f /tmp/synth.rc ] && [ "$(left 360)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
CHAT="--temperature 0.7 --top-p 0.8 --top-k 20 --seed 1"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch $3 ${4:-}"; }
{
  for a in base rt rt8; do arm "$a b64 r1" $a 64; done
  for a in base rt rt8; do arm "$a b64 sampled r1" $a 64 "$CHAT"; done
  for a in base rt; do arm "$a b16 r1" $a 16; done
  for a in base rt; do arm "$a b4 r1" $a 4; done
  for a in rt8 rt base; do arm "$a b64 r2" $a 64; done
  for a in rt base; do arm "$a b16 r2" $a 16; done
  for a in rt base; do arm "$a b64 sampled r2" $a 64 "$CHAT"; done
} > /tmp/arms-1.txt
SKIP_TESTS=1 timeout "$(left 30)" bash scripts/device_check.sh /tmp/arms-1.txt 2>&1 | grep -v "cannot access" | tail -16
el arms
mkdir -p "$OUT/profile"
LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-rt/bin/lily-bench --model $LILY_CK --prompt-len 700 --decode-steps 32 --batch 64 \
  > "$OUT/profile/rt-b64.jsonl" 2> "$OUT/profile/rt-b64.stderr"
el "profile rc=$?"; grep -A3 "moe.route" "$OUT/profile/rt-b64.stderr" | head -8
bash scripts/out_bundle.sh
