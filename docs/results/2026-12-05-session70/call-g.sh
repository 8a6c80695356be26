set -u
# Call G (session 70): issue 15's load test on the final main (70a535d, every landing) at 1, 4, 16
# and 64 clients, ROUNDS=2, 16 client processes, greedy and sampled, text prompts.
export LILY_CK=/root/ck PYTHONUNBUFFERED=1
bash scripts/device_unpack.sh .device-final >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
(./.device-final/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1)
mkdir -p "$OUT/final"
OUT=$OUT/final LILY=.device-final/bin/lily CK=$LILY_CK ROUNDS=2 CLIENT_PROCS=16 SERVE_ARGS="--trace-turns" timeout 400 bash bench/h200_serve.sh load 2>&1 | grep -o '"mode": "[a-z]*"\|"concurrency": [0-9]*\|"aggregate_tok_s": [0-9.]*' | paste - - -
bash scripts/out_bundle.sh
