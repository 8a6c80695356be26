set -u
# Call F (session 72; any card): the GPU tests of batched-35b-shapes.patch (session 71) and of the
# batched GEMV sets' weight ring (gemv_tcq, on top of it): cuda_batch of the ring build, cuda_prefill
# of the patch build; then lily-bench at 64 and 16 rows x 700 (128 steps, one round) for main
# (a6fbf5d's kernels), the patch and the ring, whose digests must be equal (bit-identical
# changes), and the ring's 64-row decode timeline; then, on an H200 with both suites passed,
# issue 15's load test at 64 clients (greedy and sampled, ROUNDS=2) on the ring's lily.
# Carry [".device-base", ".device-pre", ".device-ring", ".device-lilyring", ".whl/openai"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
# DEADLINE: the seconds the call may take (the tool's limit a little above); LOAD=0 leaves out the
# load test (its 110 s are then the arms').
DEADLINE=${DEADLINE:-420} LOAD=${LOAD:-1}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in base pre ring lilyring; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
echo "$gpu" | grep -q H200 || LOAD=0  # issue 15's table is an H200's
setsid nohup bash -c "./.device-lilyring/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
ok=1
for t in .device-ring/tests/cuda_batch .device-pre/tests/cuda_prefill; do
  n=$(basename $t)
  timeout "$(left 200)" ./$t --include-ignored --test-threads 2 > "$OUT/tests-$n.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$n.log"
  el $n; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$n.log" | tail -4
  grep -q "rc=0" "$OUT/tests-$n.log" || ok=0
done
while [ ! -f /tmp/synth.rc ] && [ "$(left 150)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
: > /tmp/arms-f.txt
# In order of what matters most, should the call's time run out.
for ab in "ring 64" "base 64" "pre 64" "ring 16" "base 16" "pre 16"; do
  set -- $ab
  echo "$1 b$2 | BENCH=./.device-$1/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch $2" >> /tmp/arms-f.txt
done
echo "ring b64 timeline | BENCH=./.device-ring/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64" >> /tmp/arms-f.txt
SKIP_TESTS=1 timeout "$(left $((LOAD * 110)))" bash scripts/device_check.sh /tmp/arms-f.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
if [ "$ok" = 1 ] && [ "$LOAD" = 1 ] && echo "$gpu" | grep -q H200; then
  mkdir -p "$OUT/load"
  OUT=$OUT/load LILY=.device-lilyring/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=${LOAD_LEVELS:-64} \
    timeout "$(left 5)" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
  el load
else
  echo "no load test: suites ok=$ok on $gpu"
fi
bash scripts/out_bundle.sh
