set -u
# The second call (after call.sh, on the same warm machine or a fresh one): the rest of the arms
# (arms2.txt: 700-token prompts; the GDN prep's own conv at DK 128 with chunks reading the rings,
# whose two digests must match; repeats; 4 and 128 rows; the decode timelines; the L2 evict-last
# variant; 32K), no tests.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
SKIP_TESTS=1 bash scripts/device_check.sh .device/arms2.txt 2>&1 | tail -14
for f in $OUT/ab.jsonl $OUT/bench-stderr.log; do mv $f $OUT/call2-$(basename $f); done
grep -A40 "CUDA timeline" $OUT/call2-bench-stderr.log | grep -v "^      " | head -60
python3 scripts/call_summary.py "$OUT" --same all=all9 --same all9=all8
