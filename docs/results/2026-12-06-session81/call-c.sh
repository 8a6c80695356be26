set -u
# Session 81, call c (one GPU, ~130 s; call b's arms within the device time left): u's
# cuda_prefill (the gate|up mbarrier kernel for every wide shape), then lily-bench at 4,096 once
# per arm (base, d3, l4, u: call-b.sh's header) and u's 4K profile.
# Carry [".device-base", ".device-d3", ".device-l4", ".device-u"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in u l4 d3 base; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
[ -f $LILY_CK/config.json ] && echo 0 > /tmp/synth.rc || \
  setsid nohup bash -c "./.device-base/bin/lily synth --preset 35b-a3b --out $LILY_CK > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" < /dev/null > /dev/null 2>&1 &
timeout 90 ./.device-u/tests/cuda_prefill --include-ignored --test-threads 3 > "$OUT/tests-u-cuda_prefill.log" 2>&1
echo "rc=$?" >> "$OUT/tests-u-cuda_prefill.log"
el "cuda_prefill u"; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-u-cuda_prefill.log" | tail -6
arms="base d3 l4"; grep -q "^rc=0" "$OUT/tests-u-cuda_prefill.log" && arms="$arms u"
while [ ! -f /tmp/synth.rc ] && [ $(( $(date +%s) - t0 )) -lt 110 ]; do sleep 2; done
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
for a in $arms; do
  echo "$a p4096 | BENCH=./.device-$a/bin/lily-bench | --prompt-len 4096 --decode-steps 16"
done > /tmp/arms.txt
SKIP_TESTS=1 timeout 60 bash scripts/device_check.sh /tmp/arms.txt 2>&1 | grep -v "cannot access" | tail -6
el done
bash scripts/out_bundle.sh
