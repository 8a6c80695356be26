set -u
# Call S: the down products' next item prefetched into L2 (.device-u: lily-bench and the
# cuda_batch / cuda_prefill tests with it) against main after call R (.device-t: lily and
# lily-bench), then issue 15's load test on main's lily: levels 1 / 4 / 16 / 64, greedy and
# sampled, ROUNDS=2, the default client processes, and 16 / 64 again with 16 client processes.
# Carry [".device-t", ".device-u", ".whl"]. ~8 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for d in .device-t .device-u; do bash scripts/device_unpack.sh $d; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-t/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
for suite in cuda_batch cuda_prefill; do
  timeout 150 "./.device-u/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  el "$suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
: > /tmp/arms-s.txt
for round in 1 2; do
  for args in "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in t u; do echo "$arm ${args%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${args#*|}" >> /tmp/arms-s.txt; done
  done
done
for arm in t u; do echo "$arm p4096 | BENCH=./.device-$arm/bin/lily-bench | --prompt-len 4096 --decode-steps 64" >> /tmp/arms-s.txt; done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-s.txt 2>&1 | tail -11
el arms
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-t/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" SPREAD_LEVELS=16,64 \
  timeout 330 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"client_procs": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - -
el load
bash scripts/out_bundle.sh
