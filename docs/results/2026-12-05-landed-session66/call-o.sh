set -u
# Call O: main as landed in session 66 (00d53dd: CoW snapshots, the burst rule; .device-o:
# lily from .device-n, lily-bench from .device-m, the same sources for it) on the machine issues
# 15, 17 and 18 name, if one comes: lily-bench's headline arms (prefill and one sequence after
# 4K, 32K and 131K, 700-token prompts alone and at 16 / 64 rows), then issue 15's load test
# (levels 1 / 4 / 16 / 64, greedy and sampled, ROUNDS=2, --trace-turns).
# Carry [".device-o", ".whl"]. ~6 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-o
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
[ -f "$LILY_CK/config.json" ] || ./.device-o/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
OUT=$root SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-landed-session66/arms-o.txt 2>&1 | tail -9
echo "[+$(( $(date +%s) - t0 ))s] arms"
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-o/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" \
  bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
echo "[+$(( $(date +%s) - t0 ))s] load"
bash scripts/out_bundle.sh
