set -u
# Call Q: Nsight Compute's full set (stall reasons, pipes, memory) for the three largest kernels
# of a batched decode step on session 66's kernels (.device-o's lily-bench): the experts'
# gate|up (moe_tcr_f) and down (moe_tcp_f) and the GDN step (gdn_step_batch_f16), one step of
# 16 and of 64 rows (2-token prompts, no warm-up, as scripts/device_profile.sh's batch mode).
# Carry [".device-o"]. ~3 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-o
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || ./.device-o/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for b in 16 64; do
  timeout 150 "$ncu" --clock-control none --set full --csv --page raw -k 'regex:^(moe_tcr_f|moe_tcp_f|gdn_step_batch_f16)$' \
    --launch-count 6 ./.device-o/bin/lily-bench --model "$LILY_CK" --backend cuda --prompt-len 2 --decode-steps 2 --no-warmup --batch $b \
    > "$OUT/ncu-b$b-full.csv" 2> /tmp/ncu-$b.err || tail -3 /tmp/ncu-$b.err
  python3 scripts/ncu_summary.py "$OUT/ncu-b$b-full.csv" --stalls | tee "$OUT/ncu-b$b-stalls.txt"
done
xz -9 "$OUT"/ncu-b*-full.csv
