set -u
# Call i (session 85, one GPU, ~350 s): main = main at 204a448 (session 84's pq and aq, whose
# combination has not run), with its cuda_prefill, cuda_gpu and cuda_fixture; x = main +
# pkqd.patch, one build whose LILY_GDN_EXP switch (a trial's, not for landing) picks the chunked
# GDN scan's plan: base (main's: the prep per value head, the walk reading the prep's q and k
# copies), pk (the prep per pair of value heads of a key head: q and k loaded and k.k, q.k
# multiplied once for both), qd (the walk reads q and k from the conv's bf16 outputs, the prep
# writes no copies), both (the default). x's cuda_prefill runs the default and the new test that
# holds all four plans to the f32-input scan's bits. Then Nsight Compute on main's prep and walk.
# Build (from main): . scripts/arm_pack.sh; arm_build main cuda_prefill;
#   for t in cuda_gpu cuda_fixture; do arm_test .device-main $t; done
#   arm_build x cuda_prefill docs/results/2026-12-07-session85/pkqd.patch
# Carry [".device-main", ".device-x"].
. scripts/call_lib.sh
call_init 420
call_unpack main x
call_synth_start main
call_tests cuda_prefill main x
for s in cuda_gpu cuda_fixture; do call_tests $s main; done
call_synth_wait
xb=./.device-x/bin/lily-bench
xarm() { echo "$1 | BENCH=$xb LILY_GDN_EXP=$2 | $3"; }
for r in r1 r2; do
  call_arm "main p4096 $r" main "--prompt-len 4096 --decode-steps 16"
  for e in base pk qd both; do xarm "x-$e p4096 $r" $e "--prompt-len 4096 --decode-steps 16"; done
done | call_bench
call_profiles 4096 'gdn[.](prep|scan)|attn[.](prep|core)' main
for e in base pk qd both; do
  [ "$(left 60)" -gt 12 ] || break
  LILY_GDN_EXP=$e LILY_CUDA_PROFILE=1 timeout "$(left 5)" $xb --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-x-$e-4096.txt"
  echo "x-$e: $(grep 'prefill profile' "$OUT/profile-x-$e-4096.txt" | tail -1 | cut -c1-90) |" \
    "$(awk '/prefill profile/ { last = "" } { last = last $0 "\n" } END { printf "%s", last }' "$OUT/profile-x-$e-4096.txt" |
       grep -E '^ +(gdn[.](prep|scan)) ' | tr -s ' ' | tr '\n' ' ')"
done
{ call_arm "main p8192" main "--prompt-len 8192 --decode-steps 16"; xarm "x-both p8192" both "--prompt-len 8192 --decode-steps 16"; } | call_bench
call_ncu ncu-gdn-4k '^(pf_gdn_chunk_walk_128_f16|pf_gdn_chunk_prep_128_bf16)$' 2 main 4096
call_end
