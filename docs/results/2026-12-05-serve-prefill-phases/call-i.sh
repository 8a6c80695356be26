set -u
# Call I (issue 15): where the server's prefill time goes at 16 and 64 clients, and issue 15's
# table on this build. lily-bench's 64 x 700 prompts and one 700-token sequence as the references,
# then the load test on two servers, each with --trace-turns (a line per worker turn in its
# serve.log): the default (levels 1 / 4 / 16 / 64, greedy and sampled) and no prefix cache
# (16 / 64 greedy: no checkpoint snapshots). With it, the batched GDN step at four blocks per SM
# for the f16 state (K2, .device-k2: lily-bench and cuda_batch built from the working tree with
# that one kernel change) against the base at 16 and 64 rows, and its GPU tests.
# Carry [".device-fs", ".device-k2", ".whl"]. ~7 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-fs
bash scripts/device_unpack.sh .device-k2
[ -f "$LILY_CK/config.json" ] || (./.device-fs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1) &
synth=$!
timeout 200 ./.device-k2/tests/cuda_batch --include-ignored --test-threads 2 > "$OUT/tests-cuda_batch-k2.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_batch-k2.log"
grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_batch-k2.log" | tail -4
wait $synth
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-serve-prefill-phases/arms-i.txt 2>&1 | tail -12
for cfg in ${CONFIGS:-default no-cache}; do
  case $cfg in
    default) args="--trace-turns" ;;
    no-cache) args="--trace-turns --prefix-cache-mb 0 --prefix-cache-host-mb 0" ;;
    small-cache) args="--trace-turns --prefix-cache-mb 4096" ;;
  esac
  mkdir -p "$root/$cfg"
  echo "== $cfg ($args)"
  levels=16,64 modes=greedy
  [ "$cfg" = default ] && levels=1,4,16,64 modes=greedy,sampled  # issue 15's table on this build
  OUT=$root/$cfg LILY=.device-fs/bin/lily CK=$LILY_CK ROUNDS=2 LEVELS=$levels MODES=$modes SERVE_ARGS="$args" \
    bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
done
python3 scripts/call_summary.py "$OUT" --base base 2>&1 | tail -30
bash scripts/out_bundle.sh
