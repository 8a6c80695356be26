set -u
# Call a (session 87, one GPU, ~430 s): base = 48e1b0d (session 86's head: the last prompt token
# through a decode step); new = 4f61699 (Backend::decode_after: the prompt's first token from the
# prefill's last row, which lily-bench and the idle server take) + one-step.patch (the cluster
# gate|up's two step loops as one, session 86). GPU suites on new: cuda_prefill, cuda_gpu,
# cuda_sampling, cuda_fixture. lily-bench 4K (two rounds), then
# `lily serve` one request at a time (an idle server; scripts/serve_ttft.py: distinct token-id
# prompts, streamed, time to the first token's chunk), sbase = 48e1b0d's lily against
# sfa = 4f61699's, 4K and 32K prompts; then lily-bench 8K, 32K and a sampled 4K.
# Build: . scripts/arm_pack.sh; arm_build base - base.patch (git diff HEAD 48e1b0d -- src);
# arm_build new cuda_prefill one-step.patch; with one-step.patch applied arm_test .device-new for
# cuda_gpu cuda_sampling cuda_fixture; lily (cargo build --release --bin lily; arm_bins
# .device-sX lily) with base.patch into .device-sbase, at 4f61699 into .device-sfa.
# Carry [".device-base", ".device-new", ".device-sbase", ".device-sfa"].
. scripts/call_lib.sh
call_init 430
call_unpack base new sbase sfa
call_synth_start base
for s in cuda_prefill cuda_gpu cuda_sampling cuda_fixture; do
    ( TEST_TIMEOUT=200 call_tests $s new > "$OUT/summary-$s.txt" 2>&1 ) &
done
wait
cat "$OUT"/summary-*.txt
grep -E "^default|long chunks" "$OUT/tests-new-cuda_fixture.log" | head -3
grep -E "decode_after gpu" "$OUT/tests-new-cuda_gpu.log" | head -2
call_synth_wait
for r in r1 r2; do for a in base new; do call_arm "$a p4096 $r" "$a" "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
for a in sbase sfa; do
    [ "$(left 30)" -gt 40 ] || break
    ./.device-$a/bin/lily serve --model "$LILY_CK" --bind 127.0.0.1:0 --max-seq 40000 --prefix-cache-host-mb 0 > "$OUT/serve-$a.log" 2>&1 &
    pid=$!
    url=""
    for _ in $(seq 1 240); do
        url=$(grep -o 'on http://127\.0\.0\.1:[0-9]*' "$OUT/serve-$a.log" | head -1 | cut -d' ' -f2)
        [ -n "$url" ] && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.5
    done
    el "$a serving at $url"
    [ -n "$url" ] && timeout "$(left 20)" python3 scripts/serve_ttft.py "$url" --lens 4096,32768 --repeats 5 --label "$a" | tee -a "$OUT/serve_ttft.jsonl"
    kill $pid; wait $pid 2>/dev/null
done
for a in base new; do call_arm "$a p8192 r1" "$a" "--prompt-len 8192 --decode-steps 16"; done | call_bench
for a in base new; do call_arm "$a p32768 r1" "$a" "--prompt-len 32768 --decode-steps 16"; done | call_bench
for a in base new; do call_arm "$a p4096 sampled r1" "$a" "--prompt-len 4096 --decode-steps 32 --temperature 0.7 --top-k 20 --top-p 0.8 --seed 7"; done | call_bench
call_end
