set -u
# Session 80, call b (one GPU, ~330 s): base = main at bac97b0 (ft landed); w = base + the gate|up
# wgmma kernel's input copies as whole 128-byte rows per slot and group (4 slots x 8 pieces per
# warp instruction: half the L2 requests; call a's Nsight Compute had pf_moe_wg_glu_f at 75.6% of
# the L2's tag-lookup rate with 34% of its sector rate); wp = w + call a's one-group wgmma
# pipelining (wg-pipelined-one-group.patch). All bit-identical: digests must equal base's.
# 1. wp's cuda_prefill; 2. lily-bench base / w / wp alternating (4,096 x2, 8,192, 16 x 700);
# 3. the 4K profiles; 4. Nsight Compute on w's experts.
# Carry [".device-base", ".device-w", ".device-wp"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-400}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in wp w base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-wp/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base w wp; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base w wp; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base w wp; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 120)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -10
el arms
for a in base w wp; do
  [ "$(left 100)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 90)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(gdn[.]proj|moe[.]route|moe[.]gate_up|moe[.]down) ' "$OUT/profile-$a-4096.txt" | tail -4 | tr -s ' ' | tr '\n' ' ')"
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ "$(left 10)" -gt 60 ]; then
  timeout "$(left 10)" "$ncu" --clock-control none --set full --csv --page raw \
    -k 'regex:^(pf_moe_wg_glu_f$|pf_moe_wg_down_res_f$)' --launch-count 4 \
    ./.device-w/bin/lily-bench --model "$LILY_CK" --backend cuda --prompt-len 4096 --decode-steps 1 --no-warmup \
    > "$OUT/ncu-4k-full.csv" 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
  python3 scripts/ncu_summary.py "$OUT/ncu-4k-full.csv" --stalls | tee "$OUT/ncu-4k-stalls.txt"
  xz -9 "$OUT/ncu-4k-full.csv"
fi
el done
bash scripts/out_bundle.sh
