set -u
# Call D1 (prepared in session 70; with D2 on the same warm machine, supersedes session 69's
# call C): session 69's prefill patches (few-tc.patch, norms.patch) and this session's GDN step
# and routing patches (gdn-step-once, gdn-step-35b, route-35b, gdn-persist-35b). build-d.sh
# builds, from a clean main: .device-base (lily, lily-bench), .device-rn (lily-bench with the two
# prefill patches), .device-rng (lily, lily-bench, cuda_prefill, cuda_gpu, cuda_batch with all
# six). D1: the three GPU suites on rng, then lily-bench two rounds: prefill at 700 and 4,096
# tokens base vs rn; decode after 4,096 tokens and at 4, 16 and 64 rows x 700 (128 steps) base
# vs rng (the GDN and routing patches are bit-identical: rng's digests must equal base's).
# Carry [".device-base", ".device-rn", ".device-rng", ".whl/openai"] (~63 MiB with the tracked
# tree). ~7 min.
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
: > /tmp/arms-d1.txt
for round in 1 2; do
  for a in "p700|--prompt-len 700 --decode-steps 8" "p4096|--prompt-len 4096 --decode-steps 8"; do
    for arm in base rn; do
      echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-d1.txt
    done
  done
  for a in "d4096|--prompt-len 4096 --decode-steps 128" "b4|--prompt-len 700 --decode-steps 128 --batch 4" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64"; do
    for arm in base rng; do
      echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-d1.txt
    done
  done
done
SKIP_TESTS=1 bash scripts/device_check.sh /tmp/arms-d1.txt 2>&1 | grep -v "cannot access" | tail -40
el arms
bash scripts/out_bundle.sh
