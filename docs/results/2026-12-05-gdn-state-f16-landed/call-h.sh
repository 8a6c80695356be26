set -u
# The serving load test (ROUNDS=2) on main + gdn-state-f16-default.patch (f16 states by default):
# issue 15's table; then route-rows-2.patch on top of it (rr2) against it at 16 and 4 rows.
# Carry [".device-ld", ".whl"]: .device-ld/bin/{lily,lily-bench} from the f16 build,
# lily-bench-rr2 from the same build + route-rows-2.patch. ~8 min.
export OUT=${OUT:-/tmp/out} LILY_CK=/root/ck
bash scripts/device_unpack.sh .device-ld
[ -f "$LILY_CK/config.json" ] || ./.device-ld/bin/lily synth --preset 35b-a3b --out "$LILY_CK" > /tmp/synth.log 2>&1
LILY=.device-ld/bin/lily CK=$LILY_CK ROUNDS=2 bash bench/h200_serve.sh load 2>&1 | tail -14
SKIP_TESTS=1 bash scripts/device_check.sh docs/results/2026-12-05-gdn-state-f16-landed/arms-h.txt 2>&1 | tail -8
python3 scripts/call_summary.py "$OUT" --base f16
bash scripts/out_bundle.sh
