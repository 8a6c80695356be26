# The steps every prepared A/B device call makes, for call scripts to source (from the repository
# root on the GPU machine) instead of repeating them. Builds ("arms") live in .device-NAME/ as
# scripts/arm_pack.sh leaves them. A call then reads, e.g.:
#   . scripts/call_lib.sh; call_init 330
#   call_unpack base mc; call_synth_start base
#   call_tests cuda_prefill mc          # sets PASSED to the arms whose suite passed
#   call_synth_wait
#   arms="base $PASSED"
#   for r in r1 r2; do for a in $arms; do call_arm "$a p4096 $r" $a "--prompt-len 4096 --decode-steps 16"; done; done | call_bench
#   call_profiles 4096 'moe[.]gate_up' $arms
#   call_end
# Everything printed also comes back in the call's output; files land in $OUT (bundled by
# call_end: the device tool brings back at most 8 files).

# call_init DEADLINE: the environment, $OUT, the clock. `left [SLACK]` prints the seconds left
# before DEADLINE less SLACK (at least 5), `el MSG` the elapsed time with MSG.
call_init() {
    export OUT=${OUT:-/tmp/out} LILY_CK=${LILY_CK:-/root/ck} LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
    mkdir -p "$OUT"
    CALL_T0=$(date +%s)
    CALL_DEADLINE=${DEADLINE:-$1}
}
el() { echo "[+$(( $(date +%s) - CALL_T0 ))s] $*"; }
left() {
    local l=$(( CALL_DEADLINE - ($(date +%s) - CALL_T0) - ${1:-0} ))
    [ "$l" -gt 5 ] && echo "$l" || echo 5
}

# call_unpack ARM...: decompress each arm's binaries; print the GPU's name.
call_unpack() {
    local a
    for a in "$@"; do bash scripts/device_unpack.sh ".device-$a" > /dev/null 2>&1; done
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1
}

# call_synth_start ARM: the 35B checkpoint at $LILY_CK, written in the background by ARM's
# lily-bench unless it is there; call_synth_wait waits for it (at most until 100 s before the
# deadline).
call_synth_start() {
    rm -f /tmp/synth.rc
    if [ -f "$LILY_CK/config.json" ]; then
        echo 0 > /tmp/synth.rc
        return
    fi
    setsid nohup bash -c "./.device-$1/bin/lily-bench --model $LILY_CK --synth-preset 35b-a3b > /tmp/synth.log 2>&1; echo \$? > /tmp/synth.rc" \
        < /dev/null > /dev/null 2>&1 &
}
call_synth_wait() {
    while [ ! -f /tmp/synth.rc ] && [ "$(left 100)" -gt 5 ]; do sleep 2; done
    el "synth rc=$(cat /tmp/synth.rc 2>/dev/null)"
}

# call_tests SUITE ARM...: each arm's test binary of SUITE (GPU tests included), side by side,
# logs in $OUT/tests-ARM-SUITE.log; PASSED is set to the arms whose run passed.
call_tests() {
    local suite=$1 a pids=""
    shift
    for a in "$@"; do
        ( timeout "${TEST_TIMEOUT:-150}" "./.device-$a/tests/$suite" --include-ignored --test-threads 2 --nocapture > "$OUT/tests-$a-$suite.log" 2>&1
          echo "rc=$?" >> "$OUT/tests-$a-$suite.log" ) &
        pids="$pids $!"
    done
    # shellcheck disable=SC2086
    wait $pids
    PASSED=""
    for a in "$@"; do
        el "$suite $a"
        grep -E "^test result|FAILED|panicked|rc=" "$OUT/tests-$a-$suite.log" | tail -6
        grep -q "^rc=0" "$OUT/tests-$a-$suite.log" && PASSED="$PASSED $a"
    done
    PASSED=${PASSED# }
}

# call_suites ARM SUITE...: ARM's suites side by side (TEST_TIMEOUT each, default 200 s), each
# one's summary printed after all end, then the trained fixture's accuracy lines where
# cuda_fixture ran (what a landing build's call shows).
call_suites() {
    local a=$1 s
    shift
    for s in "$@"; do
        ( TEST_TIMEOUT=${TEST_TIMEOUT:-200} call_tests "$s" "$a" > "$OUT/summary-$a-$s.txt" 2>&1 ) &
    done
    wait
    for s in "$@"; do cat "$OUT/summary-$a-$s.txt"; done
    [ -f "$OUT/tests-$a-cuda_fixture.log" ] && grep -E "^default|long chunks" "$OUT/tests-$a-cuda_fixture.log" | head -3
    return 0
}

# call_arm LABEL ARM ARGS [ENV]: one line of scripts/device_check.sh's arms file (ARM's
# lily-bench, with ENV's assignments, e.g. LILY_CUDA_TIMELINE=1, set for it).
call_arm() { echo "$1 | BENCH=./.device-$2/bin/lily-bench${4:+ $4} | $3"; }

# call_bench: the lily-bench arms on stdin (call_arm's lines) in order, within the deadline; the
# raw lines append to $OUT/ab.jsonl.
call_bench() {
    local f n
    f=$(mktemp)
    cat > "$f"
    n=$(grep -c . "$f")
    SKIP_TESTS=1 timeout "$(left 40)" bash scripts/device_check.sh "$f" 2>&1 | grep -v "cannot access" | tail -$(( n + 4 ))
}

# call_run LABEL ARM ARGS [ENV]: one arm (call_arm's line) run at once (call_bench).
call_run() { call_arm "$@" | call_bench; }

# call_profiles LEN PHASES ARM...: each arm's prefill profile of a LEN-token prompt into
# $OUT/profile-ARM-LEN.txt, printing the total and the phases matching the regex PHASES.
call_profiles() {
    local len=$1 phases=$2 a
    shift 2
    for a in "$@"; do
        [ "$(left 20)" -gt 12 ] || break
        LILY_CUDA_PROFILE=1 timeout "$(left 5)" "./.device-$a/bin/lily-bench" --model "$LILY_CK" --backend cuda \
            --prompt-len "$len" --decode-steps 4 > /dev/null 2> "$OUT/profile-$a-$len.txt"
        echo "$a: $(grep 'prefill profile' "$OUT/profile-$a-$len.txt" | tail -1 | cut -c1-90) |" \
            "$(awk '/prefill profile/ { last = "" } { last = last $0 "\n" } END { printf "%s", last }' "$OUT/profile-$a-$len.txt" |
                grep -E "^ +($phases) " | tr -s ' ' | tr '\n' ' ')"
    done
    el profiles
}

