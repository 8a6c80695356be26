set -u
# Call V (next session's first): main (.device-base: lily and lily-bench) on the issues' machine
# if one comes, and pf-scan-full-first.patch (.device-p: lily-bench and the cuda_prefill test
# with it). 1. cuda_prefill on the patch; 2. issue 15's load test on main, ROUNDS=2, levels
# 1 / 4 / 16 / 64, greedy and sampled, 16 client processes; 3. the patch's A/B (prefill at 4K,
# 8K, 700 and 64 prompts of 700, base and patch alternating, two rounds); 4. main's long-context
# arms (32K, 131K). Carry [".device-base", ".device-p", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for d in .device-base .device-p; do bash scripts/device_unpack.sh $d; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
timeout 150 ./.device-p/tests/cuda_prefill --include-ignored --test-threads 2 > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -4
wait $synth
mkdir -p "$root/serve"
OUT=$root/serve LILY=.device-base/bin/lily CK=$LILY_CK ROUNDS=2 SERVE_ARGS="--trace-turns" CLIENT_PROCS=16 \
  timeout 200 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"client_procs": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - -
el load
: > /tmp/arms-v.txt
for round in 1 2; do
  for a in "p4096|--prompt-len 4096 --decode-steps 64" "p8192|--prompt-len 8192 --decode-steps 16" "p700|--prompt-len 700 --decode-steps 64" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in base p; do echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-v.txt; done
  done
done
for a in "p32768|--prompt-len 32768 --decode-steps 64" "p131072|--prompt-len 131072 --decode-steps 32"; do
  echo "base ${a%%|*} | BENCH=./.device-base/bin/lily-bench | ${a#*|}" >> /tmp/arms-v.txt
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-v.txt 2>&1 | tail -19
el arms
bash scripts/out_bundle.sh
