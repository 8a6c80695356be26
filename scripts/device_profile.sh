#!/usr/bin/env bash
# Nsight Compute tables of the decode and prefill kernels, on the GPU machine (docs/cuda.md,
# "Decode round 3"). Run from the repository root after ../shared/tools/device-pack, with the
# 35B checkpoint already written (`.device/bin/lily synth --preset 35b-a3b --out /root/ck`):
#
#   bash scripts/device_profile.sh [/root/ck] [context]      writes ncu-*.csv and ncu-*.txt to $OUT
#
# ncu replays each kernel with cold caches and the clocks left alone (--clock-control none, as
# the machine notes ask); its per-kernel times matched the in-graph phase profile within ~10% on
# 2026-11-29. The decode selection skips the warmup and prefill and takes about two tokens'
# kernels; the prefill selection is the warmup prefill. LILY_NCU_FULL=1 adds a `--set full` pass
# over 16 decode kernels (stall reasons; ~1 min).
#
# LILY_NCU_BATCH=B profiles one batched decode step of B sequences instead (2-token prompts and no
# warmup, so every kernel of the filter is the batch step's; ~720 launches at the 35B shape),
# writing ncu-batch.{csv,txt}, and with LILY_NCU_FULL=1 the stall reasons of the step's first
# expert, router and GEMV-set kernels (ncu-batch-stalls.txt).
set -uo pipefail
ck=${1:-/root/ck}
ctx=${2:-4096}
out=${OUT:-.}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
bench=(./.device/bin/lily-bench --model "$ck" --backend cuda --prompt-len "$ctx")
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,smsp__inst_executed.sum
decode_kernels='regex:^(gemv_q|moe_|gdn_step|attn_|embed_q|argmax)'
if [ -n "${LILY_NCU_BATCH:-}" ]; then
  bench=(./.device/bin/lily-bench --model "$ck" --backend cuda --prompt-len 2 --decode-steps 2 --no-warmup --batch "$LILY_NCU_BATCH")
  batch_kernels='regex:^(moe_tcb|moe_route_batch|gemv_tcb|stage_tcb|gdn_step_batch|attn_.*batch|pf_moe_combine|pf_embed|argmax_next|sample_)'
  timeout 300 "$ncu" --clock-control none --csv --page raw --metrics "$metrics" -k "$batch_kernels" \
    --launch-count 1500 "${bench[@]}" > "$out/ncu-batch.csv" 2> /tmp/ncu-batch.err || tail -3 /tmp/ncu-batch.err
  python3 scripts/ncu_summary.py "$out/ncu-batch.csv" | tee "$out/ncu-batch.txt"
  if [ "${LILY_NCU_FULL:-0}" = 1 ]; then
    timeout 200 "$ncu" --clock-control none --set full --csv --page raw -k 'regex:^(moe_tcb|moe_route_batch|gemv_tcb|stage_tcb)' \
      --launch-count 12 "${bench[@]}" > "$out/ncu-batch-full.csv" 2> /tmp/ncu-full.err || tail -3 /tmp/ncu-full.err
    python3 scripts/ncu_summary.py "$out/ncu-batch-full.csv" --stalls | tee "$out/ncu-batch-stalls.txt"
  fi
  exit 0
fi
timeout 200 "$ncu" --clock-control none --csv --page raw --metrics "$metrics" -k "$decode_kernels" \
  --launch-skip 300 --launch-count 530 "${bench[@]}" > "$out/ncu-decode.csv" 2> /tmp/ncu-decode.err || tail -3 /tmp/ncu-decode.err
python3 scripts/ncu_summary.py "$out/ncu-decode.csv" | tee "$out/ncu-decode.txt"
timeout 200 "$ncu" --clock-control none --csv --page raw --metrics "$metrics" -k 'regex:^pf_' \
  --launch-count 900 "${bench[@]}" > "$out/ncu-prefill.csv" 2> /tmp/ncu-prefill.err || tail -3 /tmp/ncu-prefill.err
python3 scripts/ncu_summary.py "$out/ncu-prefill.csv" | tee "$out/ncu-prefill.txt"
if [ "${LILY_NCU_FULL:-0}" = 1 ]; then
  timeout 200 "$ncu" --clock-control none --set full --csv --page raw -k "$decode_kernels" \
    --launch-skip 300 --launch-count 16 "${bench[@]}" > "$out/ncu-full.csv" 2> /tmp/ncu-full.err || tail -3 /tmp/ncu-full.err
  python3 scripts/ncu_summary.py "$out/ncu-full.csv" --stalls | tee "$out/ncu-stalls.txt"
fi
