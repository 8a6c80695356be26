set -u
# Call 2 (session 73; one H200, ~330 s): issue 15's table on the build call 1 chose (ARM, a
# folder .device-ARM with bin/lily) at 1 / 4 / 16 / 64 clients (ROUNDS=2, 16 client processes,
# 700-token text prompts, 128 out, greedy and sampled), then llama-batched-bench (prebuilt, Q4_0
# GGUF of the same checkpoint) at 1 / 4 / 16 / 32 / 64 sequences in the same call.
# Carry [".device-$ARM", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz"].
export OUT=${OUT:-/tmp/out} LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
ARM=${ARM:-t32s}
mkdir -p "$OUT" /root/pb
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
CK=/root/ck
bash scripts/device_unpack.sh .device-$ARM >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -1
[ -f $CK/config.json ] || ./.device-$ARM/bin/lily synth --preset 35b-a3b --out $CK > /tmp/synth.log 2>&1
el "synth rc=$?"
mkdir -p "$OUT/$ARM-all"
OUT=$OUT/$ARM-all LILY=.device-$ARM/bin/lily CK=$CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=1,4,16,64 timeout 200 bash bench/h200_serve.sh load 2>&1 \
  | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$ARM /"
el "table"
# The GGUF after the timed runs (it loads the GPU), then the peer.
timeout 150 bash bench/h200_steps.sh batched-gguf > /root/pb/gguf.log 2>&1; el "gguf rc=$?"
mkdir -p "$OUT/llama"
OUT=$OUT/llama timeout 120 bash bench/h200_steps.sh batched 5 2>&1 | tail -6
el llama-batched-bench
bash scripts/out_bundle.sh
