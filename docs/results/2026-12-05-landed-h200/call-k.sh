set -u
# Call K: main as landed in session 65 (.device-k: lily, lily-bench) on the machine issues 15, 17
# and 18 name: lily-bench (prefill and one sequence after 4K and 32K, 700-token prompts alone
# and at 16 / 64 rows), then issue 15's load test (levels 1 / 4 / 16 / 64, greedy and sampled,
# ROUNDS=2) with --trace-turns. Carry [".device-k", ".whl"]. ~6 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-k
[ -f "$LILY_CK/config.json" ] || ./.device-k/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-landed-h200/arms-k.txt 2>&1 | tail -8
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-k/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" \
  bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
bash scripts/out_bundle.sh
