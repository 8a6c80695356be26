#!/usr/bin/env bash
# One device call that checks a build and measures its open switches (docs/cuda.md, "What is
# left"). Run on the GPU machine from the repository root after
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#     ../shared/tools/device-pack --test cuda_gpu --test cuda_prefill      # ~55 MiB, carry [".device"]
# then:  bash scripts/device_check.sh            (~4 min; everything it prints also lands in $OUT)
#
# 1. the GPU tests (cuda_gpu + cuda_prefill, among them the bf16-KV test), then cuda_gpu again
#    under each NVRTC variant below;
# 2. the 35B checkpoint, written on the machine's own disk;
# 3. lily-bench A/B on one machine: default vs each variant at 4K, and f32 vs bf16 KV at 32K/131K.
# A variant is only worth making the default if its tests pass and it wins here.
set -u
export LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
ck=${LILY_CK:-/root/ck}
[ -f "$ck/config.json" ] || ( ./.device/bin/lily synth --preset 35b-a3b --out "$ck" > /tmp/synth.log 2>&1 ) &
synth=$!
timeout 150 bash .device/run test -E 'test(cuda)' --no-fail-fast > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/tests.log"
el "tests"; grep -E "^\s+FAIL|Summary|rc=" "$out/tests.log" | tail -8
variants=("-DDOWN_ALL_LANES=1" "-DMOE_FAST=2" "-DATTN_XRED=1")
for v in "${variants[@]}"; do
  LILY_CUDA_NVRTC_DEFS="$v" timeout 60 bash .device/run test -E 'binary(cuda_gpu)' --no-fail-fast > /tmp/tv.log 2>&1
  echo "== [$v] rc=$?" >> "$out/tests.log"; grep -E "^\s+FAIL|Summary" /tmp/tv.log | tee -a "$out/tests.log" | tail -3
done
LILY_CUDA_MOE_WARPS=4 timeout 60 bash .device/run test -E 'binary(cuda_gpu)' --no-fail-fast > /tmp/tv.log 2>&1
echo "== [LILY_CUDA_MOE_WARPS=4] rc=$?" >> "$out/tests.log"; grep -E "^\s+FAIL|Summary" /tmp/tv.log | tee -a "$out/tests.log" | tail -3
wait $synth
B=(./.device/bin/lily-bench --model "$ck" --backend cuda)
show() { python3 -c 'import json,sys
d=json.loads(sys.stdin.read()); print(sys.argv[1], d["prompt_len"], d.get("kv_cache"), "prefill", round(d["prefill"]["tok_s"]), "decode", round(d["decode"]["tok_s"], 1), d["decode"]["token_digest"])' "$1"; }
for v in "" "${variants[@]}"; do
  LILY_CUDA_NVRTC_DEFS="$v" timeout 60 "${B[@]}" --prompt-len 4096 2>/dev/null | tee -a "$out/ab.jsonl" | show "[$v]"
done
LILY_CUDA_MOE_WARPS=4 timeout 60 "${B[@]}" --prompt-len 4096 2>/dev/null | tee -a "$out/ab.jsonl" | show "[MOE_WARPS=4]"
el "ab 4K"
for c in 32768 131072; do
  for kv in "" "--kv-bf16"; do timeout 90 "${B[@]}" --prompt-len $c $kv 2>/dev/null | tee -a "$out/ab.jsonl" | show "[$kv]"; done
  LILY_CUDA_NVRTC_DEFS=-DATTN_XRED=1 timeout 90 "${B[@]}" --prompt-len $c --kv-bf16 2>/dev/null | tee -a "$out/ab.jsonl" | show "[--kv-bf16 -DATTN_XRED=1]"
done
el "kv 32K/131K"
