set -u
# Call X (session 68): the decode horizon A/B through the server, and per-phase prefill profiles.
# .device-base: main at 2475ac9 (lily and lily-bench); .device-h: lily with DECODE_HORIZON 16 -> 64
# and a decode call ending when a row ends while a request waits (`Waiting`). Issue 15's load
# test (ROUNDS=2, 16 client processes, --trace-turns) on each, then levels 1 and 64 greedy again
# in the other order; then LILY_CUDA_PROFILE=1 lily-bench at 700, 4,096 and 8,192 tokens (base).
# Carry [".device-base", ".device-h", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base h; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || ./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
el synth
load() {  # ARM TAG [env...]
  local arm=$1 tag=$2; shift 2
  mkdir -p "$root/$tag"
  env "$@" OUT=$root/$tag LILY=.device-$arm/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
    timeout 220 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$tag /"
  el "$tag"
}
load base base
load h h
load h h2 LEVELS=1,64 MODES=greedy
load base base2 LEVELS=1,64 MODES=greedy
for n in 700 4096 8192; do
  LILY_CUDA_PROFILE=1 timeout 90 ./.device-base/bin/lily-bench --model "$LILY_CK" --prompt-len $n --decode-steps 8 > /dev/null 2> "$root/profile-$n.txt"
  el "profile $n"; grep "prefill profile" "$root/profile-$n.txt" | tail -1
done
bash scripts/out_bundle.sh
