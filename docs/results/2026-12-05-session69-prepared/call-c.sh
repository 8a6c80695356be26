set -u
# Call C (prepared in session 69, not run: no device was lent after call B): the few-row products
# on the tensor cores (few-tc.patch, fixed after call B: 4-bit codes as f16 16 + q, a warp per
# (chunk, part) only) and the prefill's row norms a block per row (norms.patch, on top).
# build-c.sh builds, from a clean main: .device-base (lily, lily-bench), .device-r (lily-bench
# with few-tc.patch), .device-rn (lily, lily-bench, cuda_prefill, cuda_gpu with both patches).
# The tests on rn, then lily-bench prefill at 700, 4,096, 8,192, 32,768 and 64 x 700, base / r /
# rn, two rounds, then LILY_CUDA_PROFILE=1 at 700 and 4,096 on rn; then issue 15's load test at
# 1 and 64 clients (ROUNDS=2, 16 client processes, greedy and sampled) on base and rn.
# Carry [".device-base", ".device-r", ".device-rn", ".whl/openai"] (~61 MB with the tracked tree). ~6 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base r rn; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
for t in cuda_prefill cuda_gpu; do
  timeout 200 ./.device-rn/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
grep -h "few rows\|tensor cores" "$OUT/tests-cuda_prefill.log" | head -24
wait $synth
: > /tmp/arms-c.txt
for round in 1 2; do
  for a in "p700|--prompt-len 700 --decode-steps 8" "p4096|--prompt-len 4096 --decode-steps 8" "p8192|--prompt-len 8192 --decode-steps 8" "p32768|--prompt-len 32768 --decode-steps 8" "b64|--prompt-len 700 --decode-steps 32 --batch 64"; do
    for arm in base r rn; do
      echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-c.txt
    done
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-c.txt 2>&1 | grep -v "cannot access" | tail -40
el arms
for n in 700 4096; do
  LILY_CUDA_PROFILE=1 timeout 90 ./.device-rn/bin/lily-bench --model "$LILY_CK" --prompt-len $n --decode-steps 8 > /dev/null 2> "$root/profile-rn-$n.txt"
  el "profile $n"; grep -A18 "prefill profile" "$root/profile-rn-$n.txt" | tail -18
done
load() {  # ARM TAG [env...]
  local arm=$1 tag=$2; shift 2
  mkdir -p "$root/$tag"
  env "$@" OUT=$root/$tag LILY=.device-$arm/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
    timeout 150 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$tag /"
  el "$tag"
}
load base base LEVELS=1,64
load rn rn LEVELS=1,64
bash scripts/out_bundle.sh
