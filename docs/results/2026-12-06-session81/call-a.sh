set -u
# Session 81, call a (one GPU, ~360 s): base = main (aa67387); di = base + the prepared step diet
# (docs/results/2026-12-06-session80-prepared/wg-step-diet.patch, bit-identical); mb = di + gate|up
# with its stages handed over by per-stage full / empty mbarriers (cp.async.mbarrier.arrive.noinc)
# instead of a block barrier per step, every group's scales resident (pf_moe_wg_glu_mb; 161 against
# 201 instructions per step) and the down kernel's code ring the same way (pf_moe_wg_down_res_mb); tma = mb's barriers with the inputs brought by one 128-byte tensor
# copy per slot into the 128-byte swizzle (pf_moe_wg_glu_t; more instructions per step: each
# lane's copy is serialised in an ELECT loop), tests and a profile only.
# 1. di's, mb's and tma's cuda_prefill side by side; 2. lily-bench base / di / mb alternating
# (4,096 x2, 8,192, 16 x 700), an arm dropped if its tests failed; 3. the 4K profiles.
# Carry [".device-base", ".device-di", ".device-mb", ".device-tma"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-450}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) - ${1:-0} )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in tma mb di base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
pids=""
for a in di mb tma; do
  ( timeout 150 ./.device-$a/tests/cuda_prefill --include-ignored --test-threads 2 --nocapture > "$OUT/tests-$a-cuda_prefill.log" 2>&1
    echo "rc=$?" >> "$OUT/tests-$a-cuda_prefill.log" ) &
  pids="$pids $!"
done
wait $pids
for a in di mb tma; do el "cuda_prefill $a"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$a-cuda_prefill.log" | tail -6; done
ok() { grep -q "^rc=0" "$OUT/tests-$1-cuda_prefill.log"; }
arms="base"; for a in di mb; do ok $a && arms="$arms $a"; done
prof="$arms"; ok tma && prof="$prof tma"
while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench | $3"; }
{
  for r in r1 r2; do for a in $arms; do arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done
  for a in $arms; do arm "$a p8192" $a "--prompt-len 8192 --decode-steps 16"; done
  for a in $arms; do arm "$a b16" $a "--prompt-len 700 --decode-steps 16 --batch 16"; done
} > /tmp/arms.txt
SKIP_TESTS=1 timeout "$(left 60)" bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -14
el arms
for a in $prof; do
  [ "$(left 20)" -gt 15 ] || break
  LILY_CUDA_PROFILE=1 timeout "$(left 5)" ./.device-$a/bin/lily-bench --model "$LILY_CK" --backend cuda \
    --prompt-len 4096 --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-4096.txt"
  echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-4096.txt" | tail -1 | cut -c1-90) | $(grep -E '^ +(gdn[.]proj|moe[.]route|moe[.]gate_up|moe[.]down) ' "$OUT/profile-$a-4096.txt" | tail -4 | tr -s ' ' | tr '\n' ' ')"
done
el done
bash scripts/out_bundle.sh
