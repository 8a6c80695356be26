set -u
# Call J: the narrow wgmma expert kernels (32-slot tiles, two CTAs per SM) for prefill chunks of
# 641-768 tokens, and the batched GDN step at four blocks per SM for the f16 state (K2). One
# binary set from the working tree (.device-j: lily, lily-bench, cuda_batch, cuda_prefill); the
# narrow route's base arm is the same binary with LILY_CUDA_WG_NARROW_TOKENS=0, K2's base is main
# at 88735ff (.device-fs). GPU tests first (cuda_prefill has the narrow kernels against the CPU,
# cuda_batch the GDN step), then the arms. Carry [".device-fs", ".device-j", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-fs
bash scripts/device_unpack.sh .device-j
[ -f "$LILY_CK/config.json" ] || (./.device-j/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
for suite in cuda_prefill cuda_batch; do
  timeout 200 "./.device-j/tests/$suite" --include-ignored --test-threads 2 > "$OUT/tests-$suite.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$suite.log"
  echo "[+$(( $(date +%s) - t0 ))s] $suite"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$suite.log" | tail -4
done
grep -h "Narrow" "$OUT/tests-cuda_prefill.log" | head -20
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-narrow-experts/arms-j.txt 2>&1 | tail -24
grep -E "moe\.|total|tok/s" "$OUT/bench-stderr.log" | head -60
python3 scripts/call_summary.py "$OUT" --base base 2>&1 | tail -30
bash scripts/out_bundle.sh
