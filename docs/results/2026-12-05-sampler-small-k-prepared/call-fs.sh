set -u
# The one-launch sampler on top of the f16 GDN states in their landing form (default on): the GPU
# tests of main + land-f16 + sampler-small-k-after-f16 (cuda_sampling, cuda_batch, cuda_gpu,
# cuda_fixture: the landed defaults' suites), then f16 (landed, no sampler patch) against fsk
# (with it), chat sampling at one sequence after 4K and 16 / 64 rows; every fsk digest must equal
# f16's. Carry [".device-fs"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-fs
[ -f "$LILY_CK/config.json" ] || (./.device-fs/bin/lily-bench-f16 --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
for bin in cuda_sampling cuda_batch cuda_gpu cuda_fixture; do
  timeout "${TEST_TIMEOUT:-150}" "./.device-fs/tests/$bin" --include-ignored --test-threads 2 > "$OUT/tests-$bin.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$bin.log"
  echo "[+$(( $(date +%s) - t0 ))s] $bin"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$bin.log" | tail -4
done
grep -hE ": PPL .*KL" "$OUT"/tests-cuda_fixture.log | head
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh .device-fs/arms-fs.txt 2>&1 | tail -12
echo "[+$(( $(date +%s) - t0 ))s] arms"
python3 scripts/call_summary.py "$OUT" --base f16 --same fsk=f16
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
