set -u
# The serving load test (ROUNDS=2) on main + the f16 GDN states as the default (landing form) +
# the one-launch sampler (sampler-small-k-after-f16.patch). Carry [".device-ld", ".whl"].
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_unpack.sh .device-ld
[ -f "$LILY_CK/config.json" ] || ./.device-ld/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
LILY=.device-ld/bin/lily CK=$LILY_CK ROUNDS=2 bash bench/h200_serve.sh load 2>&1 | tail -14
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh
