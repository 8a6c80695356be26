set -u
# The second prepared call of the f16 GDN states (after call-c.sh, on the same warm machine or a
# fresh one): the serving load test with the f16 states (ROUNDS=2; compare with
# docs/results/2026-12-05-router-split-gdn-cluster/call2-serve_load.jsonl, f32 states, the same
# code otherwise). Carry [".device-gs", ".whl"]. ~4 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_unpack.sh .device-gs
[ -f "$LILY_CK/config.json" ] || ./.device-gs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1  # a fresh machine
LILY_GDN_STATE=f16 LILY=.device-gs/bin/lily CK=$LILY_CK ROUNDS=2 bash bench/h200_serve.sh load 2>&1 | tail -12
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh
