set -u
# Call i (session 90): the least of issue 17's H200 record that fits the device time left: main
# at the session's head at 4K (two rounds), 8K and 131K (call f has main's 8K twice and 32K on an
# H200; call g the suites and llama.cpp on an H100). Carry [".device-rec"]. Timeout 180.
. scripts/call_lib.sh
call_init 170
call_unpack rec
call_synth_start rec
call_synth_wait
run() { call_arm "$1" rec "$2" | call_bench; }
for r in r1 r2; do run "main p4096 d128 $r" "--prompt-len 4096 --decode-steps 128"; done
run "main p8192 d128 r1" "--prompt-len 8192 --decode-steps 128"
run "main p131072 r1" "--prompt-len 131072 --decode-steps 16"
call_end
