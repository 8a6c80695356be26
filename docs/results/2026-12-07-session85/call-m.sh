set -u
# Call m (session 85, one GPU, ~170 s): base = main at cc68822 (.device-v); w3 = base + w3.patch:
# the GDN walk's tiles in three stages instead of two, copied in only by the output warps (4-7),
# two chunks ahead, after their part of the chunk before (their products end before the state
# warps' update), so the state warps' chain of products issues no copies (bit-identical).
# Build: . scripts/arm_pack.sh; arm_build v cuda_prefill (at cc68822); arm_build w3 cuda_prefill
# docs/results/2026-12-07-session85/w3.patch. Carry [".device-v", ".device-w3"].
. scripts/call_lib.sh
call_init 300
call_unpack v w3
call_synth_start v
call_tests cuda_prefill w3
call_synth_wait
arms="v $PASSED"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'gdn[.](prep|scan)' $arms
for a in $arms; do call_arm "$a p8192" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
call_end
