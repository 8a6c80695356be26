set -u
# Prepared for the next session (one H200, ~570 s): issue 15's table with llama-batched-bench in
# the same call (table.sh, its optional steps only while TABLE_DEADLINE allows), then the prepared
# routing prefetch tested and timed against main (call-5.sh with ARM=pf) with what is left.
# Carry [".device-base", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz",
# ".device-pf"] (63.2 MiB with the tracked tree at 30d33f2, close to the 64 MiB limit; the
# results README says how .device-pf is built).
O=${OUT:-/tmp/out}
t0=$(date +%s)
OUT=$O/table DEADLINE=${TABLE_DEADLINE:-420} bash docs/results/2026-12-06-session75/table.sh
used=$(( $(date +%s) - t0 ))
echo "table: ${used}s"
[ $(( 570 - used )) -gt 90 ] && OUT=$O/pf ARM=pf DEADLINE=$(( 570 - used )) bash docs/results/2026-12-06-session75/call-5.sh
OUT=$O bash scripts/out_bundle.sh
