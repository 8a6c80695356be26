set -u
# Call 2 (session 73; one H200, ~480 s): main2 = main with the sampler's prefilter (f2370cc),
# burst2 = main2 + burst-32k.patch (BURST_PREFILL_CHUNK 16,384 -> 32,768).
# 1. main2's cuda_sampling suite (the landed build's own binary);
# 2. lily-bench 64 rows x 700, 128 steps, chat-sampled, main (mainb) / main2, two rounds;
# 3. issue 15's table on main2 at 1 / 4 / 16 / 64 clients (ROUNDS=2, 16 client processes,
#    700-token text prompts, 128 out, greedy and sampled);
# 4. the 64-client level on burst2 / main2 / burst2 (main2's table run is the fourth);
# 5. with .whl/llama-bin.tar.xz carried: llama-batched-bench (prebuilt, Q4_0 GGUF of the same
#    checkpoint) at 1 / 4 / 16 / 32 / 64 sequences.
# Carry [".device-main2", ".device-burst2", ".device-mainb", ".whl/openai"] (+ ".whl/gguf-py.tar.xz",
# ".whl/llama-bin.tar.xz").
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT" /root/pb
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-580}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
CK=$LILY_CK
for a in main2 burst2 mainb; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
PEER=0; [ -f .whl/llama-bin.tar.xz ] && PEER=1
[ "$PEER" = 1 ] && bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -1
[ -f $CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-main2/bin/lily synth --preset 35b-a3b --out $CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 120 ./.device-main2/tests/cuda_sampling --include-ignored --test-threads 2 > "$OUT/tests-cuda_sampling.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_sampling.log"
el cuda_sampling; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_sampling.log" | tail -3
while [ ! -f /tmp/synth.rc ] && [ "$(left 450)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
CHAT="--temperature 0.7 --top-p 0.8 --top-k 20 --seed 1"
: > /tmp/arms-2.txt
for r in 1 2; do for a in main2 mainb; do
  echo "$a b64 sampled r$r | BENCH=./.device-$a/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64 $CHAT" >> /tmp/arms-2.txt
done; done
SKIP_TESTS=1 timeout "$(left 380)" bash scripts/device_check.sh /tmp/arms-2.txt 2>&1 | grep -v "cannot access" | tail -5
el arms
load() {  # label lily levels
  mkdir -p "$OUT/$1"
  OUT=$OUT/$1 LILY=$2 CK=$CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=$3 timeout "$(left $((PEER * 90)))" bash bench/h200_serve.sh load 2>&1 \
    | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
}
load main2-all .device-main2/bin/lily 1,4,16,64
el "table"
load burst2-64-r1 .device-burst2/bin/lily 64
load main2-64-r2 .device-main2/bin/lily 64
load burst2-64-r2 .device-burst2/bin/lily 64
el "burst A/B"
if [ "$PEER" = 1 ]; then
  # The GGUF after the timed runs (it loads the GPU), then the peer.
  timeout 150 bash bench/h200_steps.sh batched-gguf > /root/pb/gguf.log 2>&1; el "gguf rc=$?"
  mkdir -p "$OUT/llama"
  OUT=$OUT/llama timeout 120 bash bench/h200_steps.sh batched 5 2>&1 | tail -6
  el llama-batched-bench
fi
bash scripts/out_bundle.sh
