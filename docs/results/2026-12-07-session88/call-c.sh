set -u
# Call c (session 88, one GPU, ~300 s): why calls a and b had the decode after a 4K prefill
# ~2-3.5% slower in every arm with a second stream (sx, sxp, sxa; the same kernels on the first
# stream). Arms: main; sxp; sxl = sxp with the second stream and its cuBLAS handle made after the
# sequence memory instead of before the decoder's buffers (`sxl.patch`: the same allocations as
# main's until then). lily-bench 4K with 128 decode steps (two rounds), then a 64-token prompt
# (no long chunk: nothing on the second stream) with 256 decode steps; the SM clock and power
# sampled every 20 ms throughout (`smi.csv`).
# Carry [".device-main", ".device-sxp", ".device-sxl"].
. scripts/call_lib.sh
call_init 320
call_unpack main sxp sxl
call_synth_start main
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 20 > "$OUT/smi.csv" 2>&1 &
smi=$!
call_synth_wait
for r in r1 r2; do for a in main sxp sxl; do
    call_arm "$a p4096 d128 $r" $a "--prompt-len 4096 --decode-steps 128"
done; done | call_bench
for a in main sxp sxl; do call_arm "$a p64 d256 r1" $a "--prompt-len 64 --decode-steps 256"; done | call_bench
kill $smi
xz -9 "$OUT/smi.csv"
call_end
