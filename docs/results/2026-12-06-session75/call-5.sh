set -u
# Call 5 (session 75; one H100 or H200, ~200 s): ss = main + route-sum-scatter.patch (the routing
# kernel's block sums by a warp reduce-scatter, the bits of warp_sum's butterflies: every digest
# must equal main's); base = main.
# 1. ss's cuda_batch suite; 2. lily-bench 700 x 128 greedy, base / ss at 64 and 16 rows, two
# rounds alternating, and 64 rows chat-sampled once each.
# Carry [".device-base", ".device-ss"]. ARM=NAME runs the same against .device-NAME instead (a
# bit-identical kernel change: the digests must equal base's); e.g. ARM=pf for
# route-prefetch-l1.patch, prepared for the next session.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-220}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
ARM=${ARM:-ss}
for a in $ARM base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout "$(left 150)" ./.device-$ARM/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch.log" | tail -4
while [ ! -f /tmp/synth.rc ] && [ "$(left 120)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
CHAT="--temperature 0.7 --top-p 0.8 --top-k 20 --seed 1"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch $3 ${4:-}"; }
{
  for b in 64 16; do arm "base b$b r1" base $b; arm "$ARM b$b r1" $ARM $b; done
  for b in 64 16; do arm "$ARM b$b r2" $ARM $b; arm "base b$b r2" base $b; done
  arm "base b64 sampled" base 64 "$CHAT"; arm "$ARM b64 sampled" $ARM 64 "$CHAT"
} > /tmp/arms-5.txt
SKIP_TESTS=1 timeout "$(left 3)" bash scripts/device_check.sh /tmp/arms-5.txt 2>&1 | grep -v "cannot access" | tail -10
bash scripts/out_bundle.sh
