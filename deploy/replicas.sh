#!/usr/bin/env bash
# One Lily replica per GPU (or N CPU replicas) behind the SGLang Model Gateway on one host.
#
#   deploy/replicas.sh --gpus 0,1 --model /models/qwen3.6-35b-a3b-4bit
#   deploy/replicas.sh --cpu 3                       # the embedded tiny model, for trying it out
#
# Options: --gpus LIST | --cpu N, --model DIR, --lily BIN (default: lily on PATH, else
# target/release/lily), --host ADDR (the gateway's, default 127.0.0.1), --port P (the gateway's,
# default 8000), --base-port P (replica i listens on P + i, default 8100), --policy NAME (default
# cache_aware); anything after `--` goes to every `lily serve`. Needs the gateway:
# `pip install sglang-router`. Replicas bind to 127.0.0.1 only; the gateway is the front door.
# Ctrl-C or SIGTERM drains the replicas (running requests finish, new ones go elsewhere) and stops
# the gateway. Logs: $LOG_DIR (default ./replica-logs).
set -euo pipefail
GPUS="" CPU=0 MODEL="" HOST=127.0.0.1 PORT=8000 BASE=8100 POLICY=cache_aware
LILY=$(command -v lily || echo target/release/lily)
LOG_DIR=${LOG_DIR:-./replica-logs}
EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --gpus) GPUS=$2; shift 2 ;;
    --cpu) CPU=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --lily) LILY=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --base-port) BASE=$2; shift 2 ;;
    --policy) POLICY=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$GPUS" ] && [ "$CPU" -eq 0 ]; then echo "give --gpus LIST or --cpu N" >&2; exit 2; fi
python3 -c "import sglang_router" 2>/dev/null || { echo "the gateway is missing: pip install sglang-router" >&2; exit 1; }
mkdir -p "$LOG_DIR"

PIDS=()
URLS=()
stop() {
  trap - INT TERM EXIT
  # Replicas first (they drain: /health turns 503, the gateway stops sending), then the gateway.
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait "${PIDS[@]}" 2>/dev/null || true
  [ -n "${GW:-}" ] && kill -TERM "$GW" 2>/dev/null && wait "$GW" 2>/dev/null
  exit 0
}
trap stop INT TERM EXIT

start() { # start INDEX ARGS...: replica INDEX on BASE + INDEX
  local i=$1; shift
  local port=$((BASE + i))
  "$LILY" serve --bind "127.0.0.1:$port" ${MODEL:+--model "$MODEL"} "$@" "${EXTRA[@]}" > "$LOG_DIR/replica-$i.log" 2>&1 &
  PIDS+=("$!")
  URLS+=("http://127.0.0.1:$port")
}
if [ -n "$GPUS" ]; then
  i=0
  for g in ${GPUS//,/ }; do start $i --backend cuda --gpu "$g"; i=$((i + 1)); done
else
  for i in $(seq 0 $((CPU - 1))); do start "$i" --backend cpu; done
fi

# Loading takes a while (weights into GPU memory); the listener opens once the model is ready.
for u in "${URLS[@]}"; do
  for _ in $(seq 1 1200); do
    curl -sf "$u/health" > /dev/null && break
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "a replica exited; see $LOG_DIR" >&2; exit 1; }; done
    sleep 0.5
  done
  curl -sf "$u/health" > /dev/null || { echo "$u did not become ready; see $LOG_DIR" >&2; exit 1; }
done
echo "replicas ready: ${URLS[*]}"

# A replica that fails twice in a row (e.g. gone: connection refused) is taken out of rotation, so
# the gateway's retries (5 by default) reach another one; health checks every 5 s bring it back.
python3 -m sglang_router.launch_router --host "$HOST" --port "$PORT" --worker-urls "${URLS[@]}" --policy "$POLICY" \
  --cb-failure-threshold 2 --health-check-interval-secs 5 --health-failure-threshold 2 \
  --log-level warn > "$LOG_DIR/gateway.log" 2>&1 &
GW=$!
for _ in $(seq 1 120); do curl -sf "http://$HOST:$PORT/health" > /dev/null && break; sleep 0.5; done
echo "gateway: http://$HOST:$PORT/v1 (policy $POLICY)"
wait "$GW"
