set -u
# Call V (next session's first): four prepared patches against main, bit-identical all.
# .device-base: main's lily-bench; .device-p: + pf-scan-full-first.patch (lily-bench and the
# cuda_prefill test); .device-q: main + tcq-down-ring.patch (lily-bench, cuda_prefill, cuda_batch);
# .device-q3: + tcq-three-blocks.patch on top of q (lily-bench); .device-g: main +
# gemv-sets-first-item.patch (lily-bench, cuda_batch). The tests first, then lily-bench arms
# alternating, two rounds: decode at 16 and 64 rows (base, q, q3, g; the 64-row arm's prefill of
# 64 prompts also for p), prefill at 4,096 and 700 (base, p).
# Carry [".device-base", ".device-p", ".device-q", ".device-q3", ".device-g"]. ~8 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for d in .device-base .device-p .device-q .device-q3 .device-g; do bash scripts/device_unpack.sh $d; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
for t in p/cuda_prefill q/cuda_prefill q/cuda_batch g/cuda_batch; do
  log="$OUT/tests-${t%%/*}-${t#*/}.log"
  timeout 120 "./.device-$t" --include-ignored --test-threads 2 > "$log" 2>&1
  echo "rc=$?" >> "$log"
  el "$t"; grep -E "^test result|FAILED|panicked|rc=" "$log" | tail -4
done
wait $synth
: > /tmp/arms-v.txt
for round in 1 2; do
  for arm in base q q3 g; do echo "$arm b16 r$round | BENCH=./.device-$arm/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16" >> /tmp/arms-v.txt; done
  for arm in base p q q3 g; do echo "$arm b64 r$round | BENCH=./.device-$arm/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64" >> /tmp/arms-v.txt; done
  for a in "p4096|--prompt-len 4096 --decode-steps 16" "p700|--prompt-len 700 --decode-steps 16"; do
    for arm in base p; do echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-v.txt; done
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-v.txt 2>&1 | tail -28
el arms
bash scripts/out_bundle.sh
