#!/usr/bin/env bash
# Teacher-forced accuracy of Lily's default CUDA path against transformers on the GPU machine
# (docs/benchmarks.md, "Accuracy"). Run from the repository root after device-pack (carry .device):
#   bash scripts/device_accuracy.sh [POSITIONS]        (results and comparisons land in $OUT/acc)
#
# 1. the 35b-a3b widths with 4 layers (`lily synth --layers 4`): transformers in float32 on the GPU
#    is the verdict there (the whole 35B does not fit in float32 on one H200). Lily's default path
#    (bf16 tensor-core prefill, cuBLAS for the dense GEMMs, bf16 KV) and its exact path
#    (--exact-prefill --kv-cache f32) against it, and the decode kernels alone
#    (--decode-forward: every position through the decode step).
# 2. the full 35B against transformers in bf16 (ACC_FULL=0 skips it: loading takes minutes).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
P=${1:-192}
out=${OUT:-/tmp/device_accuracy}/acc
mkdir -p "$out"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
ck4=/root/ck4 ck=${LILY_CK:-/root/ck}
[ -f "$ck4/config.json" ] || ./.device/bin/lily synth --preset 35b-a3b --layers 4 --out "$ck4" > /dev/null 2>&1
cmp() { python3 scripts/compare_logits.py "$1" "$2" --json > "$out/$3.json" && python3 -c 'import json,sys
d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d[k] for k in d if k not in ("reference","candidate")})' "$out/$3.json" "$3"; }
./.device/bin/lily logits --model "$ck4" --positions "$P" --backend cuda --out "$out/l4-lily.json" 2>> "$out/log"
./.device/bin/lily logits --exact-prefill --kv-cache f32 --model "$ck4" --positions "$P" --backend cuda \
  --out "$out/l4-lily-exact.json" 2>> "$out/log"
# The decode kernels at the 35B's widths: every position through the decode step (f32 KV).
./.device/bin/lily logits --decode-forward --kv-cache f32 --model "$ck4" --positions "$P" --backend cuda \
  --out "$out/l4-lily-decode.json" 2>> "$out/log"
python3 scripts/transformers_goldens.py --model "$ck4" --positions "$P" --greedy 0 --device cuda --dtype float32 \
  --out "$out/l4-tf32.json" >> "$out/log" 2>&1
cmp "$out/l4-tf32.json" "$out/l4-lily.json" "4layer_tf32_vs_lily_default"
cmp "$out/l4-tf32.json" "$out/l4-lily-exact.json" "4layer_tf32_vs_lily_exact"
cmp "$out/l4-tf32.json" "$out/l4-lily-decode.json" "4layer_tf32_vs_lily_decode_kernels"
el "4 layers"
[ "${ACC_FULL:-1}" = 1 ] || exit 0
[ -f "$ck/config.json" ] || ./.device/bin/lily synth --preset 35b-a3b --out "$ck" > /dev/null 2>&1
./.device/bin/lily logits --model "$ck" --positions "$P" --backend cuda --out "$out/l40-lily.json" 2>> "$out/log"
python3 scripts/transformers_goldens.py --model "$ck" --positions "$P" --greedy 0 --device cuda --dtype bfloat16 \
  --out "$out/l40-tfbf16.json" >> "$out/log" 2>&1
cmp "$out/l40-tfbf16.json" "$out/l40-lily.json" "40layer_tfbf16_vs_lily_default"
el "40 layers"
