set -u
# Call H (prepared in session 72, not run; any card, the load test on an H200 only; ~330 s):
# gemv-32-tokens.patch (`gemv_tcq_32`: the GEMV sets of steps of more than 16 tokens over up to
# 2,048 columns with 32 tokens per block, one block per SM, each warp's weights through a
# 6-stage ring; a 64-row step then dequantises each weight twice instead of four times; the
# same tiles and K slices, so bit-identical). 1. its `cuda_batch` (the GEMV-set test at 17, 32,
# 33, 64 and 100 tokens bit for bit against the row-order kernels; the tiny model's steps of
# more than 16 rows); 2. lily-bench at 64 and 32 rows x 700 (128 steps), t32 and main
# alternating, two rounds at 64, digests equal; the 64-row timeline on t32; 3. on an H200 with
# the suite passed, the 64-client load test on t32's lily and main's, alternating.
# build: session 72 built the carry (.device-t32 with the patch applied: lily-bench, lily and the
# cuda_batch test; .device-mainb: main's lily-bench; .device-lilymain from build-g.sh); rebuild
# with `git apply P/gemv-32-tokens.patch; cargo build --release --features cuda-testing --bin lily
# --bin lily-bench; . scripts/arm_pack.sh; arm_bins .device-t32 lily-bench lily; arm_test
# .device-t32 cuda_batch; git apply -R P/gemv-32-tokens.patch`, then main's lily-bench into
# .device-mainb the same way (arm_bins packs target/release as it is: build first).
# Carry [".device-t32", ".device-mainb", ".device-lilymain", ".whl/openai"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-330}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in t32 mainb lilymain; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
LOAD=1; echo "$gpu" | grep -q H200 || LOAD=0
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-t32/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout "$(left 250)" ./.device-t32/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch.log" | tail -4
ok=0; grep -q "rc=0" "$OUT/tests-cuda_batch.log" && ok=1
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
: > /tmp/arms-h.txt
for ab in "t32 64" "mainb 64" "t32 32" "mainb 32" "t32 64" "mainb 64"; do
  set -- $ab
  echo "$1 b$2 | BENCH=./.device-$1/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch $2" >> /tmp/arms-h.txt
done
echo "t32 b64 timeline | BENCH=./.device-t32/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64" >> /tmp/arms-h.txt
SKIP_TESTS=1 timeout "$(left $((LOAD * 120)))" bash scripts/device_check.sh /tmp/arms-h.txt 2>&1 | grep -v "cannot access" | tail -10
el arms
if [ "$ok" = 1 ] && [ "$LOAD" = 1 ]; then
  for a in "t32 .device-t32/bin/lily" "main .device-lilymain/bin/lily" "t32-r2 .device-t32/bin/lily" ; do
    set -- $a; mkdir -p "$OUT/load-$1"
    OUT=$OUT/load-$1 LILY=$2 CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=64 \
      timeout "$(left 5)" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
  done
  el load
else
  echo "no load test: suite ok=$ok on $gpu"
fi
bash scripts/out_bundle.sh
