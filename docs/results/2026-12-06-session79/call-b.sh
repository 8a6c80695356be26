set -u
# Session 79, call b (one GPU, ~480 s): base = main (a9cde76); ng (not benchmarked alone, for
# want of device time) = base + session 78's two
# prepared patches (the MoE input norm writing the wgmma experts' staged input; the shared
# expert's SwiGLU writing only its down product's bf16 operand; both bit-identical: digests must
# equal base's); gb = ng + the GDN scan's inputs in bf16 where every segment is chunked (the
# convs write q, k, v as bf16, the prep reads them; digests move, the fixture bounds them);
# go = gb + the chunked walk's outputs in bf16 (the gated norm reads them).
# 1. go's cuda_prefill (new: norm staging, conv bf16 = f32 rounded, chunked scan in bf16) and
# cuda_fixture, gb's cuda_fixture; 2. lily-bench prefill base / gb / go alternating: 4,096
# (two rounds), 8,192, 16 x 700; 3. the 4K profiles; 4. Nsight Compute on base's 4K prefill
# kernels (routing, experts, GDN scan) if time is left.
# Carry [".device-base", ".device-gb", ".device-go"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-480}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in go gb base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 110 ./.device-go/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
grep -hE "Chunked, bf16|bf16 instances|bf16 outputs|norm stag" "$OUT/tests-cuda_prefill.log" | head -16
for a in go gb; do
  timeout 80 ./.device-$a/tests/cuda_fixture --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_fixture-$a.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-cuda_fixture-$a.log"
  el "cuda_fixture $a"; grep -hE "PPL|KL|top-1|^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_fixture-$a.log" | head -14
done
while [ ! -f /tmp/synth.rc ] && [ "$(left 300)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base gb go; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base gb go; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base gb go; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms-b.txt
SKIP_TESTS=1 timeout "$(left 150)" bash scripts/device_check.sh /tmp/arms-b.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in base go gb; do
  [ "$(left 100)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 90)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(norm|gdn[.]conv|gdn[.]scan|moe[.]gate_up|shared) ' "$OUT/profile-$a-4096.txt" | tail -5 | tr -s ' ' | tr '\n' ' ')"
done
el profiles
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ "$(left 10)" -gt 60 ]; then
  timeout "$(left 10)" "$ncu" --clock-control none --set full --csv --page raw \
    -k 'regex:^(pf_few_tc|pf_route$|pf_scan$|pf_scatter$|pf_moe_wg_glu$|pf_moe_wg_down_res$|pf_gdn_chunk|pf_gdn_conv)' --launch-count 14 \
    ./.device-base/bin/lily-bench --model "$LILY_CK" --backend cuda --prompt-len 4096 --decode-steps 1 --no-warmup \
    > "$OUT/ncu-4k-full.csv" 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
  python3 scripts/ncu_summary.py "$OUT/ncu-4k-full.csv" --stalls | tee "$OUT/ncu-4k-stalls.txt"
  xz -9 "$OUT/ncu-4k-full.csv"
fi
el ncu
bash scripts/out_bundle.sh
