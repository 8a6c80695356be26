set -u
# Call d (prepared in session 88 for the next session's first call, in place of call c; ~400 s;
# best on an H200, the machine): (1) why every two-stream build decoded 1-4% slower
# right after its prefill in calls a and b: main, sxp and sxl (sxp with the second stream and its
# cuBLAS handle made after the sequence memory, so every allocation before it is main's) with
# 128 decode steps after 4K and 8K prompts (two rounds) and 256 after a 64-token prompt (no long
# chunk, nothing on the second stream), the SM clock and power sampled every 20 ms
# (`smi.csv.xz`, each run's start time in `runs.txt`): a start-up allocation effect shows in sxp
# and not sxl, a clock effect of the denser prefill as lower clocks after the prefill that the
# 128 steps outlast; (2) the record on this machine: main at 32K and 131K, main's 4K phase
# profile, llama.cpp's prompt processing (prebuilt llama-batched-bench, Q4_0 GGUF) at 4K, 8K, 32K;
# (3) sxb = sxp with the GDN layers' b and a product beside the conv (`sxb.patch`: a few-row
# product, no cuBLAS scratch; it was one of sxa's three, and sxa's loss may be z's); (4) mr =
# main with a sequence's growth mapping each KV region's new pages as one run with one access
# call (`mr.patch`: 20 `cuMemSetAccess` calls for any prompt instead of one per page, 40 at 4K
# and 1,280 at 131K, all on the host before the prefill's first launch): 4K to 131K.
# Build: . scripts/arm_pack.sh; arm_build main -; arm_build sxp - sxp.patch; arm_build sxl -
# sxl.patch; arm_build sxb - sxb.patch; arm_build mr - mr.patch (patches from this folder, on 6889ff8 or a later main they apply to);
# .whl/llama-bin.tar.xz by bench/build_llama_batched.sh, .whl/gguf-py.tar.xz = llama-src's
# llama.cpp/gguf-py.
# Carry [".device-main", ".device-sxp", ".device-sxl", ".device-sxb", ".device-mr", ".whl/llama-bin.tar.xz",
# ".whl/gguf-py.tar.xz"] (~64.6 MB with the tree; the limit is 67.1 MB). Timeout 600.
. scripts/call_lib.sh
call_init 570
call_unpack main sxp sxl sxb mr
call_synth_start main
bash bench/h200_steps.sh batched-prebuilt | tail -1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 20 > "$OUT/smi.csv" 2>&1 &
smi=$!
call_synth_wait
run() { echo "$(date +%T.%N) $1" >> "$OUT/runs.txt"; call_arm "$1" "$2" "$3" | call_bench; }
for r in r1 r2; do for a in main sxp sxl sxb mr; do run "$a p4096 d128 $r" $a "--prompt-len 4096 --decode-steps 128"; done; done
for r in r1 r2; do for a in mr sxb sxl sxp main; do run "$a p8192 d128 $r" $a "--prompt-len 8192 --decode-steps 128"; done; done
for a in main sxp sxl; do run "$a p64 d256 r1" $a "--prompt-len 64 --decode-steps 256"; done
kill $smi
python3 scripts/smi_runs.py "$OUT/smi.csv" "$OUT/runs.txt" --last 1.5
xz -9 "$OUT/smi.csv"
for a in main mr; do run "$a p32768 r1" $a "--prompt-len 32768 --decode-steps 16"; done
for a in main mr; do run "$a p131072 r1" $a "--prompt-len 131072 --decode-steps 16"; done
call_profiles 4096 'moe[.](gate_up|down|route)|shared|gdn[.](proj|walk|prep)|attn[.]core' main
bash bench/h200_steps.sh batched-gguf 2>&1 | tail -1
timeout "$(left 20)" bash bench/h200_steps.sh batched-pp
call_end
