#!/usr/bin/env bash
# The peer benchmark on one GPU machine (H200), in steps that each fit one 10-minute device call.
# Everything persistent lives under $W (/root/pb) and /root/ck, which survive between calls only
# while the machine stays warm: make the calls back to back. See bench/README.md for what each
# step carries. Run from the repository root on the GPU machine:
#
#   bash bench/h200_steps.sh setup      carry .whl (mlx part aa, mlx + mlx-lm wheels, llama-src) and .device-lead
#                                       (lily, lily-bench): 35B checkpoint, Q4_0 GGUF; llama.cpp builds and the
#                                       Q4_K_M quantization start detached and run on into the next calls
#   bash bench/h200_steps.sh wait JOB   until a detached job (llama-cuda-build, quantize-km) has ended
#   bash bench/h200_steps.sh mlx        carry .whl-b (mlx parts ab, ac): MLX-LM install
#   bash bench/h200_steps.sh ck / mlx-arms / mlx-detach   the MLX-LM arm alone (see bench/README.md)
#   bash bench/h200_steps.sh tf-determinism  where transformers' greedy rounds diverge; tf-arms ...: its arm
#   bash bench/h200_steps.sh matrix ... run_all.py with every arm found, extra arguments passed on
#   bash bench/h200_steps.sh out        copy results + doc to $OUT
#   bash bench/h200_steps.sh batched-start / batched-gguf / batched [SECONDS]   llama-batched-bench, the
#                                       batched-decode peer (carry .whl/llama-src.tar.xz); batched-prebuilt
#                                       in place of batched-start takes a binary built beforehand;
#                                       batched-pp [UBATCHES] its prompt processing (issue 17's peer)
set -uo pipefail
W=/root/pb
CK=/root/ck
DAY=${BENCH_DAY:-$(date +%F)}
RES=$W/results/$DAY
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$W/whl" "$RES"
log() { echo "[$(date +%T)] $*"; }

# The system python's nvidia/* wheel libraries (cuBLAS, cuDNN, NCCL, NVRTC ... of torch cu130): libmlx.so's RPATH
# points at them relative to its own site-packages, which is not the system one when installed with --target.
nvidia_libs() {
  python3 - <<'PY'
import glob, os, nvidia
print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "lib", "*.so*"))})))
PY
}

gguf_py() { PYTHONPATH=$W/llama/llama.cpp/gguf-py python3 "$@"; }

LLAMA_CMAKE="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON"

# detach NAME CMD: CMD in a new process session (the device tool kills a call's other processes when
# it returns, not these: they run on while the machine stays warm), niced below the timed arms;
# output in $W/NAME.log, exit status in $W/NAME.rc once it ends.
detach() {
  local name=$1; shift
  rm -f "$W/$name.rc"
  setsid nohup nice -n 10 bash -c "( $* ); echo \$? > $W/$name.rc" > "$W/$name.log" 2>&1 < /dev/null &
}

# wait_rc NAME SECONDS: wait for a detached job; succeeds when it ended with status 0.
wait_rc() {
  local name=$1 t=${2:-540} i=0
  while [ ! -f "$W/$name.rc" ] && [ "$i" -lt "$t" ]; do sleep 2; i=$((i + 2)); done
  if [ ! -f "$W/$name.rc" ]; then log "$name: still running after ${t}s"; return 1; fi
  log "$name: rc=$(cat "$W/$name.rc")"; [ "$(cat "$W/$name.rc")" = 0 ]
}

