set -u
# Call a (session 86, one GPU, ~330 s): base = main at 27c375a; ww = ww.patch: the wgmma
# experts (gate|up pf_moe_wg_glu_mc, down pf_moe_wg_down_res_f) keep two groups of products in
# flight per warpgroup (wgmma wait 1 instead of 0; a stage released a step later), bit-identical.
# Then Nsight Compute's per-instruction stall samples of both kernels on base.
# Build: . scripts/arm_pack.sh; arm_build base -; arm_build ww cuda_prefill $S/ww.patch.
# Carry [".device-base", ".device-ww"].
. scripts/call_lib.sh
call_init 420
call_unpack base ww
call_synth_start base
call_tests cuda_prefill ww
call_synth_wait
arms="base $PASSED"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for a in $arms; do call_arm "$a p8192 r1" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
call_profiles 4096 'moe[.](gate_up|down)' $arms
call_ncu_source src-base '^(pf_moe_wg_glu_mc|pf_moe_wg_down_res_f)$' base 4096
call_end
