set -u
# Call f (session 89, ~180 s): call e showed sxpl's decode after a long prefill slower for good
# (1,024 steps after 4K: 1,874 -> 1,896 us a step; 512 after 8K: 1,930 -> 1,967; HBM at ~50 C,
# clocks constant), growing with the context, and call d none after a 64-token prompt (no second
# stream). Which kernels, and what it hangs on: main against sxpl after 8K, 256 steps, as they
# are, and with the decode timeline (LILY_CUDA_TIMELINE=1: per-kernel times of the graph
# steps). (Direct launches and --no-warmup arms were cut: the budget left was ~316 s.) Then whether the KV pages'
# order alone moves the decode at long context (call d: mr, whose growth maps each region's pages
# in the reverse order, decoded 411.7 tok/s after 32K against main's 422.1): main, kvr (main
# with a growth's pages mapped in the order the ledger returned them, `kvr.patch`) and mr,
# 128 steps after 32K.
# Carry [".device-main", ".device-sxpl", ".device-kvr", ".device-mr"]. Timeout 230.
. scripts/call_lib.sh
call_init 225
call_unpack main sxpl kvr mr
call_synth_start main
call_synth_wait
line() { echo "$1 | BENCH=./.device-$2/bin/lily-bench $3 | --prompt-len 8192 --decode-steps 256 $4"; }
for a in main sxpl; do line "$a p8192 d256" $a "" ""; done | call_bench
for a in main sxpl; do line "$a p8192 d256 timeline" $a LILY_CUDA_TIMELINE=1 ""; done | call_bench
for a in main kvr mr; do call_arm "$a p32768 d128" $a "--prompt-len 32768 --decode-steps 128"; done | call_bench
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -v "^lily-bench" | head -100
call_end
