set -u
# Session 79, call c (one GPU, ~250 s): base = a9cde76 (session 78's main); ng = base + session
# 78's two prepared patches alone (bit-identical: its digests must equal base's); lb = main with
# them and the GDN scan's inputs in bf16 (call b's gb, landed); sc = lb + pf_scatter reserving
# each expert's run once per block (the lists' order within an expert changes, no output may:
# sc's digests must equal lb's). 1. sc's cuda_prefill (with the new slot-list test); 2. lily-bench
# prefill base / ng / lb / sc alternating, 4,096 two rounds, 8,192; 3. sc's and lb's 4K profiles;
# 4. lb's cuda_prefill if time is left. Carry [".device-base", ".device-ng", ".device-lb", ".device-sc"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-330}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in sc lb ng base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 100 ./.device-sc/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-cuda_prefill-sc.log" 2>&1
echo "rc=$?" >> "$OUT/tests-cuda_prefill-sc.log"
el cuda_prefill sc; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill-sc.log" | tail -6
grep -hE "slot lists" "$OUT/tests-cuda_prefill-sc.log" | head -6
while [ ! -f /tmp/synth.rc ] && [ "$(left 200)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in base ng lb sc; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in base lb sc; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
} > /tmp/arms-c.txt
SKIP_TESTS=1 timeout "$(left 80)" bash scripts/device_check.sh /tmp/arms-c.txt 2>&1 | grep -v "cannot access" | tail -12
el arms
for a in sc lb; do
  [ "$(left 60)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 50)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(moe[.]route|gdn[.]conv|gdn[.]scan) ' "$OUT/profile-$a-4096.txt" | tail -3 | tr -s ' ' | tr '\n' ' ')"
done
el profiles
if [ "$(left 5)" -gt 45 ]; then
  timeout "$(left 5)" ./.device-lb/tests/cuda_prefill --include-ignored --test-threads 2 > "$OUT/tests-cuda_prefill-lb.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-cuda_prefill-lb.log"
  el cuda_prefill lb; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-cuda_prefill-lb.log" | tail -6
fi
bash scripts/out_bundle.sh
