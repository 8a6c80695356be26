set -u
# Call 2 (session 74; one H200, ~450 s): session 73's call-4.sh (never run) with main at 4bfabe5;
# issue 15's table on the H200 with main (.device-base from build-1.sh: the sampler's prefilter,
# burst turns of 32,768, the prefix cache's bounded inserts).
# 1. issue 15's table on main at 1 / 4 / 16 / 64 clients (ROUNDS=2, 16 client processes,
#    700-token text prompts, 128 out, greedy and sampled);
# 2. with .whl/llama-bin.tar.xz carried: llama-batched-bench (prebuilt, Q4_0 GGUF of the same
#    checkpoint) at 1 / 4 / 16 / 32 / 64 sequences;
# 3. the 64-client level once more while the deadline (DEADLINE seconds) allows;
# Carry [".device-base", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT" /root/pb
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-580}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
CK=$LILY_CK
for a in base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
PEER=0; [ -f .whl/llama-bin.tar.xz ] && PEER=1
[ "$PEER" = 1 ] && bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -1
[ -f $CK/config.json ] || ./.device-base/bin/lily synth --preset 35b-a3b --out $CK > /tmp/synth.log 2>&1
el "synth rc=$?"
load() {  # label lily levels
  mkdir -p "$OUT/$1"
  OUT=$OUT/$1 LILY=$2 CK=$CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=$3 timeout "$(left 5)" bash bench/h200_serve.sh load 2>&1 \
    | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
}
load fin-all .device-base/bin/lily 1,4,16,64
el "table"
if [ "$PEER" = 1 ]; then
  # The GGUF after the timed runs (it loads the GPU), then the peer.
  timeout "$(left 40)" bash bench/h200_steps.sh batched-gguf > /root/pb/gguf.log 2>&1; el "gguf rc=$?"
  mkdir -p "$OUT/llama"
  OUT=$OUT/llama timeout "$(left 3)" bash bench/h200_steps.sh batched 5 2>&1 | tail -6
  el llama-batched-bench
fi
# Then, while the deadline allows, the 64-client level once more.
[ "$(left 45)" -gt 5 ] && load fin-64-r2 .device-base/bin/lily 64 && el "64 clients, once more"
# 4. While time is left: the phase profile (direct launches, an event per phase) of a 64 x 700
#    prefill, the load test's burst rounds in one forward, and of its 64-row decode steps.
[ "$(left 50)" -gt 5 ] && LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-base/bin/lily-bench --model "$CK" --backend cuda \
  --prompt-len 700 --batch 64 --decode-steps 8 > /dev/null 2> "$OUT/profile-b64-700.txt" && el profile && grep -A18 "prefill profile" "$OUT/profile-b64-700.txt" | head -20
bash scripts/out_bundle.sh
