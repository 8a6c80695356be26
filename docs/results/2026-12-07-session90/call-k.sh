set -u
# Call k (prepared in session 90 for the next session; ~250 s; any H100 or H200): atc.patch, one
# sequence's decode attention split on the tensor cores (`attn_split_tc_{hd}`, the batched step's
# kernel body: bf16 q and probabilities, f32 accumulation) where the cache is bf16, against rec
# (the session's head). The split ran at ~1.1-1.4 TB/s on the CUDA cores (14.1 us a launch after
# 8K, 46.9 after 32K on the decode timeline), the tensor-core kernel at ~2.3 TB/s in the batched
# step. New digests are expected (bf16 products); the suites bound the change: cuda_gpu's
# `cuda_decode_tensor_core_attention_matches_the_cuda_core_kernel` (rel RMS < 0.05 against the
# CUDA-core kernel, < 0.1 and top-1 >= 10/12 against the CPU) and the rest of cuda_gpu and
# cuda_batch (the renamed SplitKernel). Reading: decode after 32K and 131K up by more than the
# rounds' spread, 4K not down, suites passing -> land atc.patch (docs: cuda.md's decode step and
# batched sections, benchmarks.md). Last, Nsight Compute's stall reasons over the first 48 decode
# kernels of rec's step (`ncu-decode-stalls.txt`) if at least 45 s are left.
# Carry [".device-rec", ".device-atc"] (~50 MB with the tree). Timeout 420.
. scripts/call_lib.sh
call_init 400
call_unpack rec atc
call_synth_start rec
call_suites atc cuda_gpu cuda_batch
grep -h "tensor-core decode attention" "$OUT"/tests-atc-cuda_gpu.log
call_synth_wait
for r in r1 r2; do for a in rec atc; do
    call_run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"
    call_run "$a p32768 d128 $r" $a "--prompt-len 32768 --decode-steps 128"
done; done
for a in rec atc; do call_run "$a p131072 d64 r1" $a "--prompt-len 131072 --decode-steps 64"; done
for a in rec atc; do
    call_run "$a p32768 d128 timeline" $a "--prompt-len 32768 --decode-steps 128" LILY_CUDA_TIMELINE=1
done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -E "timeline over|attn split|attn_split" | head -12
python3 scripts/call_summary.py "$OUT" --base rec --step-windows 64 | sed -n '/Median decode step/,$p'
# Where the decode kernels stall on the head (for issue 18's next changes), if time is left.
NCU_DECODE_STEPS=4 call_ncu ncu-decode 'gemv_tc_f|gemv_q_split|moe_gate_up_tc_f|moe_down_tc_f|gdn_step_35b_f16|attn_split_256_bf16' 48 rec 4096
call_end
