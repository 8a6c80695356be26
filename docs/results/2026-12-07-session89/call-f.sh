set -u
# Call f (session 89, ~200 s): call e showed sxpl's decode after a long prefill slower for good
# (1,024 steps after 4K: 1,874 -> 1,896 us a step; 512 after 8K: 1,930 -> 1,967; HBM at ~50 C,
# clocks constant), growing with the context, and call d none after a 64-token prompt (no second
# stream). Which kernels, and what it hangs on: main against sxpl after 8K, 256 steps, as they
# are; with the decode timeline (LILY_CUDA_TIMELINE=1: per-kernel times of the graph steps);
# with direct launches (LILY_CUDA_GRAPH=0); and without the warmup (--no-warmup: the measured
# sequence is the first, its prefill the first two-stream one). Then whether the KV pages'
# order alone moves the decode at long context (call d: mr, whose growth maps each region's pages
# in the reverse order, decoded 411.7 tok/s after 32K against main's 422.1): main, kvr (main
# with a growth's pages mapped in the order the ledger returned them, `kvr.patch`), mr and sxpl,
# 128 steps after 32K.
# Carry [".device-main", ".device-sxpl", ".device-kvr", ".device-mr"]. Timeout 420.
. scripts/call_lib.sh
call_init 400
call_unpack main sxpl kvr mr
call_synth_start main
call_synth_wait
line() { echo "$1 | BENCH=./.device-$2/bin/lily-bench $3 | --prompt-len 8192 --decode-steps 256 $4"; }
for a in main sxpl; do line "$a p8192 d256" $a "" ""; done | call_bench
for a in main sxpl; do line "$a p8192 d256 timeline" $a LILY_CUDA_TIMELINE=1 ""; done | call_bench
for a in main sxpl; do line "$a p8192 d256 nograph" $a LILY_CUDA_GRAPH=0 ""; done | call_bench
for a in main sxpl; do line "$a p8192 d256 nowarmup" $a "" --no-warmup; done | call_bench
for a in sxpl main; do line "$a p8192 d256 r2" $a "" ""; done | call_bench
for a in main kvr mr sxpl; do call_arm "$a p32768 d128" $a "--prompt-len 32768 --decode-steps 128"; done | call_bench
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -v "^lily-bench" | head -100
call_end
