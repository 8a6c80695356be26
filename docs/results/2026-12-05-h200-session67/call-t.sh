set -u
# Call T: the shared expert's tiles listed first by the batched routing (.device-v: lily-bench and
# the cuda_batch / cuda_gpu tests with it) against main (.device-t: lily and lily-bench), then
# main's headline lily-bench arms (prefill and one sequence at 4K, 8K, 700, 32K, 131K), then issue
# 15's load test on main's lily, ROUNDS=4, levels 1 / 4 / 16 / 64, greedy and sampled, over 16
# client processes (one per client up to 16 clients, four at 64).
# PARTS (default "ab headline load") picks the parts. Carry [".device-t", ".device-v", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for d in .device-t .device-v; do bash scripts/device_unpack.sh $d; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-t/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
PARTS=${PARTS:-ab headline load}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
has ab && for suite in cuda_batch cuda_gpu; do
  timeout 120 "./.device-v/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  el "$suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
: > /tmp/arms-t.txt
has ab && for round in 1 2; do
  for args in "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in t v; do echo "$arm ${args%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${args#*|}" >> /tmp/arms-t.txt; done
  done
done
# main's headline figures for issues 17 and 18 on this machine (one round each).
has headline && for a in "p4096|--prompt-len 4096 --decode-steps 64" "p8192|--prompt-len 8192 --decode-steps 64" "p700|--prompt-len 700 --decode-steps 128" "p32768|--prompt-len 32768 --decode-steps 64" "p131072|--prompt-len 131072 --decode-steps 32"; do
  echo "t ${a%%|*} | BENCH=./.device-t/bin/lily-bench | ${a#*|}" >> /tmp/arms-t.txt
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-t.txt 2>&1 | tail -14
el arms
mkdir -p "$root/serve"
has load && OUT=$root/serve LILY=.device-t/bin/lily CK=$LILY_CK ROUNDS=4 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
  timeout 300 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"client_procs": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - -
el load
bash scripts/out_bundle.sh
