set -u
# Call l (session 91; ~400 s; any H100 or H200): issue 18's three prepared decode changes
# against rec (the head) in one call, for when no H200 comes for call j: dec = rq.patch + lmh.patch
# (bit-identical: digests must equal rec's), atc = atc.patch (one sequence's decode attention
# split on the tensor cores; new digests, bounded by its cuda_gpu test). Suites: dec cuda_gpu,
# atc cuda_gpu + cuda_batch. Reading: an arm lands if its decode is above rec's by more than the
# rounds' spread where it should act (dec: every length; atc: 32K and 131K, 4K not down) and its
# suites pass. Timelines: dec after 4K (router `gemv_q_split`, lm_head), rec and atc after 32K.
# Carry [".device-rec", ".device-dec", ".device-atc"] (~57 MB with the tree). Timeout 560.
. scripts/call_lib.sh
call_init 540
call_unpack rec dec atc
call_synth_start rec
call_suites dec cuda_gpu
call_suites atc cuda_gpu cuda_batch
grep -h "tensor-core decode attention" "$OUT"/tests-atc-cuda_gpu.log
call_synth_wait
run() { call_arm "$1" "$2" "$3" | call_bench; }
for r in r1 r2; do for a in rec dec atc; do
    run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"
    run "$a p32768 d128 $r" $a "--prompt-len 32768 --decode-steps 128"
done; done
for a in rec atc; do run "$a p131072 d64 r1" $a "--prompt-len 131072 --decode-steps 64"; done
echo "dec p4096 d256 timeline | BENCH=./.device-dec/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 4096 --decode-steps 256" | call_bench
for a in rec atc; do
    echo "$a p32768 d128 timeline | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 32768 --decode-steps 128" | call_bench
done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -E "timeline over|gemv_q_split|lm_head|attn split|attn_split" | head -20
python3 scripts/call_summary.py "$OUT" --base rec --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
