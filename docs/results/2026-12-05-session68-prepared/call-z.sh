set -u
# Call Z: gdn-step-quads.patch against main (README.md; build-z.sh builds what it carries).
# cuda_batch on the patch, then lily-bench 16 and 64 rows x 700, two rounds, alternating.
# Carry [".device-base", ".device-q4"]. ~3 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base q4; do bash scripts/device_unpack.sh .device-$a; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
timeout 120 ./.device-q4/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch.log"
el cuda_batch; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch.log" | tail -4
wait $synth
: > /tmp/arms-z.txt
for round in 1 2; do
  for a in base q4; do
    echo "$a b16 r$round | BENCH=./.device-$a/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 16" >> /tmp/arms-z.txt
    echo "$a b64 r$round | BENCH=./.device-$a/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64" >> /tmp/arms-z.txt
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-z.txt 2>&1 | tail -10
el arms
bash scripts/out_bundle.sh
