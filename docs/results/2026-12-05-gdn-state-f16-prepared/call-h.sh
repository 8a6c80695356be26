set -u
# The serving load test (ROUNDS=2) on main + gdn-state-f16-default.patch (f16 states by default):
# issue 15's table. Carry [".device-gs", ".whl"]. ~5 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_unpack.sh .device-gs
[ -f "$LILY_CK/config.json" ] || ./.device-gs/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
LILY=.device-gs/bin/lily CK=$LILY_CK ROUNDS=2 bash bench/h200_serve.sh load 2>&1 | tail -14
python3 scripts/call_summary.py "$OUT"
bash scripts/out_bundle.sh
