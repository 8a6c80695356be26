set -u
# Prepared in session 78, call nw (one GPU, ~170 s): base = main (the shared expert's outputs in
# bf16 landed); nw = base + norm-stages-wg.patch (the MoE input norm writing the wgmma experts'
# staged input itself; no stage_wg launch); ng = nw + shared-glu-staged.patch (the shared
# expert's SwiGLU writing only its down product's bf16 operand). Both bit-identical: every digest
# and the fixture's rows must equal base's / call sh's.
# 1. ng's cuda_prefill (with the new norm-staging test) and cuda_fixture suites; 2. lily-bench
# prefill, base / nw / ng alternating: 4,096 (two rounds), 8,192, 16 x 700; 3. the 4K profiles.
# Carry [".device-base", ".device-nw", ".device-ng"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-380}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in ng nw base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-ng/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill.log"
el cuda_prefill; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill.log" | tail -6
timeout 80 ./.device-ng/tests/cuda_fixture --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_fixture.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_fixture.log"
el cuda_fixture; grep -hE "PPL|KL|top-1|^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_fixture.log" | head -14
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base nw ng; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base nw ng; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in base nw ng; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms-nw.txt
SKIP_TESTS=1 timeout "$(left 40)" bash scripts/device_check.sh /tmp/arms-nw.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in base nw ng; do
  [ "$(left 8)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 3)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(norm|moe[.]gate_up|shared) ' "$OUT/profile-$a-4096.txt" | tail -3 | tr -s ' ' | tr '\n' ' ')"
done
bash scripts/out_bundle.sh
