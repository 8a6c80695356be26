#!/usr/bin/env bash
# On the GPU machine (after ../shared/tools/device-pack): writes the 35b-a3b synthetic checkpoint,
# then measures teacher-forced accuracy over POSITIONS positions of Lily's backends against
# transformers' Qwen3_5MoeForCausalLM (bf16 on the GPU, dequantized weights). Results go to
# $OUT (or /tmp/acc): one JSON per engine and compare_*.json.
#   bash scripts/device_accuracy.sh [POSITIONS] [BACKENDS...]      e.g. 192 cuda cpu
set -uo pipefail
positions=${1:-192}; shift || true
backends=${*:-cuda}
out=${OUT:-/tmp/acc}; mkdir -p "$out"
model=/tmp/synth35
[ -f $model/config.json ] || bash .device/run bin lily synth --preset 35b-a3b --out $model 2>&1 | tail -1
for b in $backends; do
  timeout 300 bash .device/run bin lily logits --model $model --positions "$positions" --backend "$b" --out "$out/lily_$b.json" 2>&1 | tail -2
done
PYTHONUNBUFFERED=1 timeout 420 python3 scripts/transformers_goldens.py --model $model --positions "$positions" --greedy 0 \
  --device cuda --dtype bfloat16 --seed-note "lily synth --preset 35b-a3b --seed 0" --out "$out/transformers_bf16.json" 2>&1 | grep -v '^\[transformers\]' | tail -3
for b in $backends; do
  [ -f "$out/lily_$b.json" ] && [ -f "$out/transformers_bf16.json" ] && \
    python3 scripts/compare_logits.py "$out/transformers_bf16.json" "$out/lily_$b.json" --json | tee "$out/compare_$b.json"
done
# Lily's backends against each other (both accumulate in f32: a tight check of the GPU kernels).
if [ -f "$out/lily_cpu.json" ] && [ -f "$out/lily_cuda.json" ]; then
  python3 scripts/compare_logits.py "$out/lily_cpu.json" "$out/lily_cuda.json" --json | tee "$out/compare_cuda_vs_cpu.json"
fi
