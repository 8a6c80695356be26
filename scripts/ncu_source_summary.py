#!/usr/bin/env python3
"""ncu_source_summary: where a kernel's warps wait, per SASS instruction, from Nsight Compute's
source page (scripts/call_lib.sh call_ncu_source: `ncu -i REP --page source --csv --print-source
sass`, optionally xz-compressed).

Prints the stall samples by reason over the whole kernel, by opcode, and the instructions that
hold the most samples (address, instruction, samples, top reasons), so a kernel bound by its
instruction stream shows which instructions and which waits its time goes to.

Usage: scripts/ncu_source_summary.py FILE.csv[.xz] [--top N] [--range LO HI] [--launch I]
  --range: only instructions at addresses LO..HI (hex offsets into the kernel, e.g. one loop).
"""
import argparse
import collections
import csv
import io
import lzma
import sys


def blocks(path):
    """The page's launches: (kernel name, rows) each (a "Kernel Name" line, then a header)."""
    raw = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
    out, name, cur = [], None, []
    for line in raw.read().splitlines() + ['"Kernel Name",""']:
        if line.startswith('"Kernel Name"'):
            if cur:
                out.append((name, list(csv.DictReader(io.StringIO("\n".join(cur))))))
            name, cur = next(csv.reader([line]))[1], []
        else:
            cur.append(line)
    return out


def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--range", nargs=2, default=None)
    ap.add_argument("--launch", type=int, default=0, help="which launch of the page (0: the first)")
    a = ap.parse_args()
    bs = blocks(a.file)
    print("launches: " + ", ".join(n for n, _ in bs))
    rs = bs[a.launch][1]
    if not rs:
        sys.exit("no rows")
    base = int(rs[0]["Address"], 16)
    for r in rs:
        r["off"] = int(r["Address"], 16) - base
    if a.range:
        lo, hi = (int(x, 16) for x in a.range)
        rs = [r for r in rs if lo <= r["off"] <= hi]
    reasons = [k for k in rs[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rs)
    inst = sum(num(r["Instructions Executed"]) for r in rs)
    print(f"{len(rs)} instructions, {total:.0f} samples, {inst:.0f} warp instructions executed")
    by_reason = collections.Counter()
    for r in rs:
        for k in reasons:
            by_reason[k[6:]] += num(r[k])
    print("reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(10) if v))
    by_op = collections.Counter()
    by_op_inst = collections.Counter()
    for r in rs:
        op = r["Source"].split()[0] if r["Source"].split() else "?"
        if op.startswith("@"):
            op = r["Source"].split()[1]
        op = op.split(".")[0]
        by_op[op] += num(r["Warp Stall Sampling (All Samples)"])
        by_op_inst[op] += num(r["Instructions Executed"])
    print("opcodes (samples %, warp instructions %):")
    for op, v in by_op.most_common(16):
        print(f"  {op:12s} {100 * v / total:5.1f}%  {100 * by_op_inst[op] / max(inst, 1):5.1f}%")
    print(f"top {a.top} instructions:")
    for r in sorted(rs, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[: a.top]:
        s = num(r["Warp Stall Sampling (All Samples)"])
        top = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        why = ", ".join(f"{k} {v:.0f}" for v, k in top if v)
        print(f"  {r['off']:#07x} {100 * s / total:5.1f}%  {r['Source'].strip()[:60]:60s} {why}")


if __name__ == "__main__":
    main()
