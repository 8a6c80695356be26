set -u
# Call j or m (session 91), chosen by the card that comes: on an H200, session 90's call j
# (issue 17's record with llama.cpp, and dec against rec); on an H100, call m: dec (rq.patch +
# lmh.patch, bit-identical) against rec at 4K and 32K in two rounds with dec's cuda_gpu and the
# 4K timelines (the H200 record needs an H200). Carry [".device-rec", ".device-dec",
# ".whl/llama-bin.tar.xz", ".whl/gguf-py.tar.xz"] (~62 MB with the tree). Timeout 560.
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
    exec bash docs/results/2026-12-07-session90/call-j.sh
fi
. scripts/call_lib.sh
call_init 450
call_unpack rec dec
call_synth_start rec
call_suites dec cuda_gpu
call_synth_wait
for r in r1 r2; do for a in rec dec; do
    call_run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"
    call_run "$a p32768 d128 $r" $a "--prompt-len 32768 --decode-steps 128"
done; done
for a in rec dec; do
    call_run "$a p4096 d256 timeline" $a "--prompt-len 4096 --decode-steps 256" LILY_CUDA_TIMELINE=1
done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -E "timeline over|gemv_q_split|lm_head|gemv_tc_f" | head -20
python3 scripts/call_summary.py "$OUT" --base rec --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
