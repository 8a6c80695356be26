set -u
# Call b (session 86, one GPU, ~330 s): base = main at 27c375a's kernels; m160 = m160.patch: the
# cluster gate|up's tile at an expert's last full 128 slots takes in up to 32 more (a tile of up
# to 160 slots, m64n160k16, one A buffer), and the tail tile it absorbed launches nothing;
# bit-identical. Then Nsight Compute's per-instruction view of m160's gate|up.
# Build: . scripts/arm_pack.sh; arm_build base -; arm_build m160 cuda_prefill $S/m160.patch.
# Carry [".device-base", ".device-m160"].
. scripts/call_lib.sh
call_init 430
call_unpack base m160
call_synth_start base
call_tests cuda_prefill m160
call_synth_wait
arms="base $PASSED"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for r in r1 r2; do for a in $arms; do call_arm "$a p8192 $r" "$a" "--prompt-len 8192 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'moe[.](gate_up|down)' $arms
case " $PASSED " in *" m160 "*) call_ncu_source src-m160 '^(pf_moe_wg_glu_mc)$' m160 4096 ;; esac
call_end
