set -u
# Call e (session 86, one GPU, ~160 s): main at f54da24; pro = pro.patch: the cluster gate|up's
# scale and bias rows copied one row per thread (no divisions by run-time counts in the
# prologue; 10,936 -> 9,336 instructions), bit-identical.
# Build: . scripts/arm_pack.sh; arm_build pro cuda_prefill $S/pro.patch (main: call d's).
# Carry [".device-main", ".device-pro"].
. scripts/call_lib.sh
call_init 300
call_unpack main pro
call_synth_start main
call_tests cuda_prefill pro
call_synth_wait
arms="main $PASSED"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for a in $arms; do call_arm "$a p8192 r1" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
call_profiles 4096 'moe[.](gate_up|down)' $arms
call_end
