set -u
# Call 1 (session 74; ~560 s): bf = main + the affine GEMV sets (the dense projections' weights
# rounded to bf16, read from the bf16 copies at >= 16 tokens, from the codes below; bit-identical
# either way); base = main.
# 1. bf's cuda_batch suite and cuda_prefill's bf16-copy test (GPU tests included);
# 2. lily-bench, 700-token prompts, 128 steps, greedy: base / bf at 64, 16 and 4 rows; then bf
#    with the copies read at every token count (LILY_GEMV_BF16_MIN_TOKENS=2, the experiment's
#    switch) at 4 and 8 rows beside base and bf;
# 3. the 64-client load test, base / bf (ROUNDS=2, 16 client processes);
# 4. round 2 of the 64 / 16-row arms and bf's 64-row timeline while the deadline allows.
# Carry [".device-bf", ".device-base", ".whl/openai"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-570}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in bf base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
LOAD=1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-bf/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
ok=1
timeout "$(left 460)" ./.device-bf/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=|rel RMS" "$OUT/tests-cuda_batch.log" | tail -14
grep -q "rc=0" "$OUT/tests-cuda_batch.log" || ok=0
timeout "$(left 450)" ./.device-bf/tests/cuda_prefill --include-ignored --exact cuda_prefill_dense_bf16_copies_change_no_bit > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -3
grep -q "rc=0" "$OUT/tests-cuda_prefill.log" || ok=0
while [ ! -f /tmp/synth.rc ] && [ "$(left 380)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench $3 | --prompt-len 700 --decode-steps 128 --batch $4"; }
{
  for b in 64 16 4; do arm "base b$b r1" base "" $b; arm "bf b$b r1" bf "" $b; done
  arm "bf-all b4" bf LILY_GEMV_BF16_MIN_TOKENS=2 4
  for b in 8; do arm "base b$b" base "" $b; arm "bf b$b" bf "" $b; arm "bf-all b$b" bf LILY_GEMV_BF16_MIN_TOKENS=2 $b; done
} > /tmp/arms-1.txt
SKIP_TESTS=1 timeout "$(left $((LOAD * 140 + 60)))" bash scripts/device_check.sh /tmp/arms-1.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
if [ "$ok" = 1 ] && [ "$LOAD" = 1 ]; then
  for a in "base .device-base/bin/lily" "bf .device-bf/bin/lily"; do
    set -- $a; mkdir -p "$OUT/load-$1"
    OUT=$OUT/load-$1 LILY=$2 CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=64 \
      timeout "$(left 62)" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
  done
  el load
else
  echo "no load test: suites ok=$ok on $gpu"
fi
{
  for b in 64 16; do arm "bf b$b r2" bf "" $b; arm "base b$b r2" base "" $b; done
  echo "bf b64 timeline | BENCH=./.device-bf/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64"
} > /tmp/arms-2.txt
OUT=$OUT/r2 SKIP_TESTS=1 timeout "$(left 3)" bash scripts/device_check.sh /tmp/arms-2.txt 2>&1 | grep -v "cannot access" | tail -8
bash scripts/out_bundle.sh
