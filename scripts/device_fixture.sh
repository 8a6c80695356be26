#!/usr/bin/env bash
# The CUDA rows of the fixture's accuracy table (docs/correctness.md, "Trained fixture"; issue 21),
# on the GPU machine. Run from the repository root after device-pack (carry .device):
#   bash scripts/device_fixture.sh [CHUNKS]          (default 8 chunks of 512 tokens, as the table)
#
# 1. the fixture's 4-bit checkpoint (tests/fixtures/qwen-fixture/mlx, as committed) plus the
#    tokenizer files `lily synth` writes (they are generated, not committed);
# 2. the reference: transformers float32 on its dequantized weights (CPU), saved as a lily
#    log-probability file (scripts/fixture_reference.py --paths reference);
# 3. each Lily CUDA path scored on the same chunks with --kl-against the reference, one line each:
#    default (bf16 tensor-core prefill, bf16 KV), exact (f32 prefill, f32 KV), and the decode
#    kernels token by token (--decode-forward: every position through the decode step, bf16 KV
#    as in serving, then f32 KV).
# Needs python3 with torch and transformers 5.17 (no mlx, no Rust).
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1
CHUNKS=${1:-8}
W=${OUT:-/tmp/device_fixture}/fixture
mkdir -p "$W"
LILY=./.device/bin/lily
FX=tests/fixtures/qwen-fixture
TEXT=$FX/heldout.txt
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*" >&2; }

rm -rf "$W/mlx" "$W/synth"
cp -r "$FX/mlx" "$W/mlx"
gunzip -f "$W/mlx/model.safetensors.gz"
$LILY synth --preset tiny --out "$W/synth" > /dev/null 2>&1
cp "$W/synth/tokenizer.json" "$W/synth/tokenizer_config.json" "$W/synth/chat_template.jinja" "$W/mlx/"
$LILY info --model "$W/mlx" > /dev/null

if [ ! -f "$W/ref.logp" ]; then
  python3 scripts/fixture_reference.py --mlx "$W/mlx" --file "$TEXT" --ctx 512 --chunks "$CHUNKS" \
    --paths reference --save "$W/ref.logp" 2>> "$W/log"
  el "reference"
fi

row() {
  local label=$1; shift
  local line
  line=$($LILY perplexity --model "$W/mlx" --file "$TEXT" --ctx 512 --chunks "$CHUNKS" --kl-against "$W/ref.logp" "$@" 2>> "$W/log")
  python3 -c 'import json,sys
d = json.loads(sys.argv[2]); a = d["against"]
print("%s: PPL %.4f +/- %.4f (%d tokens, %s, kv %s); KL mean %.3e +/- %.1e, p99 %.3e, max %.3e; top-1 %.2f%%; max |d log p| %.4f" % (
    sys.argv[1], d["ppl"], d["ppl_stderr"], d["tokens_scored"], d["backend"], d["kv_cache"], a["mean_kl"], a["kl_stderr"],
    a["p99_kl"], a["max_kl"], 100 * a["top1_agreement"], a["max_true_logprob_delta"]))' "$label" "$line"
  echo "$label $line" >> "$W/rows.jsonl"
}
row "Lily CUDA default" --backend cuda
row "Lily CUDA exact (--exact-prefill --kv-cache f32)" --backend cuda --exact-prefill --kv-cache f32
row "Lily CUDA decode path (--decode-forward, bf16 KV)" --backend cuda --decode-forward
row "Lily CUDA decode path (--decode-forward --kv-cache f32)" --backend cuda --decode-forward --kv-cache f32
row "Lily CPU (same machine)" --backend cpu
el "done"
