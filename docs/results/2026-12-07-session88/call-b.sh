set -u
# Call b (session 88, one GPU, right after call a on its machine): llama.cpp's prompt processing
# (llama-batched-bench, prebuilt by bench/build_llama_batched.sh, on the synthetic 35B as a Q4_0
# GGUF, one sequence, flash attention, all layers on the GPU) at 4,096, 8,192 and 32,768 tokens,
# with ubatch 512 and 4096, beside lily-bench main vs sxp at 4K and 8K in the same call.
# Carry [".whl", ".device-main", ".device-sxp"].
. scripts/call_lib.sh
call_init 400
call_unpack main sxp
call_synth_start main
bash bench/h200_steps.sh batched-prebuilt
call_synth_wait
bash bench/h200_steps.sh batched-gguf 2>&1 | tail -2
el gguf
LB=/root/pb/llama/llama.cpp/build/bin/llama-batched-bench
for ub in 512 4096; do
    [ "$(left 60)" -gt 20 ] || break
    timeout "$(left 30)" $LB -m /root/pb/m-Q4_0.gguf -c 33000 -b 4096 -ub $ub -npp 4096,8192,32768 -ntg 1 -npl 1 \
        -fa on -ngl 99 --output-format jsonl > "$OUT/llama-pp-ub$ub.jsonl" 2> "$OUT/llama-pp-ub$ub.log"
    el "llama ub $ub rc=$?"; cat "$OUT/llama-pp-ub$ub.jsonl"
done
for r in r1 r2; do for a in main sxp; do
    call_arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"
    call_arm "$a p8192 $r" $a "--prompt-len 8192 --decode-steps 16"
done; done | call_bench
call_end
