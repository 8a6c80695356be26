set -u
# Call j or m, short (session 91; ~250 s; for when little device time is left), chosen by the
# card: on an H200, issue 17's missing record pieces only (rec's cuda_prefill, 4K twice, 8K,
# 131K, llama.cpp's pp at 4K/8K/32K); on an H100, dec (rq.patch + lmh.patch, bit-identical)
# against rec at 4K in two rounds and 32K once, with dec's cuda_gpu. Carry [".device-rec",
# ".device-dec", ".whl/llama-bin.tar.xz", ".whl/gguf-py.tar.xz"]. Timeout 330.
. scripts/call_lib.sh
call_init 310
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
    call_unpack rec
    bash bench/h200_steps.sh batched-prebuilt | tail -1
    call_synth_start rec
    call_suites rec cuda_prefill
    call_synth_wait
    for r in r1 r2; do call_run "rec p4096 d256 $r" rec "--prompt-len 4096 --decode-steps 256"; done
    call_run "rec p8192 d256 r1" rec "--prompt-len 8192 --decode-steps 256"
    call_run "rec p131072 r1" rec "--prompt-len 131072 --decode-steps 16"
    bash bench/h200_steps.sh batched-gguf 2>&1 | tail -1
    timeout "$(left 10)" bash bench/h200_steps.sh batched-pp 4096
else
    call_unpack rec dec
    call_synth_start rec
    call_suites dec cuda_gpu
    call_synth_wait
    for r in r1 r2; do for a in rec dec; do call_run "$a p4096 d256 $r" $a "--prompt-len 4096 --decode-steps 256"; done; done
    for a in rec dec; do call_run "$a p32768 d128 r1" $a "--prompt-len 32768 --decode-steps 128"; done
fi
python3 scripts/call_summary.py "$OUT" --base rec --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
