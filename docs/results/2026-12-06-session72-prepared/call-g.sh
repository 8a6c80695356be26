set -u
# Call G (prepared in session 72, not run): issue 15's table on main (2d6420d's code) and the one
# thing session 72's 64-client runs pointed at, on one H200 in one call (~300 s):
# 1. the load test with main's lily at 1 / 4 / 16 / 64 clients (ROUNDS=2, 16 client processes,
#    700-token text prompts, 128 out, greedy and sampled): the landed build's table (session
#    72's table ran the ring GEMV sets at 64 rows too, -1.3% in lily-bench);
# 2. the 64-client level twice more each, alternating, with main and with `burst` (main with
#    BURST_PREFILL_CHUNK 32768, burst-32k.patch): session 72 saw +1.5% greedy / +2% sampled with
#    `--prefill-chunk 32768`, which also sets the turns that run while rows decode;
# 3. llama-batched-bench (prebuilt) at 1 / 4 / 16 / 32 / 64 sequences in the same call.
# build-g.sh builds the carry:
# [".device-lilymain", ".device-lilyburst", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz"].
export OUT=${OUT:-/tmp/out} LILY_CACHE_DIR=/tmp/lilycache PYTHONUNBUFFERED=1 CARGO_MANIFEST_DIR=$PWD
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT" /root/pb
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
CK=/root/ck
for a in lilymain lilyburst; do bash scripts/device_unpack.sh .device-$a >/dev/null 2>&1; done
nvidia-smi --query-gpu=name --format=csv,noheader
bash bench/h200_steps.sh batched-prebuilt 2>&1 | tail -1
[ -f $CK/config.json ] || ./.device-lilymain/bin/lily synth --preset 35b-a3b --out $CK > /tmp/synth.log 2>&1
el "synth rc=$?"
load() {  # label lily levels extra-serve-args
  mkdir -p "$OUT/$1"
  OUT=$OUT/$1 LILY=$2 CK=$CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns ${4:-}" LEVELS=$3 timeout 150 bash bench/h200_serve.sh load 2>&1 \
    | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - - | sed "s/^/$1 /"
}
load main-all .device-lilymain/bin/lily 1,4,16,64
el "main table"
for r in 1 2; do
  load burst-64-r$r .device-lilyburst/bin/lily 64
  load main-64-r$r .device-lilymain/bin/lily 64
done
el "burst A/B"
# The GGUF after the timed runs (it loads the GPU), then the peer.
timeout 150 bash bench/h200_steps.sh batched-gguf > /root/pb/gguf.log 2>&1; el "gguf rc=$?"
mkdir -p "$OUT/llama"
OUT=$OUT/llama timeout 120 bash bench/h200_steps.sh batched 5 2>&1 | tail -6
el llama-batched-bench
bash scripts/out_bundle.sh
