set -u
# Call n (session 85, one GPU, ~150 s): Nsight Compute on main at d368123 (the walk's copies by
# the output warps): the 4K prefill's GDN walk and prep and the wgmma experts (gate|up, down),
# first layer each, for the next session's choices. Build: . scripts/arm_pack.sh; arm_build n -.
# Carry [".device-n"].
. scripts/call_lib.sh
call_init 240
call_unpack n
call_synth_start n
call_synth_wait
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout "$(left 10)" "$ncu" --clock-control none --set full --csv --page raw \
  -k 'regex:^(pf_gdn_chunk_walk_128_f16|pf_gdn_chunk_prep_128_bf16|pf_moe_wg_glu_mc|pf_moe_wg_down_res)$' --launch-count 4 \
  ./.device-n/bin/lily-bench --model "$LILY_CK" --backend cuda --prompt-len 4096 --decode-steps 1 --no-warmup \
  > "$OUT/ncu-4k.csv" 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
python3 scripts/ncu_summary.py "$OUT/ncu-4k.csv" --stalls | tee "$OUT/ncu-4k-stalls.txt"
xz -9 "$OUT/ncu-4k.csv"
call_end
