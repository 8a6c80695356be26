set -u
# Call V (next session's first): five prepared patches against main, bit-identical all
# (README.md; build-v.sh builds what it carries). .device-base: main's lily-bench; -p, -q, -q3,
# -g, -d: lily-bench with pf-scan-full-first / tcq-down-ring / + tcq-three-blocks /
# gemv-sets-first-item / gdn-step-pairs; -all: the four (not q3) stacked, with the cuda_prefill,
# cuda_batch and cuda_gpu tests. The tests first (on the stack: every patch's kernels; a failure
# is bisected with the single-patch builds), then lily-bench arms alternating, two rounds: decode
# at 16 and 64 rows (base, q, q3, g, d, all; the 64-row arm's prefill of 64 prompts also for p),
# prefill at 4,096 (base, p, all).
# Carry [".device-base", ".device-p", ".device-q", ".device-q3", ".device-g", ".device-d", ".device-all"]. ~8 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
arms="base p q q3 g d all"
for a in $arms; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
for t in cuda_prefill cuda_batch cuda_gpu; do
  timeout 150 "./.device-all/tests/$t" --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el "$t"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
wait $synth
: > /tmp/arms-v.txt
for round in 1 2; do
  for a in base q q3 g d all; do echo "$a b16 r$round | BENCH=./.device-$a/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16" >> /tmp/arms-v.txt; done
  for a in base p q q3 g d all; do echo "$a b64 r$round | BENCH=./.device-$a/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64" >> /tmp/arms-v.txt; done
  for a in base p all; do echo "$a p4096 r$round | BENCH=./.device-$a/bin/lily-bench | --prompt-len 4096 --decode-steps 16" >> /tmp/arms-v.txt; done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-v.txt 2>&1 | tail -34
el arms
bash scripts/out_bundle.sh
