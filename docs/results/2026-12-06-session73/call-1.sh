set -u
# Call 1 (session 73; any card, the load test on an H200 only; ~480 s):
# t32 = main + gemv-32-tokens.patch (session 72's prepared `gemv_tcq_32`); t32s = t32 +
# burst-32k.patch + the sampler's prefilter (`sample_small_k` lists each block's k largest from
# the values at or above the k-th largest of its threads' maxima, gathered in shared memory,
# instead of four radix passes over the whole slice).
# 1. t32s's cuda_batch and cuda_sampling suites (GPU tests included);
# 2. lily-bench, 700-token prompts, 128 steps: 64 rows greedy t32s / main (the GEMV sets), 64
#    rows chat-sampled t32s / t32 (the sampler), two rounds alternating, digests equal; the
#    64-row sampled timelines of t32 and t32s (the sampler's time per step before and after);
# 3. on an H200 with the suites passed: the 64-client load test, main / t32s alternating, twice.
# Carry [".device-t32", ".device-t32s", ".device-mainb", ".device-lilymain", ".whl/openai"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-570}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in t32 t32s mainb lilymain; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
LOAD=1; echo "$gpu" | grep -q H200 || LOAD=0
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-t32s/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
ok=1
for t in cuda_batch cuda_sampling; do
  timeout "$(left 400)" ./.device-t32s/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
  grep -q "rc=0" "$OUT/tests-$t.log" || ok=0
done
while [ ! -f /tmp/synth.rc ] && [ "$(left 380)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
CHAT="--temperature 0.7 --top-p 0.8 --top-k 20 --seed 1"
: > /tmp/arms-1.txt
for r in 1 2; do
  for ab in "t32s greedy" "mainb greedy" "t32s sampled" "t32 sampled"; do
    set -- $ab; s=""; [ "$2" = sampled ] && s="$CHAT"
    echo "$1 b64 $2 r$r | BENCH=./.device-$1/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64 $s" >> /tmp/arms-1.txt
  done
done
for a in t32 t32s; do
  echo "$a b64 sampled timeline | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64 $CHAT" >> /tmp/arms-1.txt
done
SKIP_TESTS=1 timeout "$(left $((LOAD * 160)))" bash scripts/device_check.sh /tmp/arms-1.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
if [ "$ok" = 1 ] && [ "$LOAD" = 1 ]; then
  for a in "main .device-lilymain/bin/lily" "t32s .device-t32s/bin/lily" "main-r2 .device-lilymain/bin/lily" "t32s-r2 .device-t32s/bin/lily"; do
    set -- $a; mkdir -p "$OUT/load-$1"
    OUT=$OUT/load-$1 LILY=$2 CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=64 \
      timeout "$(left 5)" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
  done
  el load
else
  echo "no load test: suites ok=$ok on $gpu"
fi
bash scripts/out_bundle.sh
