#!/usr/bin/env bash
# The server benchmarks on the GPU machine, in one device call: `lily serve` on the synthetic
# 35b-a3b checkpoint driven by the official openai client — bench/serve_load.py (aggregate tok/s,
# TTFT and inter-token latency at 1 / 4 / 16 / 64 concurrent streams, greedy and sampled) and
# bench/serve_scenarios.py (turn-2 TTFT over a 30K and a 90K document, a 32K prompt arriving while
# 15 streams decode). Results go to $OUT as JSON lines, the server's log beside them.
#
# Carry: .device (bin/lily from ../shared/tools/device-pack) and .whl/openai (the openai wheel and
# its dependencies for Python 3.12: `pip download --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 --platform any -d .whl/openai openai`). Run from the
# repository root:  bash bench/h200_serve.sh [load|turns|interleave|all]
# LEVELS (default "1,4,16,64") and MODES (default "greedy,sampled") pick the load test's levels and
# modes; CLIENT_PROCS the client processes per level (default 0: serve_load.py's one per 8
# clients). ONE_PROCESS_LEVELS (e.g. "16,64") repeats those levels of the load test, greedy, with the
# single-process client. SPREAD_LEVELS (e.g. "16,64") repeats those levels, both modes, with
# SPREAD_PROCS client processes (default 16: one client per process at 16 clients, four at 64),
# so a level's requests are not built one after another by a few processes. PROMPT_FORM (default
# "text") is how the load test's prompts go out (serve_load.py --prompt-form); IDS_LEVELS (e.g.
# "1,64") repeats those levels, both modes, with prompts of token ids, the form of the tables
# before 2026-12-05's session 70 (serve_load_ids.jsonl). SERVE_ARGS adds arguments to the main server (e.g. "--prefix-cache-mb 0": the prefix cache's
# host tier only); DOCS sets the turns' document sizes (default "30000 90000"); TAG labels rows.
set -uo pipefail
CK=${CK:-/root/ck}
LILY=${LILY:-.device/bin/lily}
OUT=${OUT:-/tmp/out}
WHAT=${1:-all}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*"; }

bash scripts/device_unpack.sh  # binaries packed by scripts/device_pack.sh
python3 -c "import openai" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl/openai openai || exit 1
if [ ! -f "$CK/config.json" ]; then
  log "synthesizing the 35b-a3b checkpoint into $CK"
  "$LILY" synth --preset 35b-a3b --out "$CK" || exit 1
fi

# serve ARGS...: starts `lily serve` on a free port and sets URL (the log goes to $OUT/$SERVE_LOG).
SERVE_LOG=${SERVE_LOG:-serve.log}
serve() {
  "$LILY" serve --model "$CK" --bind 127.0.0.1:0 "$@" > "$OUT/$SERVE_LOG" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 600); do
    URL=$(grep -o 'on http://127\.0\.0\.1:[0-9]*' "$OUT/$SERVE_LOG" | head -1 | cut -d' ' -f2)
    [ -n "$URL" ] && break
    kill -0 "$SERVER" 2>/dev/null || { log "lily serve exited:"; tail -20 "$OUT/$SERVE_LOG"; exit 1; }
    sleep 0.5
  done
  [ -n "$URL" ] || { log "lily serve did not start"; exit 1; }
  log "serving at $URL"
}

# shellcheck disable=SC2086
serve --max-seq 131072 ${SERVE_ARGS:-}
# The next process on the device needs the server's memory back: wait for it to exit.
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
# SETTLE: seconds to wait before the first request (e.g. while the host tier's memory is pinned).
sleep "${SETTLE:-0}"
case $WHAT in load | all)
  # Four requests per client back to back: a steady load, new prompts prefilled while others decode.
  log "load test"
  python3 bench/serve_load.py --url "$URL" --concurrency "${LEVELS:-1,4,16,64}" --modes "${MODES:-greedy,sampled}" --rounds "${ROUNDS:-4}" --procs "${CLIENT_PROCS:-0}" --prompt-form "${PROMPT_FORM:-text}" --out "$OUT/serve_load.jsonl"
  # The same levels with every client in one process (serve_load.py --procs 1), for comparison.
  if [ -n "${ONE_PROCESS_LEVELS:-}" ]; then
    log "load test, one client process"
    python3 bench/serve_load.py --url "$URL" --concurrency "$ONE_PROCESS_LEVELS" --procs 1 --modes greedy --rounds "${ROUNDS:-4}" --prompt-form "${PROMPT_FORM:-text}" --out "$OUT/serve_load_one_process.jsonl"
  fi
  if [ -n "${SPREAD_LEVELS:-}" ]; then
    log "load test, ${SPREAD_PROCS:-16} client processes"
    python3 bench/serve_load.py --url "$URL" --concurrency "$SPREAD_LEVELS" --procs "${SPREAD_PROCS:-16}" --modes "${MODES:-greedy,sampled}" --rounds "${ROUNDS:-4}" --prompt-form "${PROMPT_FORM:-text}" --out "$OUT/serve_load_spread.jsonl"
  fi
  if [ -n "${IDS_LEVELS:-}" ]; then
    log "load test, prompts of token ids"
    python3 bench/serve_load.py --url "$URL" --concurrency "$IDS_LEVELS" --procs "${CLIENT_PROCS:-0}" --modes "${MODES:-greedy,sampled}" --rounds "${ROUNDS:-4}" --prompt-form ids --out "$OUT/serve_load_ids.jsonl"
  fi ;;
esac
case $WHAT in turns | all)
  for n in ${DOCS:-30000 90000}; do
    log "turns over a $n-token document"
    python3 bench/serve_scenarios.py turns --url "$URL" --doc-tokens $n ${TAG:+--tag "$TAG"} --out "$OUT/serve_scenarios.jsonl"
  done ;;
esac
case $WHAT in interleave | all)
  # The default chunk on the running server, then other chunk sizes on restarted ones.
  for chunk in default ${CHUNKS:-512}; do
    if [ "$chunk" != default ]; then
      curl -s "$URL/metrics" > "$OUT/metrics-main.txt"; kill $SERVER; wait $SERVER 2>/dev/null
      SERVE_LOG=serve-chunk$chunk.log serve --max-seq 131072 --prefill-chunk "$chunk"
    fi
    log "a 32K prompt while 15 streams decode (prefill chunk: $chunk)"
    python3 bench/serve_scenarios.py interleave --url "$URL" --streams 15 --long 32768 --tag "prefill-chunk=$chunk" --out "$OUT/serve_scenarios.jsonl"
  done ;;
esac
curl -s "$URL/metrics" > "$OUT/metrics.txt"
log "done"
