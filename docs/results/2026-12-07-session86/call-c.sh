set -u
# Call c (session 86, one GPU, ~260 s): m160 = main at c87c5fd (gate|up's merged last tiles);
# il = il.patch: gate|up's tensor copies spread over the warps by slot (warp w copies slots w,
# w + 16, ...), so a 128-slot tile's copies are even across all 16 warps again; dm = dm.patch: il
# and the down kernel's merged last tiles (fragment order: an expert's last full tile takes in up
# to 32 more slots, 160-slot inputs resident, a ring of six stages, one A buffer). All
# bit-identical. Build: . scripts/arm_pack.sh; arm_build il - $S/il.patch; arm_build dm
# cuda_prefill $S/dm.patch; (dm applied) arm_test .device-dm cuda_fixture.
# Carry [".device-m160", ".device-il", ".device-dm"].
. scripts/call_lib.sh
call_init 420
call_unpack m160 il dm
call_synth_start m160
call_tests cuda_prefill dm
P1=$PASSED
call_tests cuda_fixture dm
grep -E "PPL|KL|top-1|top1" "$OUT/tests-dm-cuda_fixture.log" | head -6
call_synth_wait
arms="m160 il"
[ -n "$P1" ] && arms="$arms dm"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for r in r1 r2; do for a in $arms; do call_arm "$a p8192 $r" "$a" "--prompt-len 8192 --decode-steps 16"; done; done | call_bench
call_profiles 4096 'moe[.](gate_up|down)' $arms
call_end
