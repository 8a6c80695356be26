set -u
# Call M: main with the CoW snapshot patch and argmax_grid on sample_block_argmax (.device-m:
# lily, lily-bench, the cuda_memory /
# cuda_gpu / cuda_batch tests) and the same with the burst rule for rows with their first tokens
# out (.device-n: lily). GPU tests first (cuda_memory decides whether the patch lands), then
# lily-bench's headline arms, then issue 15's load test with --trace-turns: the burst rule's
# server at levels 1/4/16/64, the CoW server at 16/64 beside it (greedy and sampled, ROUNDS=2).
# Carry [".device-m", ".device-n", ".whl"]. ~8 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-m
bash scripts/device_unpack.sh .device-n
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-m/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
for suite in cuda_memory cuda_gpu cuda_batch; do
  timeout 200 "./.device-m/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  echo "[+$(( $(date +%s) - t0 ))s] $suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
wait $synth
OUT=$root SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-cow-landed/arms-m.txt 2>&1 | tail -8
echo "[+$(( $(date +%s) - t0 ))s] arms"
for arm in n m; do
  levels=1,4,16,64; [ $arm = m ] && levels=16,64
  mkdir -p "$root/serve-$arm"
  echo "== $arm"
  OUT=$root/serve-$arm LILY=.device-$arm/bin/lily CK=$LILY_CK ROUNDS=2 LEVELS=$levels SERVE_ARGS="--trace-turns" \
    bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
  echo "[+$(( $(date +%s) - t0 ))s] load $arm"
done
bash scripts/out_bundle.sh
