set -u
# Call P: the decode timeline (LILY_CUDA_TIMELINE=1, docs/cuda.md "Where a graph step's time
# goes") on session 66's landed kernels (.device-o's lily-bench): one sequence after 4,096
# tokens, 16 and 64 rows of 700-token prompts. The reports go to bench-stderr.log.
# Carry [".device-o"]. ~2 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
bash scripts/device_unpack.sh .device-o
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
[ -f "$LILY_CK/config.json" ] || ./.device-o/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-decode-timeline/arms-p.txt 2>&1 | tail -5
grep "CUDA timeline over" "$OUT/bench-stderr.log"
