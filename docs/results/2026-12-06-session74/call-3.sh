set -u
# Call 3 (session 74; any card, ~250 s): where a 64-row step's GEMV sets wait. Nsight Compute
# (scripts/device_profile.sh, LILY_NCU_BATCH=64 LILY_NCU_FULL=1) on main's lily-bench: one batched
# decode step of 64 sequences (per-kernel times and bytes), then the stall reasons of its first
# twelve staging, GEMV-set and routing kernels (gemv_tcb_f: the GDN in-projection, q|k|v;
# gemv_tcb_wf: the 4,096-column out-projections). Carry [".device-base"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device_unpack.sh .device-base >/dev/null 2>&1
rm -rf .device && ln -s .device-base .device
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] || ./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1
el "synth rc=$?"
LILY_NCU_BATCH=64 LILY_NCU_FULL=1 timeout 500 bash scripts/device_profile.sh "$LILY_CK" 2>&1 | tail -40
el ncu
for f in "$OUT"/*.csv; do [ -f "$f" ] && xz -9 "$f"; done
bash scripts/out_bundle.sh
