set -u
# Call 3 (session 75; ~150 s, on a warm machine): where moe_route_batch's time goes, by running
# one of its parts twice (route_twice.py: the same outputs, so the digests must equal base's and
# the step grows by that part's cost in the graph): xgemv (the router GEMV and block sums, two
# blocks per SM as main), xtopk (each token group's last block: logits, top-k, counts), xlists
# (the last group's block: scans, tiles, lists); base = main. lily-bench 700 x 128 greedy at 64
# and 16 rows, one round (a second while the deadline allows).
# Carry [".device-base", ".device-xgemv", ".device-xtopk", ".device-xlists"] (the arms carried run).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-240}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
ARMS=$(for a in base xgemv xtopk xlists; do [ -d .device-$a ] && echo $a; done)
for a in $ARMS; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] || ./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1
el "synth rc=$?"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch $3"; }
{
  for r in 1 2; do
    for b in 64 16; do for a in $ARMS; do arm "$a b$b r$r" $a $b; done; done
  done
} > /tmp/arms-3.txt
SKIP_TESTS=1 timeout "$(left 3)" bash scripts/device_check.sh /tmp/arms-3.txt 2>&1 | grep -v "cannot access" | tail -17
bash scripts/out_bundle.sh
