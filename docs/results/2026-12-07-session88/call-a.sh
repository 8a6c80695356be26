set -u
# Call a (session 88, one H200, ~520 s): main = 6889ff8 (session 87's head) on the issue's own
# machine, against three arms that queue work on a second CUDA stream beside the first:
# sx = the long chunks' shared expert beside the routing and the routed experts (`sx.patch`);
# sxp = sx with the first stream at the highest priority, so the second fills the SMs it leaves
# free (`sxp.patch`); sxa = sx with the GDN layers' z, b and a products beside q|k|v and the conv,
# and the attention layers' k and v beside q (`sxa.patch`). GPU suites: sx's cuda_prefill,
# cuda_gpu, cuda_sampling, cuda_fixture; sxa's cuda_prefill. lily-bench 4K and 8K, two rounds,
# alternating arms; main and sx at 32K; main at 131K; main's 4K and 8K phase profiles.
# Build: . scripts/arm_pack.sh; arm_build main -; arm_build sx cuda_prefill sx.patch (and with
# sx.patch applied, arm_test .device-sx for cuda_gpu, cuda_sampling, cuda_fixture);
# arm_build sxp - sxp.patch; arm_build sxa cuda_prefill sxa.patch.
# Carry [".device-main", ".device-sx", ".device-sxp", ".device-sxa"].
. scripts/call_lib.sh
call_init 530
call_unpack main sx sxp sxa
call_synth_start main
for s in cuda_prefill cuda_gpu cuda_sampling cuda_fixture; do
    ( TEST_TIMEOUT=200 call_tests $s sx > "$OUT/summary-$s.txt" 2>&1 ) &
done
( TEST_TIMEOUT=200 call_tests cuda_prefill sxa > "$OUT/summary-sxa-cuda_prefill.txt" 2>&1 ) &
wait
cat "$OUT"/summary-*.txt
grep -E "^default|long chunks" "$OUT/tests-sx-cuda_fixture.log" | head -3
call_synth_wait
for r in r1 r2; do for a in main sx sxp sxa; do
    call_arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"
done; done | call_bench
for r in r1 r2; do for a in sxa sxp sx main; do
    call_arm "$a p8192 $r" $a "--prompt-len 8192 --decode-steps 16"
done; done | call_bench
for a in main sx; do call_arm "$a p32768 r1" $a "--prompt-len 32768 --decode-steps 16"; done | call_bench
call_profiles 4096 'moe[.](gate_up|down|route)|shared|gdn[.](proj|walk|prep)|attn[.]core' main
call_arm "main p131072 r1" main "--prompt-len 131072 --decode-steps 16" | call_bench
call_profiles 8192 'moe[.](gate_up|down|route)|shared|gdn[.](proj|walk|prep)|attn[.]core' main
call_end
