set -u
# Session 79, call d: prepared, NOT run (too little device time left). One GPU, ~230 s: Nsight Compute's full set (stall reasons, pipes, memory)
# on main's routed experts at 4K (the wgmma gate|up and down kernels in fragment order, two
# launches each; call b's regex missed them: at 4K they are the `_f` instances) and the
# router's few-row product, for the next session's plans.
# Carry [".device-base", ".device-lb"] (base's lily writes the synthetic checkpoint).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in lb base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] || ./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1
el synth
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 150 "$ncu" --clock-control none --set full --csv --page raw \
  -k 'regex:^(pf_moe_wg_glu_f|pf_moe_wg_down_res_f|pf_few_tc_8_8)$' --launch-count 6 \
  ./.device-lb/bin/lily-bench --model "$LILY_CK" --backend cuda --prompt-len 4096 --decode-steps 1 --no-warmup \
  > "$OUT/ncu-4k-experts.csv" 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
python3 scripts/ncu_summary.py "$OUT/ncu-4k-experts.csv" --stalls | tee "$OUT/ncu-4k-experts-stalls.txt"
python3 - "$OUT/ncu-4k-experts.csv" <<'PY' > "$OUT/ncu-4k-experts-pipes.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = rows[0]
want = [h for h in head if any(k in h for k in ("pipe_tensor", "inst_executed_pipe", "sm__throughput", "l1tex__throughput", "lts__throughput", "dram__throughput", "issue_active", "warps_active", "shared_op", "bank_conflict", "smsp__cycles_active.avg"))]
for r in rows[2:]:
    if len(r) != len(head): continue
    d = dict(zip(head, r))
    print(d.get("Kernel Name"), {w: d[w] for w in want if d[w] not in ("", "n/a")})
PY
xz -9 "$OUT/ncu-4k-experts.csv"
el ncu
bash scripts/out_bundle.sh
