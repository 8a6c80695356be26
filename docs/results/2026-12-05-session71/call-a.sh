set -u
# Call A (session 71): the batched GDN step at the 35B's shapes on 256-thread blocks with k / q
# four rows at a time, and the expert ring kernels at the 35B's shapes (moe_tcq_f_35b,
# moe_tcr_f_35b): `all`, against main a6fbf5d (`base`). Carry [".device-base", ".device-all",
# ".whl/openai", ".whl/llama-src.tar.xz"] (lily-bench in each, the two suites in all; the servers'
# lily binaries come with call B). The GPU suites cuda_batch and cuda_prefill on all; lily-bench
# two rounds (64, 16 and 4 rows x 700, 128 steps; every change is bit-identical, so the digests
# must repeat; one sequence's decode runs none of the changed kernels); one round of sampled
# 64 rows (chat settings) on base and all; the decode timeline of all at 64 rows greedy and
# sampled. The Q4_0 GGUF for llama-batched-bench is written in the background (detached, on into
# call B, which runs the peer and the load test back to back on the same warm machine; the
# call's lily-bench results and test logs are left in /root/pb for call B to pick its build).
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for a in base all; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import openai" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl/openai openai  # for call B
[ -f "$LILY_CK/config.json" ] || (./.device-base/bin/lily-bench --model "$LILY_CK" --synth-preset 35b-a3b > /tmp/synth.log 2>&1) &
synth=$!
for t in cuda_batch cuda_prefill; do
  timeout 200 ./.device-all/tests/$t --include-ignored --test-threads 2 > "$OUT/tests-$t.log" 2>&1
  echo "rc=$?" >> "$OUT/tests-$t.log"
  el $t; grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$t.log" | tail -4
done
wait $synth
el synth
mkdir -p /root/pb/llama && tar -C /root/pb/llama -xJf .whl/llama-src.tar.xz
setsid nohup nice -n 10 bash -c "bash bench/h200_steps.sh batched-gguf; echo \$? > /root/pb/gguf.rc" > /root/pb/gguf.log 2>&1 < /dev/null &
S="--temperature 1 --top-p 0.95 --top-k 20 --seed 7"
: > /tmp/arms-a.txt
for round in 1 2; do
  for a in "b64|--prompt-len 700 --decode-steps 128 --batch 64" "b16|--prompt-len 700 --decode-steps 128 --batch 16" "b4|--prompt-len 700 --decode-steps 128 --batch 4"; do
    for arm in base all; do echo "$arm ${a%%|*} r$round | BENCH=./.device-$arm/bin/lily-bench | ${a#*|}" >> /tmp/arms-a.txt; done
  done
done
for arm in base all; do echo "$arm b64s | BENCH=./.device-$arm/bin/lily-bench | --prompt-len 700 --decode-steps 128 --batch 64 $S" >> /tmp/arms-a.txt; done
echo "all b64 timeline | BENCH=./.device-all/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64" >> /tmp/arms-a.txt
echo "all b64s timeline | BENCH=./.device-all/bin/lily-bench LILY_CUDA_TIMELINE=1 | --prompt-len 700 --decode-steps 64 --batch 64 $S" >> /tmp/arms-a.txt
SKIP_TESTS=1 timeout 330 bash scripts/device_check.sh /tmp/arms-a.txt 2>&1 | grep -v "cannot access" | tail -30
el arms
cp "$OUT"/ab.jsonl "$OUT"/tests-*.log /root/pb/
cat /root/pb/gguf.log 2>/dev/null | tail -2
bash scripts/out_bundle.sh
