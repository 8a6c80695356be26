set -u
# Call j (session 85, one GPU, ~300 s): main = main at 204a448; pb = main + pb.patch, the GDN
# chunk prep on 8 warps with every phase spread evenly over them (k.k and q.k by tiles, U and W
# by column slices: the same products as main's) and T = (I + A)^-1 solved in 16 x 16 blocks
# (diagonal blocks by forward substitution, the rows of blocks below as T_ij = -T_ii sum A_ik T_kj
# in f32) instead of 64 threads' column-by-column substitution: not bit-identical (f32 sums in
# another order), so pb runs cuda_fixture as well as cuda_prefill; pb3 = pb with three blocks per
# SM (__launch_bounds__(256, 3): 80 registers, 84 bytes spilled) instead of two (118 registers).
# Build (from main): . scripts/arm_pack.sh; arm_build main -; arm_build pb cuda_prefill $S/pb.patch
#   (and pb's cuda_fixture: git apply $S/pb.patch; arm_test .device-pb cuda_fixture; git reset --hard)
#   arm_build pb3 cuda_prefill $S/pb3.patch      (S=docs/results/2026-12-07-session85)
# Carry [".device-main", ".device-pb", ".device-pb3"].
. scripts/call_lib.sh
call_init 330
call_unpack main pb pb3
call_synth_start main
call_tests cuda_prefill pb pb3
passed=$PASSED
call_tests cuda_fixture pb
call_synth_wait
arms="main $passed"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'gdn[.](prep|scan)' $arms
for a in $arms; do call_arm "$a p8192" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
call_end
