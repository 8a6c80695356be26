set -u
# Call 2: main + router-split.patch as it lands. The GPU tests cuda_gpu and cuda_batch, one arm after
# 4K (the split build's figure again), the 35B-width GEMV errors, the serving load test (two
# rounds) on its lily, then Nsight Compute's full set over gdn_step and the lost gdn_step_cl.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck TEST_TIMEOUT=120
bash scripts/device_check.sh .device/arms.txt 2>&1 | tail -12
.device/tests/cuda_gpu --include-ignored --nocapture cuda_gemv_35b_widths 2>&1 | grep -E "gemv|test result" | tee $OUT/gemv-35b-widths.txt
CK=/root/ck ROUNDS=2 bash bench/h200_serve.sh load 2>&1 | tail -14
python3 scripts/call_summary.py "$OUT"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for b in lily-bench lily-bench-gdn; do
  timeout 100 "$ncu" --clock-control none --set full --csv --page raw -k 'regex:^gdn_step' --launch-skip 100 --launch-count 3 \
    ./.device/bin/$b --model /root/ck --backend cuda --prompt-len 700 --decode-steps 4 > $OUT/ncu-$b.csv 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
  python3 scripts/ncu_summary.py $OUT/ncu-$b.csv --stalls | tee $OUT/ncu-$b-stalls.txt
done
