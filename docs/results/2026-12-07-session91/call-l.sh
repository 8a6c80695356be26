set -u
# Call l (session 91, for the next session's first call; ~480 s; any H100 or H200): issue 18's
# four prepared decode changes against base (the head: .device-rec's lily-bench alone) in one
# call: dec = rq.patch + lmh.patch
# (session 90; bit-identical: digests must equal base's); atc = atc.patch (session 90; one
# sequence's decode attention split on the tensor cores; new digests, bounded by its cuda_gpu
# test); ds1 = ds1.patch (this folder; moe_down_tc at one warp per expert so its blocks fit
# beside gate|up's: new digests, the down sums' order). Suites: dec and ds1 cuda_gpu, atc cuda_gpu +
# cuda_batch. Reading: an arm lands if its decode is above base's by more than the rounds' spread
# where it should act (dec, ds1: 4K; atc: 32K and 131K, 4K not down) and its suites pass.
# Timelines after 4K: base, dec, ds1 (router `gemv_q_split`, lm_head, the expert kernels).
# Carry [".device-base", ".device-dec", ".device-atc", ".device-ds1"] (~60 MB with the tree).
# Timeout 600.
. scripts/call_lib.sh
call_init 580
call_unpack base dec atc ds1
call_synth_start base
( call_suites dec cuda_gpu > /tmp/suites-dec.txt 2>&1 ) &
( call_suites ds1 cuda_gpu > /tmp/suites-ds1.txt 2>&1 ) &
call_suites atc cuda_gpu cuda_batch
wait
cat /tmp/suites-dec.txt /tmp/suites-ds1.txt
grep -h "tensor-core decode attention" "$OUT"/tests-atc-cuda_gpu.log
call_synth_wait
for r in r1 r2; do
    for a in base dec ds1 atc; do call_run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"; done
    for a in base atc; do call_run "$a p32768 d128 $r" $a "--prompt-len 32768 --decode-steps 128"; done
done
for a in base atc; do call_run "$a p131072 d64 r1" $a "--prompt-len 131072 --decode-steps 64"; done
for a in base dec ds1; do
    call_run "$a p4096 d256 timeline" $a "--prompt-len 4096 --decode-steps 256" LILY_CUDA_TIMELINE=1
done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -E "timeline over|gemv_q_split|lm_head|moe_" | head -24
python3 scripts/call_summary.py "$OUT" --base base --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
