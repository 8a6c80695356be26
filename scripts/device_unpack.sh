#!/usr/bin/env bash
# On the GPU machine, from the repository root: decompresses what scripts/device_pack.sh
# xz-compressed in .device/ (or in the folder given, e.g. a prepared call's own .device-gs/;
# python's lzma: no xz binary needed there). Safe to run twice.
DIR=${1:-.device} python3 - <<'PY'
import glob, lzma, os
for f in glob.glob(os.environ['DIR'] + '/**/*.xz', recursive=True):
    out = f[:-3]
    if not os.path.exists(out):
        with lzma.open(f) as src, open(out, 'wb') as dst:
            dst.write(src.read())
        os.chmod(out, 0o755)
PY
