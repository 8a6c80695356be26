#!/usr/bin/env bash
# One device call that checks a build and A/Bs it on one machine. Run on the GPU machine from the
# repository root after
#   scripts/device_pack.sh [--raw-tests] --features cuda-testing --test cuda_gpu --test cuda_prefill --test cuda_sampling --test cuda_batch --test cuda_memory --test cuda_fixture
#   (~27 MB, less with --raw-tests; carry [".device"]; the xz-compressed binaries are decompressed below;
#   .device/bin/lily may be left out: a lily-bench then writes the checkpoint, `--synth-preset`)
# then:  bash scripts/device_check.sh [ARMS_FILE]        (everything it prints also lands in $OUT)
#
# 1. the GPU tests (cuda_gpu + cuda_prefill + cuda_sampling + cuda_batch + cuda_memory);
# 2. the 35B checkpoint, written on the machine's own disk (in the background of the tests);
# 3. lily-bench arms, one line each of ARMS_FILE (default: scripts/device_arms.txt):
#      LABEL | ENV ASSIGNMENTS | LILY-BENCH ARGUMENTS
#    e.g.  "cublas off 4K | LILY_CUDA_CUBLAS=0 | --prompt-len 4096". A binary other than
#    .device/bin/lily-bench can be named with BENCH=path in the env column. Lines starting with #
#    are skipped. A switch is only worth making the default if its tests pass and it wins here.
# SKIP_TESTS=1 leaves out step 1; TEST_TIMEOUT (seconds, default 200) bounds each test binary.
# The device tool brings back at most 8 files of $OUT: end a call that writes more (tests, arms,
# a load test) with scripts/out_bundle.sh, which packs them into one out.tar.xz.
set -u
export LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp/device_check}
arms=${1:-scripts/device_arms.txt}
mkdir -p "$out"
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
bash scripts/device_unpack.sh
ck=${LILY_CK:-/root/ck}
# The checkpoint by `lily synth`, or by a lily-bench when the call carries no lily binary.
if [ -x .device/bin/lily ]; then
  writer=(./.device/bin/lily synth --preset 35b-a3b --out "$ck")
else
  writer=("$(ls .device/bin/lily-bench* | grep -v '\.xz$' | head -1)" --model "$ck" --synth-preset 35b-a3b)
fi
[ -f "$ck/config.json" ] || ( "${writer[@]}" > /tmp/synth.log 2>&1 ) &
synth=$!
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  if [ -d .device/tests ]; then
    # scripts/device_pack.sh --raw-tests: one binary per suite, GPU-only tests included.
    for t in .device/tests/*; do
      case "$t" in *.xz) continue;; esac
      timeout "${TEST_TIMEOUT:-200}" "$t" --include-ignored --test-threads 2 > "$out/tests-$(basename "$t").log" 2>&1; echo "rc=$?" >> "$out/tests-$(basename "$t").log"
      el "tests $(basename "$t")"; grep -E "^test result|FAILED|panicked|rc=" "$out/tests-$(basename "$t").log" | tail -4
    done
  else
    timeout "${TEST_TIMEOUT:-200}" bash .device/run test -E "test(cuda)" --no-fail-fast --success-output final > "$out/tests.log" 2>&1; echo "tests rc=$?" >> "$out/tests.log"
    el "tests"; grep -E "^\s+FAIL|Summary|rc=" "$out/tests.log" | tail -8
  fi
fi
wait $synth
show() { python3 -c 'import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: continue
    b = d.get("batch")
    agg = " batch %d aggregate %.1f" % (b, d["decode"]["aggregate_tok_s"]) if b else ""
    print(sys.argv[1], "|", d["prompt_len"], d.get("kv_cache"), "prefill", round(d["prefill"]["tok_s"]), "decode", round(d["decode"]["tok_s"], 1), d["decode"]["token_digest"] + agg)' "$1"; }
while IFS='|' read -r label envs args; do
  label=$(echo "$label" | xargs); [ -z "$label" ] && continue; case "$label" in \#*) continue;; esac
  bench=./.device/bin/lily-bench
  env_list=()
  for kv in $envs; do case "$kv" in BENCH=*) bench=${kv#BENCH=};; *) env_list+=("$kv");; esac; done
  # shellcheck disable=SC2086
  # Each JSON line gains the arm's label ("arm"), so scripts/call_summary.py can pair arms.
  env ${env_list[@]+"${env_list[@]}"} timeout 150 "$bench" --model "$ck" --backend cuda $args \
    2> >(grep -v "^lily-bench: cuda prompt" >> "$out/bench-stderr.log") \
    | python3 -c 'import json,sys
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: continue
    d["arm"]=sys.argv[1]; print(json.dumps(d), flush=True)' "$label" | tee -a "$out/ab.jsonl" | show "$label"
done < "$arms"
el "arms"
