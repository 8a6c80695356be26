set -u
# Call f (prepared in session 89 for the next session's first call; ~420 s; any H100 or H200;
# not run in session 89: its device time ran out). Calls d and e showed the two-stream builds'
# decode after a long prefill slower for good (1,024 steps after 4K: 1,874 -> 1,896 us a step;
# 512 after 8K: 1,930 -> 1,967; HBM at ~50 C, clocks constant), growing with the context, and
# none after a 64-token prompt, whose KV is one page per region. Two explanations are left: the
# second stream's use in the prefill, or the 64 MiB its cuBLAS handle takes at start-up shifting
# where the KV pages (and everything after) land. mr's decode after 32K was 2.5% slower too
# (one 16-step run), with a growth's pages mapped in the reverse order: the pages' placement may
# move the attention's reads. Arms (digests must equal main's): main (6889ff8), sxpl (sxp on
# 8e0f550; `../2026-12-07-session88/sxp.patch`), kvpad (main + the same 64 MiB allocated where
# sxp opens its handle, no second stream: `kvpad.patch`), sxoff (sxp with the second stream and
# handle made but the shared expert after the routed experts as main: `sxoff.patch` on sxp),
# kvr (main with a growth's pages mapped in the order the ledger returns them: `kvr.patch`),
# mr (`../2026-12-07-session88/mr.patch`), sxz (sxp with the second stream and its handle opened
# after the first prefill, so that the pages, slots and chunk buffers land where main's do:
# `sxz.patch` on sxp; the warmup's prefill then runs on one stream, the measured one on two).
# Reading: kvpad and sxoff slow like sxpl -> placement
# (the stream is innocent; then the decode's KV pages need a placement that does not move it);
# both as main -> the stream's use; sxz's decode as main's with sxp's prefill -> sxz is the
# build to land (with its GPU suites). The decode timeline of main and sxpl says which kernels;
# --no-warmup (the measured sequence the first, its pages the first made) and direct launches
# (LILY_CUDA_GRAPH=0) whether the warmup's leftovers or the captured graph carry it.
# Build: . scripts/arm_pack.sh; arm_build main -; arm_build sxpl - P88/sxp.patch; arm_build
# kvpad - kvpad.patch; arm_build sxoff - P88/sxp.patch sxoff.patch; arm_build kvr - kvr.patch;
# arm_build mr - P88/mr.patch; arm_build sxz - P88/sxp.patch sxz.patch. (Session 89 built sxpl with its GPU suites; `.device-sxplb` is
# its lily-bench alone.)
# Carry [".device-main", ".device-sxplb", ".device-kvpad", ".device-sxoff", ".device-kvr", ".device-mr",
# ".device-sxz"] (~57 MB with the tree).
# Timeout 540.
. scripts/call_lib.sh
call_init 520
call_unpack main sxplb kvpad sxoff kvr mr sxz
call_synth_start main
call_synth_wait
run() { call_arm "$1" "$2" "$3" | call_bench; }
for r in r1 r2; do for a in main sxplb kvpad sxoff sxz; do run "$a p8192 d256 $r" $a "--prompt-len 8192 --decode-steps 256"; done; done
for a in sxz sxoff kvpad sxplb main; do run "$a p4096 d512 r1" $a "--prompt-len 4096 --decode-steps 512"; done
for a in main sxplb; do
    echo "$a p8192 d256 timeline | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 8192 --decode-steps 256" | call_bench
done
for a in main sxplb; do run "$a p8192 d256 nowarmup" $a "--prompt-len 8192 --decode-steps 256 --no-warmup"; done
for a in main sxplb; do
    echo "$a p8192 d256 nograph | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_GRAPH=0 | --prompt-len 8192 --decode-steps 256" | call_bench
done
for a in main kvr mr kvpad; do run "$a p32768 d128 r1" $a "--prompt-len 32768 --decode-steps 128"; done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -v "^lily-bench" | head -100
python3 scripts/call_summary.py "$OUT" --base main --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
