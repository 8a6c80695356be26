set -u
# Call B (session 71), right after call A on the same warm machine: llama-batched-bench (built
# beforehand without a GPU, bench/build_llama_batched.sh; 700-token prompts, 128 decoded, 1 / 4 /
# 16 / 32 / 64 sequences) on the Q4_0 GGUF call A wrote, then issue 15's load test (ROUNDS=2, 16
# client processes, 700-token text prompts, 128 out; 1 / 4 / 16 / 64 clients, greedy and sampled)
# on the build call A picked (all if its GPU suites passed and its 64-row aggregate was at least
# base's, else base), and base's 64-client level beside it. Carry [".device-lilybase",
# ".device-lilyall", ".whl/llama-bin.tar.xz"] (call A's .whl/openai and the checkpoint stay on
# the machine).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in lilybase lilyall; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
pick=$(python3 - <<'PY'
import json, os
ok = all(os.path.exists(f"/root/pb/tests-{t}.log") and "rc=0" in open(f"/root/pb/tests-{t}.log").read() for t in ("cuda_batch", "cuda_prefill"))
rows = [json.loads(l) for l in open("/root/pb/ab.jsonl")] if os.path.exists("/root/pb/ab.jsonl") else []
def mean(arm):
    v = [r["decode"]["aggregate_tok_s"] for r in rows if r.get("arm", "").startswith(arm + " b64 r")]
    return sum(v) / len(v) if v else 0.0
print("all" if ok and mean("all") >= mean("base") > 0 else "base")
PY
)
echo "load test build: $pick"
bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -3
for i in $(seq 1 120); do [ -f /root/pb/gguf.rc ] && break; sleep 2; done
echo "gguf rc=$(cat /root/pb/gguf.rc 2>/dev/null)"; tail -2 /root/pb/gguf.log
el gguf
mkdir -p "$OUT/llama"
OUT=$OUT/llama timeout 200 bash bench/h200_steps.sh batched 10 2>&1 | tail -8
el llama-batched-bench
mkdir -p "$OUT/load-$pick" "$OUT/load-base64"
OUT=$OUT/load-$pick LILY=.device-lily$pick/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" \
  timeout 200 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
el load-$pick
if [ "$pick" = all ]; then
  OUT=$OUT/load-base64 LILY=.device-lilybase/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 LEVELS=64 SERVE_ARGS="--trace-turns" \
    timeout 90 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
  el load-base64
fi
bash scripts/out_bundle.sh
