#!/usr/bin/env python3
"""Per-kernel summary of an Nsight Compute CSV (`ncu --csv --page raw ...`), as used for the decode
and prefill profiles in docs/cuda.md ("Decode round 3").

    python3 scripts/ncu_summary.py ncu.csv            # one row per (kernel, grid, block, registers)
    python3 scripts/ncu_summary.py ncu.csv --stalls   # + the top stall reasons (needs --set full)

Rows are grouped by kernel name and launch shape (the same kernel at different grids is a different
matrix set); each row gives the launch count, the mean time, the share of the total, DRAM bytes read
per launch and the achieved read bandwidth. Metrics that the CSV lacks are left out, so a CSV taken
with only `--metrics gpu__time_duration.sum` still summarises.
"""
import argparse
import csv
import sys

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
INST = "smsp__inst_executed.sum"
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_rows(path):
    """(header, unit row, data rows) of the raw page; ncu prints its own log lines before the header."""
    rows = [r for r in csv.reader(open(path, newline="")) if r]
    starts = [i for i, r in enumerate(rows) if "Kernel Name" in r]
    if not starts:
        raise SystemExit(f"{path}: no 'Kernel Name' header (was it written with --csv --page raw?)")
    i = starts[0]
    return rows[i], rows[i + 1], rows[i + 2:]


def summarize(header, units, data, stalls=False, top=5):
    col = {k: header.index(k) for k in header}
    scale = 1.0
    if TIME in col:
        unit = units[col[TIME]].strip().lower()
        scale = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1.0)

    def get(r, k):
        return number(r[col[k]]) if k in col and col[k] < len(r) else None

    groups = {}
    for r in data:
        if col["Kernel Name"] >= len(r):
            continue
        key = (r[col["Kernel Name"]],) + tuple(r[col[k]] if k in col else "?" for k in
                                              ("launch__grid_size", "launch__block_size", "launch__registers_per_thread"))
        g = groups.setdefault(key, {"n": 0, "time": 0.0, "read": 0.0, "inst": 0.0, "stalls": {}})
        g["n"] += 1
        g["time"] += (get(r, TIME) or 0.0) * scale
        g["read"] += get(r, READ) or 0.0
        g["inst"] += get(r, INST) or 0.0
        for k in col:
            if stalls and k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX):
                name = k[len(STALL_PREFIX):-len(STALL_SUFFIX)]
                g["stalls"][name] = g["stalls"].get(name, 0.0) + (get(r, k) or 0.0)
    total = sum(g["time"] for g in groups.values()) or 1.0
    out = []
    for key, g in sorted(groups.items(), key=lambda kv: -kv[1]["time"]):
        n = g["n"]
        t = g["time"] / n
        row = {"kernel": key[0], "grid": key[1], "block": key[2], "regs": key[3], "launches": n,
               "mean_ns": t, "share": g["time"] / total, "read_bytes": g["read"] / n,
               "read_tb_s": (g["read"] / n) / t / 1e3 if t else 0.0, "inst": g["inst"] / n}
        if stalls:
            row["stalls"] = sorted(((k, v / n) for k, v in g["stalls"].items()), key=lambda kv: -kv[1])[:top]
        out.append(row)
    return out, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--stalls", action="store_true", help="top stall reasons per row (ncu --set full)")
    args = ap.parse_args()
    header, units, data = read_rows(args.csv)
    rows, total = summarize(header, units, data, args.stalls)
    print(f"{'kernel':30s} {'grid':>7s} {'block':>5s} {'regs':>4s} {'n':>4s} {'mean us':>9s} {'share':>6s} "
          f"{'read/launch':>12s} {'TB/s':>5s} {'warp inst':>10s}")
    for r in rows:
        line = (f"{r['kernel'][:30]:30s} {r['grid']:>7s} {r['block']:>5s} {r['regs']:>4s} {r['launches']:4d} "
                f"{r['mean_ns'] / 1e3:9.2f} {100 * r['share']:5.1f}% {r['read_bytes']:12,.0f} {r['read_tb_s']:5.2f} "
                f"{r['inst']:10,.0f}")
        if args.stalls and r["stalls"]:
            line += "  " + ", ".join(f"{k}={v:.2f}" for k, v in r["stalls"])
        print(line)
    print(f"total {total / 1e3:,.1f} us over {sum(r['launches'] for r in rows)} launches")


if __name__ == "__main__":
    sys.exit(main())
