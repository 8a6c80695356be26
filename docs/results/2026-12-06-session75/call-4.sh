set -u
# Call 4 (session 75; one H200, ~560 s): issue 15's table with llama-batched-bench in the same
# call (session 74's call-2.sh, its optional steps only while its deadline allows), then the
# routing kernel's timing arms of call-3.sh with what is left.
# Carry [".device-base", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz",
# ".device-xgemv", ".device-xtopk"] (63 MiB with the tracked tree).
O=${OUT:-/tmp/out}
t0=$(date +%s)
OUT=$O/table DEADLINE=${TABLE_DEADLINE:-420} bash docs/results/2026-12-06-session74/call-2.sh
used=$(( $(date +%s) - t0 ))
echo "table: ${used}s"
[ $(( 570 - used )) -gt 60 ] && OUT=$O/route DEADLINE=$(( 570 - used )) bash docs/results/2026-12-06-session75/call-3.sh
OUT=$O bash scripts/out_bundle.sh