# call_ncu NAME REGEX COUNT ARM LEN: Nsight Compute (--set full) on the first COUNT launches of the
# kernels matching REGEX in ARM's LEN-token prefill (and NCU_DECODE_STEPS decode steps, default
# 1: the first token only), if at least 45 s are left: the raw CSV
# (xz-compressed) and its per-kernel summary with stall reasons in $OUT/NAME.csv.xz, NAME-stalls.txt.
call_ncu() {
    local name=$1 regex=$2 count=$3 arm=$4 len=$5 ncu
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    [ "$(left 10)" -gt 45 ] || return 0
    timeout "$(left 10)" "$ncu" --clock-control none --set full --csv --page raw -k "regex:$regex" --launch-count "$count" \
        "./.device-$arm/bin/lily-bench" --model "$LILY_CK" --backend cuda --prompt-len "$len" --decode-steps "${NCU_DECODE_STEPS:-1}" \
        --no-warmup > "$OUT/$name.csv" 2> /tmp/ncu.err || tail -3 /tmp/ncu.err
    python3 scripts/ncu_summary.py "$OUT/$name.csv" --stalls | tee "$OUT/$name-stalls.txt"
    xz -9 "$OUT/$name.csv"
}

# call_end: $OUT packed into one out.tar.xz.
call_end() {
    el done
    bash scripts/out_bundle.sh
}

# call_ncu_source NAME REGEX ARM LEN: Nsight Compute's per-instruction view (source counters:
# warp stall samples and executed instructions per SASS line) of the first launch of each kernel
# matching REGEX in ARM's LEN-token prefill, if at least 60 s are left: $OUT/NAME-K.csv.xz per
# kernel K (the source page as CSV) and the report itself ($OUT/NAME.ncu-rep.xz).
call_ncu_source() {
    local name=$1 regex=$2 arm=$3 len=$4 ncu k
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    [ "$(left 10)" -gt 60 ] || return 0
    rm -f "/tmp/$name.ncu-rep"
    timeout "$(left 10)" "$ncu" --clock-control none --section SourceCounters --section WarpStateStats \
        --import-source no -k "regex:$regex" --launch-count "${NCU_LAUNCHES:-2}" -o "/tmp/$name" \
        "./.device-$arm/bin/lily-bench" --model "$LILY_CK" --backend cuda --prompt-len "$len" --decode-steps 1 --no-warmup \
        > /tmp/ncu-src.log 2>&1 || tail -3 /tmp/ncu-src.log
    for k in $(echo "$regex" | tr -d '^$()' | tr '|' ' '); do
        "$ncu" -i "/tmp/$name.ncu-rep" -k "$k" --page source --csv --print-source sass > "$OUT/$name-$k.csv" 2> /tmp/ncu-src.err ||
            tail -3 /tmp/ncu-src.err
        xz -9 "$OUT/$name-$k.csv"
    done
    [ -f "/tmp/$name.ncu-rep" ] && xz -9 -c "/tmp/$name.ncu-rep" > "$OUT/$name.ncu-rep.xz"
    el "ncu source $name"
}
