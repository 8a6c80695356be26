set -u
# Call D2 (prepared in session 70), at once after D1 on the same warm machine, the same carry
# [".device-base", ".device-rn", ".device-rng", ".whl/openai"]: cuda_batch again (D1 found the
# routing test comparing the experts' slot lists in the order of shared-memory atomics; now
# sorted, as the older routing test does); rn's decode arms of D1, one round (rn has only the
# prefill patches, so rng's digests must equal rn's: the GDN and routing patches bit-identical end
# to end); lily-bench prefill at 8,192 and 32,768 tokens base vs rn (one round); the 700 and 4,096-token prefill profiles on rn; issue
# 15's load test at 1 and 64 clients (ROUNDS=2, 16 client processes, greedy and sampled) on base
# with text prompts and with token-id prompts (the form of the tables before session 70), and on
# rng with text prompts. ~5 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base rn rng; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
timeout 200 ./.device-rng/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch.log" | tail -4
wait $synth
: > /tmp/arms-d2.txt
for a in "d4096|--prompt-len 4096 --decode-steps 128" "b4|--prompt-len 700 --decode-steps 128 --batch 4" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
  echo "rn ${a%%|*} r1 | BENCH=./.device-rn/bin/lily-bench | ${a#*|}" >> /tmp/arms-d2.txt
done
for a in "p8192|--prompt-len 8192 --decode-steps 8" "p32768|--prompt-len 32768 --decode-steps 8"; do
  for arm in base rn; do
    echo "$arm ${a%%|*} r1 | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-d2.txt
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-d2.txt 2>&1 | grep -v "cannot access" | tail -16
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
