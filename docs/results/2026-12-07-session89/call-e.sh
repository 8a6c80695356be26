set -u
# Call e (session 89, ~330 s): is the two-stream builds' slower decode right after a long prefill
# (call d: 1.2% after 4K, 1.5% after 8K over 128 steps; even after a 64-token prompt, whose
# prefill uses no second stream; the SM and memory clocks constant at 20 ms) a transient of
# the denser prefill that fades, or the kernels' own? main against sxpl (= sxp on session 88's
# head, the build that would land) with 1,024 decode steps after 4K and 512 after 8K, the HBM
# and GPU temperatures sampled beside the clocks every 20 ms; sxpl's GPU suites first (the
# landing build's: cuda_prefill, cuda_gpu, cuda_sampling, cuda_fixture); sxpl at 32K and 131K.
# Build: . scripts/arm_pack.sh; arm_build sxpl cuda_prefill ../2026-12-07-session88/sxp.patch
# (then, with the patch applied, arm_test .device-sxpl for the other three suites);
# .device-main = session 88's main (6889ff8).
# Carry [".device-main", ".device-sxpl"]. Timeout 600.
. scripts/call_lib.sh
call_init 570
call_unpack main sxpl
call_synth_start main
for s in cuda_prefill cuda_gpu cuda_sampling cuda_fixture; do
    ( TEST_TIMEOUT=200 call_tests $s sxpl > "$OUT/summary-$s.txt" 2>&1 ) &
done
wait
cat "$OUT"/summary-*.txt
grep -E "^default|long chunks" "$OUT/tests-sxpl-cuda_fixture.log" | head -3
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory \
    --format=csv,noheader -lms 20 > "$OUT/smi.csv" 2>&1 &
smi=$!
call_synth_wait
run() { echo "$(date +%T.%N) $1" >> "$OUT/runs.txt"; call_arm "$1" "$2" "$3" | call_bench; }
for r in r1 r2; do for a in main sxpl; do run "$a p4096 d1024 $r" $a "--prompt-len 4096 --decode-steps 1024"; done; done
for r in r1 r2; do for a in sxpl main; do run "$a p8192 d512 $r" $a "--prompt-len 8192 --decode-steps 512"; done; done
kill $smi
python3 scripts/smi_runs.py "$OUT/smi.csv" "$OUT/runs.txt" --last 2.5
xz -9 "$OUT/smi.csv"
run "sxpl p32768 r1" sxpl "--prompt-len 32768 --decode-steps 16"
run "sxpl p131072 r1" sxpl "--prompt-len 131072 --decode-steps 16"
call_end
