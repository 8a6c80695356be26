set -u
# Call I (issue 15): where the server's prefill time goes at 16 and 64 clients, and issue 15's
# table on this build: the load test on two servers, each with --trace-turns (a line per worker turn in its
# serve.log): the default (levels 1 / 4 / 16 / 64, greedy and sampled) and no prefix cache
# (16 / 64 greedy: no checkpoint snapshots). The server is call J's build (.device-j: the narrow
# expert kernels and K2); run right after call J (its arms are the lily-bench references).
# Carry [".device-j", ".whl"]. ~4 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
root=$OUT
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-j
[ -f "$LILY_CK/config.json" ] || ./.device-j/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
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
  OUT=$root/$cfg LILY=.device-j/bin/lily CK=$LILY_CK ROUNDS=2 LEVELS=$levels MODES=$modes SERVE_ARGS="$args" \
    bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
done
python3 scripts/call_summary.py "$OUT" --base base 2>&1 | tail -30
bash scripts/out_bundle.sh
