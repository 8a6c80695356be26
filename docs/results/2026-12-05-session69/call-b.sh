set -u
# Call B (session 69): the few-row products on the tensor cores (pf_few_tc) against main.
# .device-base: main at 1b1dad2 (lily, lily-bench); .device-r: the working tree (lily, lily-bench,
# the cuda_prefill and cuda_gpu tests). The tests on r, then lily-bench prefill at 700, 4,096,
# 8,192 and 32,768 tokens and 64 x 700 rows, base / r alternating, then LILY_CUDA_PROFILE=1 at 700
# and 4,096 on r. Carry [".device-base", ".device-r"]. ~4 min (call A: the tests failed, GW wrong; this is the f16 form).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base r; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
for t in cuda_prefill cuda_gpu; do
  timeout 200 ./.device-r/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
grep -h "few rows\|tensor cores" "$OUT/tests-cuda_prefill.log" | head -40
wait $synth
: > /tmp/arms-a.txt
for a in "p700|--prompt-len 700 --decode-steps 8" "p4096|--prompt-len 4096 --decode-steps 8" "p8192|--prompt-len 8192 --decode-steps 8" "p32768|--prompt-len 32768 --decode-steps 8" "b64|--prompt-len 700 --decode-steps 32 --batch 64"; do
  for arm in base r; do
    echo "$arm ${a%%|*} | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-a.txt
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-a.txt 2>&1 | tail -14
el arms
for n in 700 4096; do
  LILY_CUDA_PROFILE=1 timeout 90 ./.device-r/bin/lily-bench --model "$LILY_CK" --prompt-len $n --decode-steps 8 > /dev/null 2> "$root/profile-r-$n.txt"
  el "profile $n"; grep -A20 "prefill profile" "$root/profile-r-$n.txt" | tail -18
done
bash scripts/out_bundle.sh
