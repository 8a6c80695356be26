set -u
# Where the server's prefill time goes at 16 and 64 clients (issue 15): lily-bench's prompts in one
# call as the reference, then the greedy load test (ROUNDS=2, levels 16 and 64) on three servers,
# each with --trace-turns (a line per worker turn in its serve.log): the default; without the
# prefix cache (no checkpoint snapshots: the new `snapshot` worker phase is theirs); a 4 GiB
# device cache (full from the first level: each snapshot evicts, and an evicted entry is copied to
# the host tier while the worker waits, as on a server that has run a while). CONFIGS may add
# chunk32k (--prefill-chunk 32768: a burst in fewer, larger turns).
# Carry [".device-fs", ".whl"] (.device-fs/bin/{lily,lily-bench} from main). ~3 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
root=$OUT
bash scripts/device_unpack.sh .device-fs
[ -f "$LILY_CK/config.json" ] || ./.device-fs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-serve-prefill-phases/arms-i.txt 2>&1 | tail -4
for cfg in ${CONFIGS:-default no-cache small-cache}; do
  case $cfg in
    default) args="--trace-turns" ;;
    no-cache) args="--trace-turns --prefix-cache-mb 0 --prefix-cache-host-mb 0" ;;
    small-cache) args="--trace-turns --prefix-cache-mb 4096" ;;
    chunk32k) args="--trace-turns --prefill-chunk 32768" ;;
  esac
  mkdir -p "$root/$cfg"
  echo "== $cfg ($args)"
  levels=16,64 modes=greedy
  [ "$cfg" = default ] && levels=1,4,16,64 modes=greedy,sampled  # issue 15's table on this build
  OUT=$root/$cfg LILY=.device-fs/bin/lily CK=$LILY_CK ROUNDS=2 LEVELS=$levels MODES=$modes SERVE_ARGS="$args" \
    bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*\|"worker_secs": {[^}]*}' | paste - - - -
done
bash scripts/out_bundle.sh
