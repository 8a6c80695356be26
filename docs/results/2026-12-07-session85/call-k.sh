set -u
# Call k (session 85, one GPU, ~90 s): main's exact build at cc68822 (the wgmma attention cores'
# wrappers from one macro, machine code unchanged; the new test of the attention prep's q16
# instance): its cuda_prefill. Build: . scripts/arm_pack.sh; arm_build v cuda_prefill.
# Carry [".device-v"].
. scripts/call_lib.sh
call_init 200
call_unpack v
TEST_TIMEOUT=180 call_tests cuda_prefill v
grep -E "attention prep q16|test cuda_prefill_attention_prep_q16" "$OUT/tests-v-cuda_prefill.log"
call_end
