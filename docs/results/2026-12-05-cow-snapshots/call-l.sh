set -u
# Call L: prefix-cache snapshots that share the partly filled last KV page (copy on write when a
# copy continues; no page mapping, no copy and no stream synchronisation per snapshot).
# .device-l: lily and the cuda_memory / cuda_gpu / cuda_batch tests built from main with
# cow-snapshots.patch applied; .device-k: main as landed (lily, lily-bench). GPU tests first, then
# the load test at 16 and 64 clients (greedy and sampled, ROUNDS=2, --trace-turns) on main's
# server and on the patched one, then lily-bench's headline arms on main.
# Carry [".device-k", ".device-l", ".whl"]. ~5 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-k
bash scripts/device_unpack.sh .device-l
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-k/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
for suite in cuda_memory cuda_gpu cuda_batch; do
  timeout 200 "./.device-l/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  echo "[+$(( $(date +%s) - t0 ))s] $suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
for arm in main cow; do
  bin=.device-k/bin/lily; [ $arm = cow ] && bin=.device-l/bin/lily
  mkdir -p "$root/$arm"
  echo "== $arm"
  OUT=$root/$arm LILY=$bin CK=$LILY_CK ROUNDS=2 LEVELS=16,64 SERVE_ARGS="--trace-turns" \
    bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
done
OUT=$root SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-landed-h200/arms-k.txt 2>&1 | tail -8
bash scripts/out_bundle.sh
