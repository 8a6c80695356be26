set -u
# Call D (prepared in session 71, not run; the short form of call-c.sh for a small device budget): on `all` (as
# call C) the GPU suites cuda_batch and cuda_prefill, lily-bench at 64 rows x 700 (greedy; its
# digest must equal main's), and the load test's 64-client level (ROUNDS=2, 16 client processes,
# greedy and sampled) if both suites passed. Carry [".device-all", ".device-lilyall", ".whl/openai"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-200}
left() { local l=$(( DEADLINE - ($(date +%s) - t0) )); [ "$l" -gt 5 ] && echo "$l" || echo 5; }
for a in all lilyall; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
mv .device-lilyall/bin/lily .device-all/bin/lily
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
(./.device-all/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1; echo $? > /tmp/synth.rc) &
for t in cuda_batch cuda_prefill; do
  timeout 60 ./.device-all/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
ok=1; for t in cuda_batch cuda_prefill; do grep -q "rc=0" "$OUT/tests-$t.log" || ok=0; done
wait
el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
echo "all b64 r1 | BENCH=./.device-all/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64" > /tmp/arms-d.txt
SKIP_TESTS=1 timeout 40 bash scripts/device_check.sh /tmp/arms-d.txt 2>&1 | grep -v "cannot access" | tail -3
el arms
if [ "$ok" = 1 ]; then
  mkdir -p "$OUT/load"
  OUT=$OUT/load LILY=.device-all/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" LEVELS=64 \
    timeout "$(left)" bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
  el load
fi
bash scripts/out_bundle.sh
