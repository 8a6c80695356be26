set -u
# Call b (session 87, one GPU, ~260 s): call a's lily-bench arms at 32K only, alternating (new,
# base, new, base, new, base), then each arm's 32K prefill phase profile: call a had new 0.9%
# below base at 32K in one round each (4K and 8K +3.6% and +1.9%), with the same pair's decode,
# whose code is the same, 5% apart.
# Carry [".device-base", ".device-new"].
. scripts/call_lib.sh
call_init 300
call_unpack base new
call_synth_start base
call_synth_wait
for r in r1 r2 r3; do for a in new base; do call_arm "$a p32768 $r" "$a" "--prompt-len 32768 --decode-steps 16"; done; done | call_bench
call_profiles 32768 'moe[.](gate_up|down)|gdn[.]walk|attn[.]core' new base
call_end
