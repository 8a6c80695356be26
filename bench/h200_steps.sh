#!/usr/bin/env bash
# The peer benchmark on one GPU machine (H200), in steps that each fit one 10-minute device call.
# Everything persistent lives under $W (/root/pb) and /root/ck, which survive between calls only
# while the machine stays warm: make the calls back to back. See bench/README.md for what each
# step carries. Run from the repository root on the GPU machine:
#
#   bash bench/h200_steps.sh setup      carry .whl (mlx part aa, mlx + mlx-lm wheels, llama-src) and .device-lead
#                                       (lily, lily-bench): llama.cpp CUDA build, 35B checkpoint, Q4_0 GGUF,
#                                       then the llama.cpp Q4_0 arm
#   bash bench/h200_steps.sh mlx        carry .whl-b (mlx parts ab, ac): MLX-LM venv, then MLX-LM + transformers arms
#   bash bench/h200_steps.sh matrix ... run_all.py with every arm found, extra arguments passed on
#   bash bench/h200_steps.sh out        copy results + doc to $OUT
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

matrix() {
  local engines="lily" extra=()
  [ -x "$W/bin/lily-bench" ] || { echo "no lily binaries in $W/bin" >&2; return 1; }
  extra+=(--lily-bench "$W/bin/lily-bench" --lily "$W/bin/lily" --lily-backend cuda)
  if [ -x "$W/llama/llama.cpp/build/bin/llama-bench" ]; then
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
  log "setup: llama.cpp CUDA build (background)"
  ( cd "$W/llama/llama.cpp" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON \
    && cmake --build build -j16 --target llama-bench llama-quantize ) > "$W/llama-build.log" 2>&1 &
  build=$!
  log "setup: synthetic 35b-a3b checkpoint"
  [ -f "$CK/config.json" ] || "$W/bin/lily" synth --preset 35b-a3b --out "$CK" || exit 1
  log "setup: Q4_0 GGUF"
  [ -f "$W/m-Q4_0.gguf" ] || gguf_py bench/write_gguf.py --model "$CK" --out "$W/m-Q4_0.gguf" --outtype q4_0 || exit 1
  ls -la "$W/m-Q4_0.gguf"; df -h /root | tail -1
  log "setup: waiting for the llama.cpp build"
  wait $build; rc=$?
  tail -5 "$W/llama-build.log"; log "llama.cpp build rc=$rc"
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
  # Results: $OUT/mlx-lm.jsonl, $OUT/mlx-logits.json, $OUT/mlx.log.
  start=$(date +%s); deadline=${DEADLINE:-540}
  left() { echo $(( deadline - ($(date +%s) - start) )); }
  bash "$0" mlx > "$OUT/mlx.log" 2>&1 || { tail -20 "$OUT/mlx.log"; exit 1; }
  tail -1 "$OUT/mlx.log"
  export MLX_PTX_CACHE_DIR=$W/ptx-cache
  for c in ${CONTEXTS:-4096 256}; do
    for r in 1 2; do
      t=$(left); [ "$t" -gt 30 ] || break 2
      log "mlx-lm $c round $r (limit ${t}s)"
      timeout "$t" "$W/mlxpy" bench/mlx_arm.py --model "$CK" --prompt-len "$c" --decode-steps 64 \
        >> "$OUT/mlx-lm.jsonl" 2>> "$OUT/mlx.log"; echo "rc=$?"
    done
    if [ "$c" = 4096 ] && [ "$(left)" -gt 30 ]; then
      log "mlx-lm logits (limit $(left)s)"
      timeout "$(left)" "$W/mlxpy" scripts/mlx_logits.py --model "$CK" --positions 192 --out "$OUT/mlx-logits.json" \
        >> "$OUT/mlx.log" 2>&1; echo "rc=$?"
    fi
  done
  # The JIT caches (MLX's PTX, the driver's SASS) for the next session: carry the archive in .whl.
  tar -C / -czf "$OUT/mlx-jit-cache.tgz" "${W#/}/ptx-cache" root/.nv/ComputeCache 2>/dev/null
  ls -la "$OUT/mlx-jit-cache.tgz" 2>/dev/null
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print(d["prompt_len"], round(d["prefill"]["tok_s"],1), round(d["decode"]["tok_s"],2), d["decode"]["token_digest"])' "$OUT/mlx-lm.jsonl"
  ;;
quantize-km)
  [ -f "$W/m-Q4_K_M.gguf" ] || "$W/llama/llama.cpp/build/bin/llama-quantize" --allow-requantize "$W/m-Q4_0.gguf" "$W/m-Q4_K_M.gguf" Q4_K_M 16 > "$W/quantize.log" 2>&1
  tail -3 "$W/quantize.log"; ls -la "$W"/*.gguf; df -h /root | tail -1
  ;;
matrix)
  shift; matrix "$@"
  ;;
out)
  # $OUT takes at most 8 files: the results folder travels as one archive.
  tar -C "$W/results" -czf "$OUT/results-$DAY.tgz" "$DAY"
  cp docs/benchmarks-peers.md "$OUT/" 2>/dev/null
  tail -c 200000 "$W/llama-build.log" > "$OUT/llama-build.log" 2>/dev/null
  ls -la "$RES"
  ;;
*) echo "usage: bash bench/h200_steps.sh setup|ck|mlx|mlx-arms|quantize-km|matrix [run_all args]|out" >&2; exit 2 ;;
esac
