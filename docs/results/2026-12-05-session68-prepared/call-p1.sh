set -u
# Peer call 1 of 2 (issue 15's llama.cpp batched figures in the same run as the load test), on a
# machine kept warm for call 2: llama-batched-bench's CUDA build starts detached (~10 min on the
# 16 cores, it runs on into call 2), the synthetic 35B and its Q4_0 GGUF are written, then
# lily-bench's headline arms run beside the build (GPU-bound; one process). Carry
# [".device-base", ".whl"] (.device-base: lily and lily-bench from main; .whl: openai/ and
# llama-src.tar.xz from bench/pack_llama_src.sh). ~8 min. Then call-p2.sh at once.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device_unpack.sh .device-base
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
bash bench/h200_steps.sh batched-start
[ -f "$LILY_CK/config.json" ] || ./.device-base/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
el synth
timeout 300 bash bench/h200_steps.sh batched-gguf
el gguf
: > /tmp/arms-p.txt
for a in "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b64|--prompt-len 700 --decode-steps 128 --batch 64" "p4096|--prompt-len 4096 --decode-steps 64" "p8192|--prompt-len 8192 --decode-steps 64" "p32768|--prompt-len 32768 --decode-steps 64"; do
  echo "main ${a%%|*} | BENCH=./.device-base/bin/lily-bench | ${a#*|}" >> /tmp/arms-p.txt
done
SKIP_TESTS=1 timeout 240 bash scripts/device_check.sh /tmp/arms-p.txt 2>&1 | tail -6
el arms
bash scripts/out_bundle.sh
