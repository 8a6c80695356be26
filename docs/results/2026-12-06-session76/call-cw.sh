set -u
# Session 76, call cw (one H100 or H200, ~220 s): cw = main + walk-cluster.patch (the chunked GDN
# walk's four column blocks of a head as one thread block cluster, the head's W, e^G q, Kd and M
# tiles copied once per cluster by multicast bulk copies behind per-stage mbarriers instead of
# once per block by cp.async; bit-identical, so every digest must equal base's).
# 1. cw's cuda_prefill suite (under a timeout: a wrong transaction count would hang the walk);
# 2. lily-bench prefill, base / cw alternating: 4,096 (two rounds), 8,192, 32,768, 16 x 700.
# Carry [".device-base", ".device-cw"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-260}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in cw base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 120 ./.device-cw/tests/cuda_prefill --include-ignored --test-threads 2 > "$OUT/tests-cuda_prefill.log" 2>&1
rc=$?; echo "rc=$rc" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 120)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base cw; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base cw; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base cw; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
  for a in base cw; do arm "$a p32768" $a "--prompt-len 32768 --decode-steps 8"; done
} > /tmp/arms-cw.txt
# A hung walk would hold the GPU: every arm under the deadline.
[ "$rc" = 0 ] && SKIP_TESTS=1 timeout "$(left 3)" bash scripts/device_check.sh /tmp/arms-cw.txt 2>&1 | grep -v "cannot access" | tail -12
bash scripts/out_bundle.sh
