set -u
# Call o (session 85, one GPU, ~170 s): base = main at d368123 (.device-n: the walk's copies by
# the output warps, in their half of a chunk after the barrier); p1 = p1.patch: those copies
# issued in the first half instead (after the output warps' Q S, which is shorter than the state
# warps' W S and D); p45 = p45.patch: only warps 4 and 5 (the output warps whose M D has the
# fewest k-steps) copy. Both bit-identical. Build: . scripts/arm_pack.sh; arm_build n -;
# arm_build p1 cuda_prefill $S/p1.patch; arm_build p45 cuda_prefill $S/p45.patch.
# Carry [".device-n", ".device-p1", ".device-p45"].
. scripts/call_lib.sh
call_init 280
call_unpack n p1 p45
call_synth_start n
call_tests cuda_prefill p1 p45
call_synth_wait
arms="n $PASSED"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'gdn[.](prep|scan)' $arms
call_end
