set -u
# Peer call 2 of 2, on call-p1's warm machine: llama-batched-bench (waits for its build; 700-token
# prompts, 128 decoded, 1/4/16/32/64 sequences), then issue 15's load test on main (ROUNDS=2, 16
# client processes) once the build's cores are free. Carry [".device-base", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device_unpack.sh .device-base
OUT=$root timeout 330 bash bench/h200_steps.sh batched 240
el llama-batched-bench
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-base/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
  timeout 200 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
el load
bash scripts/out_bundle.sh
