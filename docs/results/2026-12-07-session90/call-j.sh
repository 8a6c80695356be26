set -u
# Call j (prepared in session 90 for the next session's first call; ~330 s; meant for an H200):
# issue 17's record on an H200 and issue 18's first two prepared decode changes, in one call.
# rec = the session's head (main's CUDA source since 6889ff8) with cuda_prefill; dec = rec plus
# rq.patch (the router's rows: each lane's one 16-byte chunk, its scale and bias loaded into
# registers before the programmatic-dependent wait instead of into L2) and lmh.patch (sets of
# more tiles than warps, i.e. the lm_head: each warp's next tile into L2 while a tile computes),
# both bit-identical by construction (digests must equal main's), with cuda_gpu (the router set
# with its norm and a 60,000-row set against the CPU, decode parity). Reading: dec's decode above
# main's by more than the rounds' spread, the same digests and cuda_gpu passing -> land both; the
# timelines say which (router `gemv_q_split` us a launch, lm_head us a step).
# Carry [".device-rec", ".device-dec", ".whl/llama-bin.tar.xz", ".whl/gguf-py.tar.xz"] (~62 MB
# with the tree). Timeout 560.
. scripts/call_lib.sh
call_init 540
call_unpack rec dec
bash bench/h200_steps.sh batched-prebuilt | tail -1
call_synth_start rec
( call_suites dec cuda_gpu > /tmp/suites-dec.txt 2>&1 ) &
call_suites rec cuda_prefill
wait
cat /tmp/suites-dec.txt
call_synth_wait
for r in r1 r2; do for a in rec dec; do
    call_run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"
    call_run "$a p8192 d256 $r" $a "--prompt-len 8192 --decode-steps 256"
done; done
for a in rec dec; do call_run "$a p32768 d64 r1" $a "--prompt-len 32768 --decode-steps 64"; done
call_run "rec p131072 r1" rec "--prompt-len 131072 --decode-steps 16"
for a in rec dec; do
    call_run "$a p4096 d256 timeline" $a "--prompt-len 4096 --decode-steps 256" LILY_CUDA_TIMELINE=1
done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -E "timeline over|gemv_q_split|lm_head|gemv_tc_f" | head -20
bash bench/h200_steps.sh batched-gguf 2>&1 | tail -1
timeout "$(left 60)" bash bench/h200_steps.sh batched-pp 4096
call_profiles 4096 'moe[.](gate_up|down|route)|shared|gdn[.](proj|walk|prep)|attn[.]core' rec
python3 scripts/call_summary.py "$OUT" --base rec --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