matrix() {
  local engines="lily" extra=()
  [ -x "$W/bin/lily-bench" ] || { echo "no lily binaries in $W/bin" >&2; return 1; }
  extra+=(--lily-bench "$W/bin/lily-bench" --lily "$W/bin/lily" --lily-backend cuda)
  if [ "$(cat "$W/llama-cuda-build.rc" 2>/dev/null)" = 0 ]; then
    engines+=",llama.cpp"
    local g=""
    [ -f "$W/m-Q4_0.gguf" ] && g="Q4_0=$W/m-Q4_0.gguf"
    [ -f "$W/m-Q4_K_M.gguf" ] && g="${g:+$g,}Q4_K_M=$W/m-Q4_K_M.gguf"
    extra+=(--llama-bench "$W/llama/llama.cpp/build/bin/llama-bench" --gguf "$g")
  fi
  if [ -d "$W/site/mlx" ]; then
    engines+=",mlx-lm"
    extra+=(--mlx-python "$W/mlxpy")
  fi
  engines+=",transformers"
  extra+=(--torch-python python3)
  python3 bench/run_all.py --model "$CK" --engines "$engines" "${extra[@]}" --out "$RES" --title "H200" "$@"
}

case "${1:-}" in
setup)
  log "setup: unpack"
  cp .whl/* "$W/whl/" && mkdir -p "$W/bin" && cp .device-lead/bin/lily .device-lead/bin/lily-bench "$W/bin/"
  mkdir -p "$W/llama" && tar -C "$W/llama" -xJf "$W/whl/llama-src.tar.xz"
  # Two builds in their own sessions, so they outlive this call: llama-quantize without CUDA (2.5
  # minutes; it needs no GPU, and the CUDA libllama it would otherwise link waits for the whole
  # ggml-cuda build), and llama-bench with CUDA (under 10 minutes on the 16 cores they share).
  log "setup: llama.cpp builds (detached)"
  detach llama-cpu-build "cd $W/llama/llama.cpp && cmake -B build-cpu -DGGML_CUDA=OFF $LLAMA_CMAKE \
    && cmake --build build-cpu -j8 --target llama-quantize"
  detach llama-cuda-build "cd $W/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc $LLAMA_CMAKE && cmake --build build -j16 --target llama-bench"
  log "setup: synthetic 35b-a3b checkpoint"
  [ -f "$CK/config.json" ] || "$W/bin/lily" synth --preset 35b-a3b --out "$CK" > /dev/null || exit 1
  log "setup: Q4_0 GGUF"
  [ -f "$W/m-Q4_0.gguf" ] || gguf_py bench/write_gguf.py --model "$CK" --out "$W/m-Q4_0.gguf" --outtype q4_0 || exit 1
  ls -la "$W/m-Q4_0.gguf"; df -h /root | tail -1
  # Q4_K_M by llama-quantize from the Q4_0 file (the weights are random; the types, hence the speed,
  # are a real Q4_K_M's), detached too; `wait quantize-km` waits for it.
  wait_rc llama-cpu-build 300 || { tail -20 "$W/llama-cpu-build.log"; exit 1; }
  [ -f "$W/m-Q4_K_M.gguf" ] || detach quantize-km "$W/llama/llama.cpp/build-cpu/bin/llama-quantize --allow-requantize \
    $W/m-Q4_0.gguf $W/m-Q4_K_M.gguf.part Q4_K_M 16 && mv $W/m-Q4_K_M.gguf.part $W/m-Q4_K_M.gguf"
  log "setup: done (the CUDA build and the Q4_K_M quantization go on)"
  ;;
batched-start)
  # The batched-decode peer (issue 14): unpack llama.cpp (carry .whl/llama-src.tar.xz) and build
  # llama-batched-bench with CUDA, detached (about 10 minutes on the 16 cores; it goes on while
  # the same call runs Lily's arms); then `batched-gguf` and, back to back, `batched`.
  mkdir -p "$W/llama" && tar -C "$W/llama" -xJf .whl/llama-src.tar.xz || exit 1
  detach llama-batched-build "cd $W/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc $LLAMA_CMAKE && cmake --build build -j16 --target llama-batched-bench"
  log "batched-start: build detached"
  ;;
batched-prebuilt)
  # The batched-decode peer built beforehand on a machine without a GPU (bench/build_llama_batched.sh;
  # carry .whl/llama-bin.tar.xz, and .whl/llama-src.tar.xz or just its gguf-py in .whl/gguf-py.tar.xz
  # for batched-gguf): no build on this machine, so `batched` finds the binary and the build's
  # status at once.
  mkdir -p "$W/llama"
  if [ -f .whl/llama-src.tar.xz ]; then tar -C "$W/llama" -xJf .whl/llama-src.tar.xz || exit 1
  else tar -C "$W/llama" -xJf .whl/gguf-py.tar.xz || exit 1; fi
  mkdir -p "$W/llama/llama.cpp/build" && tar -C "$W/llama/llama.cpp/build" -xJf .whl/llama-bin.tar.xz --strip-components=1 || exit 1
  # The build's status is whether the binary starts here (it needs this machine's glibc and
  # CUDA libraries): `batched` then reports the loader's message from the build log.
  if "$W/llama/llama.cpp/build/bin/llama-batched-bench" --version > "$W/llama-batched-build.log" 2>&1; then
    echo 0 > "$W/llama-batched-build.rc"
  else
    echo 1 > "$W/llama-batched-build.rc"
  fi
  tail -2 "$W/llama-batched-build.log"
  log "batched-prebuilt: unpacked, rc=$(cat "$W/llama-batched-build.rc")"
  ;;
batched-gguf)
  # The Q4_0 GGUF of the synthetic 35B at $CK (written by scripts/device_check.sh or `setup`).
  # Written beside and renamed, so a call cut short leaves no partial file to be taken for done.
  [ -f "$W/m-Q4_0.gguf" ] || { gguf_py bench/write_gguf.py --model "$CK" --out "$W/m-Q4_0.gguf.part" --outtype q4_0 \
    && mv "$W/m-Q4_0.gguf.part" "$W/m-Q4_0.gguf"; } || exit 1
  ls -la "$W/m-Q4_0.gguf"
  ;;
batched)
  # batched [SECONDS]: wait for the build, then llama-batched-bench as the issue measures it (700-token
  # prompts, 128 tokens decoded, flash attention on, all layers on the GPU) at 1/4/16/32/64
  # parallel sequences; JSON lines and the table into $OUT.
  wait_rc llama-batched-build "${2:-540}" || { tail -20 "$W/llama-batched-build.log"; exit 1; }
  mkdir -p "${OUT:-$RES}"
  for fmt in jsonl md; do
    "$W/llama/llama.cpp/build/bin/llama-batched-bench" -m "$W/m-Q4_0.gguf" -c 65536 -b 2048 -ub 512 \
      -npp 700 -ntg 128 -npl 1,4,16,32,64 -fa on -ngl 99 --output-format $fmt \
      > "${OUT:-$RES}/llama-batched.$fmt" 2> "${OUT:-$RES}/llama-batched-$fmt.log" || { tail -20 "${OUT:-$RES}/llama-batched-$fmt.log"; exit 1; }
    [ "$fmt" = jsonl ] && [ "${BATCHED_MD:-0}" != 1 ] && break
  done
  grep -h '^{' "${OUT:-$RES}/llama-batched.jsonl" "${OUT:-$RES}/llama-batched-jsonl.log" || tail -5 "${OUT:-$RES}/llama-batched-jsonl.log"
  ;;
batched-pp)
  # batched-pp [UBATCHES]: llama.cpp's prompt processing as issue 17 compares it (one sequence,
  # 4,096 / 8,192 / 32,768-token prompts, flash attention on, all layers on the GPU, logical batch
  # 4,096), once per physical batch size (default 4096 and 512: the faster is llama.cpp's
  # figure); JSON lines into $OUT/llama-pp-ubN.jsonl. Needs the build and the GGUF (batched-gguf).
  mkdir -p "${OUT:-$RES}"
  for ub in ${2:-4096 512}; do
    "$W/llama/llama.cpp/build/bin/llama-batched-bench" -m "$W/m-Q4_0.gguf" -c 33000 -b 4096 -ub "$ub" \
      -npp 4096,8192,32768 -ntg 1 -npl 1 -fa on -ngl 99 --output-format jsonl \
      > "${OUT:-$RES}/llama-pp-ub$ub.jsonl" 2> "${OUT:-$RES}/llama-pp-ub$ub.log" || { tail -5 "${OUT:-$RES}/llama-pp-ub$ub.log"; exit 1; }
    log "batched-pp: ubatch $ub"; cat "${OUT:-$RES}/llama-pp-ub$ub.jsonl"
  done
  ;;
wait)
  # wait JOB [SECONDS]: until a detached job (llama-cuda-build, quantize-km, ...) has ended.
  wait_rc "$2" "${3:-540}"; rc=$?; tail -3 "$W/$2.log"; exit $rc
  ;;
mlx)
  log "mlx: assemble mlx-cuda-13 and install"
  cp .whl-b/* "$W/whl/"
  cat "$W"/whl/mlxcuda.part.* > "$W/whl/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" \
    "$W"/whl/mlx-0.32.4-*.whl "$W"/whl/mlx_cuda_13-0.32.4-*.whl "$W"/whl/mlx_lm-0.32.2-*.whl || exit 1
  # A python for the MLX arm: the system one with the wheels on its path and the CUDA libraries found.
  cat > "$W/mlxpy" <<EOF
#!/usr/bin/env bash
export PYTHONPATH=$W/site\${PYTHONPATH:+:\$PYTHONPATH}
export LD_LIBRARY_PATH=$(nvidia_libs):\${LD_LIBRARY_PATH:-}
exec python3 "\$@"
EOF
  chmod +x "$W/mlxpy"
  "$W/mlxpy" -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device(), mx.array([1.0, 2.0]).sum().item())"
  ;;
ck)
  # Light alternative to `setup` when only the MLX-LM arm is wanted: carry .whl and .device-lead (lily).
  log "ck: stash wheels, synthetic 35b-a3b checkpoint"
  cp .whl/* "$W/whl/" && mkdir -p "$W/bin" && cp .device-lead/bin/lily "$W/bin/"
  [ -f "$CK/config.json" ] || "$W/bin/lily" synth --preset 35b-a3b --out "$CK" > /dev/null || exit 1
  # MLX's JIT caches from an earlier run (mlx-arms leaves them in $OUT): skips its ~4 min compile.
  if [ -f "$W/whl/mlx-jit-cache.tgz" ]; then tar -C / -xzf "$W/whl/mlx-jit-cache.tgz" && log "ck: MLX JIT cache restored"; fi
  log "ck: done"
  ;;
mlx-arms)
  # After `ck` (back to back, carry .whl-b): install MLX, then until DEADLINE seconds have passed,
  # MLX-LM at CONTEXTS (2 rounds each, one process per arm) and its teacher-forced logits.
  # Results: mlx-lm.jsonl, mlx-logits.json, mlx.log, mlx-jit-cache.tgz in $MLX_OUT (default $OUT).
  MO=${MLX_OUT:-$OUT}; mkdir -p "$MO"
  start=$(date +%s); deadline=${DEADLINE:-540}
  left() { echo $(( deadline - ($(date +%s) - start) )); }
  bash "$0" mlx > "$MO/mlx.log" 2>&1 || { tail -20 "$MO/mlx.log"; exit 1; }
  tail -1 "$MO/mlx.log"
  export MLX_PTX_CACHE_DIR=$W/ptx-cache
  for c in ${CONTEXTS:-4096 256}; do
    for r in 1 2; do
      t=$(left); [ "$t" -gt 30 ] || break 2
      log "mlx-lm $c round $r (limit ${t}s)"
      timeout "$t" "$W/mlxpy" bench/mlx_arm.py --model "$CK" --prompt-len "$c" --decode-steps 64 \
        >> "$MO/mlx-lm.jsonl" 2>> "$MO/mlx.log"; echo "rc=$?"
    done
    if [ "$c" = 4096 ] && [ "$(left)" -gt 30 ]; then
      log "mlx-lm logits (limit $(left)s)"
      timeout "$(left)" "$W/mlxpy" scripts/mlx_logits.py --model "$CK" --positions 192 --out "$MO/mlx-logits.json" \
        >> "$MO/mlx.log" 2>&1; echo "rc=$?"
    fi
  done
  # The JIT caches (MLX's PTX, the driver's SASS) for the next session: carry the archive in .whl.
  tar -C / -czf "$MO/mlx-jit-cache.tgz" "${W#/}/ptx-cache" root/.nv/ComputeCache 2>/dev/null
  ls -la "$MO/mlx-jit-cache.tgz" 2>/dev/null
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print(d["prompt_len"], round(d["prefill"]["tok_s"],1), round(d["decode"]["tok_s"],2), d["decode"]["token_digest"])' "$MO/mlx-lm.jsonl"
  ;;
mlx-detach)
  # After `ck` (back to back, carry .whl-b): mlx-arms in its own session, so that one context's
  # two rounds (32K: ~10 minutes) need not fit one call. Results gather in $W/mlx-out; later calls
  # run `wait mlx-arms SECONDS`, and `out` brings them back. DEADLINE defaults to 1500 s here.
  rm -rf "$W/mlx-out"; mkdir -p "$W/mlx-out"
  detach mlx-arms "MLX_OUT=$W/mlx-out DEADLINE=${DEADLINE:-1500} CONTEXTS='${CONTEXTS:-1024 16384 32768}' bash $0 mlx-arms"
  log "mlx-arms detached (log: $W/mlx-arms.log)"
  ;;
tf-determinism)
  # Why transformers' bf16 greedy tokens differ between rounds, and which attention kernel repeats:
  # scripts/tf_determinism.py (trace in $OUT); its last line, the arm arguments of the first
  # variant that repeats, goes to $W/tf-args for tf-arms.
  timeout "${TF_LIMIT:-300}" python3 scripts/tf_determinism.py --model "$CK" --out "$OUT/tf-det.json" --prompt-len 256 \
    --steps 64 --variants "${TF_VARIANTS:-sdpa-flash,sdpa-efficient,sdpa-math,eager}" --pick 2>&1 \
    | grep -v "Warning\|falling back" | tee "$W/tf-determinism.log"
  tail -1 "$W/tf-determinism.log" | grep -q -- "--attn" && tail -1 "$W/tf-determinism.log" > "$W/tf-args"
  ;;
tf-arms)
  # The transformers arm with the arguments tf-determinism found repeating; none: no run.
  [ -s "$W/tf-args" ] || { echo "no repeating transformers variant: transformers not run"; exit 1; }
  shift; matrix --engines transformers --tf-args="$(cat "$W/tf-args")" --no-accuracy "$@"
  ;;
matrix)
  shift; matrix "$@"
  ;;
out)
  # $OUT takes at most 8 files: the results folder travels as one archive (a session that has both
  # the llama.cpp logs and the MLX-LM files may leave a log behind: `files_left_out` says which).
  tar -C "$W/results" -czf "$OUT/results-$DAY.tgz" "$DAY"
  cp docs/benchmarks-peers.md "$OUT/" 2>/dev/null
  for j in llama-cpu-build llama-cuda-build quantize-km mlx-arms; do
    [ -f "$W/$j.log" ] && tail -c 100000 "$W/$j.log" > "$OUT/$j.log"
  done
  [ -d "$W/mlx-out" ] && cp "$W"/mlx-out/* "$OUT/" 2>/dev/null
  ls -la "$RES"
  ;;
*) echo "usage: bash bench/h200_steps.sh setup|wait JOB [SECONDS]|ck|mlx|mlx-arms|mlx-detach|tf-determinism|tf-arms [run_all args]|matrix [run_all args]|out" >&2; exit 2 ;;
esac
