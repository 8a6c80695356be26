set -u
# Call h (session 90): call g trimmed to the device time left, for issue 17's record on an H200.
# main at the session's head (no CUDA source change since 6889ff8) with the prefill's GPU suites
# (cuda_prefill), lily-bench at 4K and 8K (two rounds each), 32K and 131K, the 4K
# phase profile, and llama.cpp's prompt processing on the same machine.
# Carry [".device-rec", ".whl/llama-bin.tar.xz", ".whl/gguf-py.tar.xz"]. Timeout 250.
. scripts/call_lib.sh
call_init 235
call_unpack rec
bash bench/h200_steps.sh batched-prebuilt | tail -1
call_synth_start rec
call_suites rec cuda_prefill
call_synth_wait
run() { call_arm "$1" rec "$2" | call_bench; }
for r in r1 r2; do run "main p4096 d128 $r" "--prompt-len 4096 --decode-steps 128"; run "main p8192 d128 $r" "--prompt-len 8192 --decode-steps 128"; done
run "main p32768 r1" "--prompt-len 32768 --decode-steps 16"
run "main p131072 r1" "--prompt-len 131072 --decode-steps 16"
bash bench/h200_steps.sh batched-gguf 2>&1 | tail -1
timeout "$(left 20)" bash bench/h200_steps.sh batched-pp 4096
call_profiles 4096 'moe[.](gate_up|down|route)|shared|gdn[.](proj|walk|prep)|attn[.]core' rec
call_end
