set -u
# Call l (session 85, one H200 asked for, ~200 s): main's exact build at cc68822 (carry .device-v,
# built by `arm_build v cuda_prefill`): lily-bench at 4K and 8K (two rounds each) and 32K (one),
# and the 4K phase profile, for issue 17's targets on the machine they are set on.
. scripts/call_lib.sh
call_init 330
call_unpack v
call_synth_start v
call_synth_wait
for r in r1 r2; do for n in 4096 8192; do call_arm "main p$n $r" v "--prompt-len $n --decode-steps 16"; done; done | call_bench
call_arm "main p32768" v "--prompt-len 32768 --decode-steps 16" | call_bench
call_profiles 4096 'gdn[.](prep|scan)|moe[.](gate_up|down)|norm' v
call_end
