set -u
# Call E (session 70, after the landing of 69e0336): cuda_batch with route-35b.patch (its routing
# test now compares each expert's slot list sorted); lily-bench, one round: main's prefill at
# 4,096 with 8 decode steps (its digest against call D1's rn arm, the prefill patches alone: the
# decode patches bit-identical end to end where the card is the same), decode after 4,096 tokens
# and at 4, 16 and 64 rows x 700 on main before the landing (base), main (new) and main with
# route-35b (rr; its digests must equal new's); issue 15's load test at 1 and 64 clients
# (ROUNDS=2, 16 client processes, greedy and sampled) on base with text prompts (and token-id
# ones at 1 client) and on new with text prompts.
# Carry [".device-base", ".device-new", ".device-rr", ".whl/openai"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base new rr; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
timeout 200 ./.device-rr/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch.log" | tail -4
wait $synth
: > /tmp/arms-e.txt
echo "new p4096s8 r1 | BENCH=./.device-new/bin/lily-bench | --prompt-len 4096 --decode-steps 8" >> /tmp/arms-e.txt
for a in "d4096|--prompt-len 4096 --decode-steps 128" "b4|--prompt-len 700 --decode-steps 128 --batch 4" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
  for arm in base new rr; do
    [ "$arm ${a%%|*}" = "base b4" ] && continue  # call D1 has it
    echo "$arm ${a%%|*} r1 | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-e.txt
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-e.txt 2>&1 | grep -v "cannot access" | tail -16
el arms
load() {  # ARM TAG [env...]
  local arm=$1 tag=$2; shift 2
  mkdir -p "$root/$tag"
  env "$@" OUT=$root/$tag LILY=.device-$arm/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
    timeout 240 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$tag /"
  el "$tag"
}
load base base LEVELS=1,64 IDS_LEVELS=1
load new new LEVELS=1,64
bash scripts/out_bundle.sh
