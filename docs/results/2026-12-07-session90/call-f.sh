set -u
# Call f (prepared in session 89 for the next session's first call; ~430 s; any H100 or H200;
# not run in session 89: its device time ran out). Calls d and e showed the two-stream builds'
# decode after a long prefill slower for good (1,024 steps after 4K: 1,874 -> 1,896 us a step;
# 512 after 8K: 1,930 -> 1,967; HBM at ~50 C, clocks constant), growing with the context, and
# none after a 64-token prompt, whose KV is one page per region. Two explanations are left: the
# second stream's use in the prefill, or the 64 MiB its cuBLAS handle takes at start-up shifting
# where the KV pages (and everything after) land. Arms (digests must equal main's): main
# (6889ff8), sxplb (sxp on 8e0f550: `../2026-12-07-session88/sxp.patch`), kvpad (main + the same
# 64 MiB allocated where sxp opens its handle, no second stream: `kvpad.patch`), sxoff (sxp
# with the second stream and handle made but the shared expert after the routed experts as in
# main: `sxoff.patch` on sxp), sxzt (`sxz-land.patch`: sxp with the second stream and its handle
# opened after the first prefill, so that the first sequences' pages and the chunk buffers land
# where main's do; the warmup's prefill then runs on one stream, the measured one on two; as it
# would land, with its GPU suites: cuda_prefill, cuda_gpu, cuda_sampling, cuda_fixture).
# Reading: kvpad and sxoff slow like sxplb -> placement (the stream is innocent); both as main
# -> the stream's use. sxzt's decode as main's with sxplb's prefill and its suites passing ->
# land sxz-land.patch (then the record on an H200: main against it at 4K, 8K, 32K, 131K
# with llama.cpp beside, `../2026-12-07-session88/call-d.sh`'s last steps). The decode timeline
# of main and sxplb says which kernels; --no-warmup (the measured sequence the first, its pages
# the first made) and direct launches (LILY_CUDA_GRAPH=0) whether the warmup's leftovers or the
# captured graph carry it. (kvr.patch, a growth's pages mapped in the ledger's order, and mr
# after 32K did not fit the carry; their .device folders are built.)
# Build: . scripts/arm_pack.sh; arm_build main -; arm_build sxplb - P88/sxp.patch; arm_build
# kvpad - kvpad.patch; arm_build sxoff - P88/sxp.patch sxoff.patch; arm_build sxzt cuda_prefill
# sxz-land.patch, then with it applied arm_test .device-sxzt cuda_gpu / cuda_sampling /
# cuda_fixture.
# Carry [".device-main", ".device-sxplb", ".device-kvpad", ".device-sxoff", ".device-sxzt"]
# (~64 MB with the tree). Timeout 560.
. scripts/call_lib.sh
call_init 540
call_unpack main sxplb kvpad sxoff sxzt
call_synth_start main
call_suites sxzt cuda_prefill cuda_gpu cuda_sampling cuda_fixture
call_synth_wait
run() { call_arm "$1" "$2" "$3" | call_bench; }
for r in r1 r2; do for a in main sxplb kvpad sxoff sxzt; do run "$a p8192 d256 $r" $a "--prompt-len 8192 --decode-steps 256"; done; done
for a in sxzt sxoff kvpad sxplb main; do run "$a p4096 d512 r1" $a "--prompt-len 4096 --decode-steps 512"; done
for a in main sxplb; do
    echo "$a p8192 d256 timeline | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 8192 --decode-steps 256" | call_bench
done
for a in main sxplb; do run "$a p8192 d256 nowarmup" $a "--prompt-len 8192 --decode-steps 256 --no-warmup"; done
for a in main sxplb; do
    echo "$a p8192 d256 nograph | BENCH=./.device-$a/bin/lily-bench LILY_CUDA_GRAPH=0 | --prompt-len 8192 --decode-steps 256" | call_bench
done
for a in main sxzt kvpad; do run "$a p32768 d128 r1" $a "--prompt-len 32768 --decode-steps 128"; done
grep -A45 "CUDA timeline over" "$OUT/bench-stderr.log" | grep -v "^lily-bench" | head -100
python3 scripts/call_summary.py "$OUT" --base main --step-windows 64 | sed -n '/Median decode step/,$p'
call_end
