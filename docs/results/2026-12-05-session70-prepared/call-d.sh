set -u
# Call D (prepared in session 70; supersedes session 69's call C): the prefill's few-row products
# on the tensor cores and its row norms a block per row (session 69's few-tc.patch, norms.patch),
# the batched GDN step's factors and gates formed once per block (gdn-step-once.patch) and the GDN
# decode steps at the 35B's head shapes as compile-time constants (gdn-step-35b.patch).
# build-d.sh builds, from a clean main: .device-base (lily, lily-bench), .device-rn (lily-bench
# with the two prefill patches), .device-rng (lily, lily-bench, cuda_prefill, cuda_gpu, cuda_batch
# with all three). The tests on rng; lily-bench prefill at 700 / 4,096 / 8,192 / 32,768 base vs rn
# and decode after 4,096 tokens and at 16 and 64 rows x 700 (128 steps) base vs rng, two rounds; the 700 and
# 4,096 prefill profiles on rn; issue 15's load test at 1 and 64 clients (ROUNDS=2, 16 client
# processes, greedy and sampled, text prompts) on base and rng, and on base with token-id
# prompts too (the form of the tables before session 70).
# Carry [".device-base", ".device-rn", ".device-rng", ".whl/openai"] (~63 MiB with the tracked
# tree). ~6 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base rn rng; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
for t in cuda_prefill cuda_gpu cuda_batch; do
  timeout 200 ./.device-rng/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
grep -h "few rows\|tensor cores" "$OUT/tests-cuda_prefill.log" | head -24
wait $synth
: > /tmp/arms-d.txt
for round in 1 2; do
  for a in "p700|--prompt-len 700 --decode-steps 8" "p4096|--prompt-len 4096 --decode-steps 8" "p8192|--prompt-len 8192 --decode-steps 8" "p32768|--prompt-len 32768 --decode-steps 8"; do
    for arm in base rn; do
      echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-d.txt
    done
  done
  for a in "d4096|--prompt-len 4096 --decode-steps 128" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in base rng; do
      echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-d.txt
    done
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-d.txt 2>&1 | grep -v "cannot access" | tail -40
el arms
for n in 700 4096; do
  LILY_CUDA_PROFILE=1 timeout 90 ./.device-rn/bin/lily-bench --model "$LILY_CK" --prompt-len $n --decode-steps 8 > /dev/null 2> "$root/profile-rn-$n.txt"
  el "profile $n"; grep -A18 "prefill profile" "$root/profile-rn-$n.txt" | tail -18
done
load() {  # ARM TAG [env...]
  local arm=$1 tag=$2; shift 2
  mkdir -p "$root/$tag"
  env "$@" OUT=$root/$tag LILY=.device-$arm/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
    timeout 240 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$tag /"
  el "$tag"
}
load base base LEVELS=1,64 IDS_LEVELS=1,64
load rng rng LEVELS=1,64
bash scripts/out_bundle.sh
