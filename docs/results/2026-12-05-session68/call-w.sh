set -u
# Call W: main as landed (.device-base: lily and lily-bench; rebuild it after call V's landings)
# on the issues' machine if one comes: issue 15's load test, ROUNDS=2, levels 1 / 4 / 16 / 64,
# greedy and sampled, 16 client processes; then the headline lily-bench arms (16 and 64 rows, one
# sequence after 4K, 8K, 32K and 131K). Carry [".device-base", ".whl"]. ~5 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device_unpack.sh .device-base
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || ./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
el synth
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-base/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
  timeout 200 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"client_procs": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - -
el load
: > /tmp/arms-w.txt
for a in "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64" "p4096|--prompt-len 4096 --decode-steps 64" "p8192|--prompt-len 8192 --decode-steps 64" "p32768|--prompt-len 32768 --decode-steps 64" "p131072|--prompt-len 131072 --decode-steps 32"; do
  echo "main ${a%%|*} | BENCH=./.device-base/bin/lily-bench | ${a#*|}" >> /tmp/arms-w.txt
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-w.txt 2>&1 | tail -7
el arms
bash scripts/out_bundle.sh
