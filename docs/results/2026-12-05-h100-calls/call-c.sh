set -u
# Prepared call (session 62, docs/results/2026-12-05-gdn-state-f16-prepared/): the GDN recurrent
# states stored in f16 (LILY_GDN_STATE=f16; one binary, the f32 default's kernels byte-identical to
# main's). Carry [".device-gs"] (not .device: 64 MiB). The GPU tests of the patch (cuda_batch and
# cuda_gpu whole, cuda_prefill's GDN scans, cuda_fixture with its f16-state row), then f32 against
# f16 at one sequence after 4K and at 16 and 64 rows of 700-token prompts, the 4K and 64-row arms
# twice. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-gs
[ -f "$LILY_CK/config.json" ] || (./.device-gs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
t0=$(date +%s)
suite() {
  local bin=$1; shift
  timeout "${TEST_TIMEOUT:-150}" "./.device-gs/tests/$bin" --include-ignored --test-threads 2 "$@" > "$OUT/tests-$bin.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$bin.log"
  echo "[+$(( $(date +%s) - t0 ))s] $bin"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$bin.log" | tail -4
}
suite cuda_batch
suite cuda_gpu
suite cuda_prefill gdn_scan
suite cuda_fixture
grep -hE "f16 GDN|f16 states vs f32|: PPL .*KL" "$OUT"/tests-*.log | head -40
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh .device-gs/arms-c.txt 2>&1 | tail -12
python3 scripts/call_summary.py "$OUT" --base f32
bash scripts/out_bundle.sh  # the tool brings back 8 files at most
