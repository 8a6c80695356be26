set -u
# Call Y (session 68): a new single sequence's decode graph taken over from the least recently
# used one (cuGraphExecUpdate) once all 8 places are held. .device-h: main at 7986268 (lily);
# .device-g2: lily with the update, and the cuda_gpu tests (the new one runs 12 sequences against
# direct launches). Then the load test's one-client level (greedy and sampled, 8 requests each:
# only a lone stream takes the single-sequence path), h / g2 / h / g2.
# Carry [".device-h", ".device-g2", ".whl"]. ~3 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in h g2; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-h/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
timeout 120 ./.device-g2/tests/cuda_gpu --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_gpu.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_gpu.log"
el cuda_gpu; grep -E "^test result|FAILED|panicked|rc=|graph updates" "$OUT/tests-cuda_gpu.log" | tail -5
wait $synth
load() {  # ARM TAG
  mkdir -p "$root/$2"
  OUT=$root/$2 LILY=.device-$1/bin/lily CK=$LILY_CK ROUNDS=8 LEVELS=1 SERVE_ARGS="--trace-turns" \
    timeout 100 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"aggregate_tok_s": [0-9.]*\|"p50": [0-9.]*' | paste - - - - | sed "s/^/$2 /"
  el "$2"
}
load h h
load g2 g2
load h h-2
load g2 g2-2
bash scripts/out_bundle.sh
