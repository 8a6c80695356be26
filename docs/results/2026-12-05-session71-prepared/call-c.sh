set -u
# Call C (prepared in session 71, not run: no device could be started; build-c.sh builds its carry): on `all`
# (main with the batched GDN step at the 35B's shapes on 256-thread blocks, k / q four rows at a
# time, and the expert ring kernels at the 35B's shapes, moe_tcq_f_35b / moe_tcr_f_35b) the GPU
# suites cuda_batch and cuda_prefill; lily-bench at 64 and 16 rows x 700 (one round),
# greedy, whose digests must equal main's (bit-identical changes); the decode timeline at 64
# rows; then, if both suites passed, issue 15's load test (ROUNDS=2, 16 client processes, 700-token
# text prompts, 128 out; 1 / 4 / 16 / 64 clients, greedy and sampled) and llama-batched-bench
# (built beforehand without a GPU, bench/build_llama_batched.sh; 700-token prompts, 128 decoded,
# 1 / 4 / 16 / 32 / 64 sequences) on the Q4_0 GGUF written (bench/write_gguf.py, on the GPU) in the
# background of the suites, and waited for before anything is timed.
# Carry [".device-all", ".device-lilyall", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
# Seconds left of the call's DEADLINE (default 480; the tool's limit is set a little above), less
# `reserve`. PEER=0 leaves out llama.cpp (its GGUF and run) where the device time left is short.
DEADLINE=${DEADLINE:-480} PEER=${PEER:-1}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
P=$(( PEER * 75 ))  # the peer's reserve at the end
for a in all lilyall; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
mv .device-lilyall/bin/lily .device-all/bin/lily
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ "$PEER" = 1 ] && bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -3
mkdir -p /root/pb
# The checkpoint, then its Q4_0 GGUF, in the background of the suites (not of the timed runs).
setsid nohup bash -c "./.device-all/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc; \
  [ $PEER = 1 ] && nice -n 10 bash bench/h200_steps.sh batched-gguf > /root/pb/gguf.log 2>&1; echo \$? > /root/pb/gguf.rc" < /dev/null > /dev/null 2>&1 &
for t in cuda_batch cuda_prefill; do
  timeout "$(left $((220 + P)))" ./.device-all/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
ok=1; for t in cuda_batch cuda_prefill; do grep -q "rc=0" "$OUT/tests-$t.log" || ok=0; done
while [ ! -f /tmp/synth.rc ] && [ "$(left $((175 + P)))" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
while [ ! -f /root/pb/gguf.rc ] && [ "$(left $((195 + P)))" -gt 5 ]; do sleep 2; done
el "gguf rc=$(cat /root/pb/gguf.rc 2>/dev/null)"; tail -2 /root/pb/gguf.log
: > /tmp/arms-c.txt
for a in "b64 r1|--batch 64" "b16 r1|--batch 16"; do
  echo "all ${a%%|*} | BENCH=./.device-all/bin/lily-bench | --prompt-len 700 --decode-steps 128 ${a#*|}" >> /tmp/arms-c.txt
done
echo "all b64 timeline | BENCH=./.device-all/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64" >> /tmp/arms-c.txt
SKIP_TESTS=1 timeout "$(left $((165 + P)))" bash scripts/device_check.sh /tmp/arms-c.txt 2>&1 | grep -v "cannot access" | tail -8
el arms
if [ "$ok" = 1 ]; then
  mkdir -p "$OUT/load"
  OUT=$OUT/load LILY=.device-all/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=${LOAD_LEVELS:-1,4,16,64} \
    timeout "$(left $((5 + P)))" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
  el load
else
  echo "a suite failed: no load test on this build"
fi
if [ "$PEER" = 1 ]; then
  mkdir -p "$OUT/llama"
  OUT=$OUT/llama timeout "$(left 8)" bash bench/h200_steps.sh batched 5 2>&1 | tail -8
  el llama-batched-bench
fi
bash scripts/out_bundle.sh
