set -u
# Call d (session 86, one GPU, ~300 s): main at f54da24 (gate|up's merged last tiles and
# interleaved copies): cuda_prefill, cuda_gpu, cuda_batch and cuda_fixture side by side, then
# lily-bench at 4K, 8K (two rounds) and 32K; c4 = c4.patch: gate|up in clusters of four (the
# kernel takes them; pairs measured faster before the interleaved copies), bench and profile only.
# Build: . scripts/arm_pack.sh; arm_build main cuda_prefill; arm_test .device-main cuda_gpu;
# arm_test .device-main cuda_batch; arm_test .device-main cuda_fixture; arm_build c4 - $S/c4.patch.
# Carry [".device-main", ".device-c4"].
. scripts/call_lib.sh
call_init 440
call_unpack main c4
call_synth_start main
for s in cuda_prefill cuda_gpu cuda_batch cuda_fixture; do
    ( TEST_TIMEOUT=200 call_tests $s main > "$OUT/summary-$s.txt" 2>&1 ) &
done
wait
cat "$OUT"/summary-*.txt
grep -E "^default|long chunks" "$OUT/tests-main-cuda_fixture.log" | head -3
call_synth_wait
arms="main c4"
for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for r in r1 r2; do for a in $arms; do call_arm "$a p8192 $r" "$a" "--prompt-len 8192 --decode-steps 16"; done; done | call_bench
call_arm "main p32768 r1" main "--prompt-len 32768 --decode-steps 16" | call_bench
call_profiles 4096 'moe[.](gate_up|down)' $arms
call_end
