#!/usr/bin/env python3
"""The turns of a `lily serve --trace-turns` log, one line each: the gap since the previous turn
ended (the worker idle, e.g. waiting for clients), admissions, the prefill's tokens / prompts / ms
with the snapshots' part, the decode's rows / tokens / ms, retirements.

    python3 scripts/turn_summary.py serve.log [FROM_S TO_S]     # seconds since the server started
"""
import re, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"lily: turn \+([\d.]+)s(.*)", line.strip())
    if not m: continue
    t = float(m.group(1)); rest = m.group(2)
    d = {"at": t}
    for k, pat in [("admit", r"admit (\d+) in ([\d.]+) ms"), ("prefill", r"prefill (\d+) tokens, (\d+) prompts in, ([\d.]+) ms \(snapshots ([\d.]+)\)"),
                   ("decode", r"decode (\d+) rows, (\d+) tokens in ([\d.]+) ms"), ("retired", r"retired (\d+)")]:
        mm = re.search(pat, rest)
        if mm: d[k] = tuple(float(x) for x in mm.groups())
    rows.append(d)
lo = float(sys.argv[2]) if len(sys.argv) > 2 else 0; hi = float(sys.argv[3]) if len(sys.argv) > 3 else 1e9
prev_end = None
for d in rows:
    if not (lo <= d["at"] <= hi): continue
    busy = sum(d[k][-1] if k != "prefill" else d[k][2] for k in ("prefill", "decode") if k in d) + (d["admit"][1] if "admit" in d else 0)
    gap = (d["at"] - prev_end) * 1e3 if prev_end is not None else 0
    prev_end = d["at"] + busy / 1e3
    parts = [f"{d['at']:9.3f} gap {gap:6.1f}"]
    if "admit" in d: parts.append(f"adm {int(d['admit'][0]):3d}")
    if "prefill" in d: parts.append(f"pf {int(d['prefill'][0]):6d}t/{int(d['prefill'][1]):2d}p {d['prefill'][2]:6.1f}ms (snap {d['prefill'][3]:.1f})")
    if "decode" in d: parts.append(f"dec {int(d['decode'][0]):3d}r {int(d['decode'][1]):5d}t {d['decode'][2]:6.1f}ms")
    if "retired" in d: parts.append(f"ret {int(d['retired'][0])}")
    print(" | ".join(parts))
