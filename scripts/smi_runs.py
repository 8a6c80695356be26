#!/usr/bin/env python3
"""The GPU's clocks and power over each run of a device call: `nvidia-smi --query-gpu=timestamp,
clocks.sm,clocks.mem,power.draw,temperature.gpu[,temperature.memory] --format=csv,noheader -lms 20`
samples (SMI, plain or .xz) against RUNS (a line `HH:MM:SS.nnnnnnnnn LABEL` as each run
started, as docs/results/2026-12-07-session88/call-d.sh writes them). Per run: the SM clock
(median, min), power (median, max) and, where sampled, the HBM's temperature (max) over the
run, and over its last LAST seconds (where a lily-bench run's measured prefill and decode are;
its start is the model's loading).

    python3 scripts/smi_runs.py smi.csv.xz runs.txt [--last 1.0]
"""
import argparse
import lzma
import statistics


def seconds(hms: str) -> float:
    h, m, s = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def samples(path: str):
    opener = lzma.open if path.endswith(".xz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 4:
                continue
            try:
                t = seconds(parts[0].split(" ")[-1])  # "YYYY/MM/DD HH:MM:SS.fff"
                sm = float(parts[1].split()[0])
                power = float(parts[3].split()[0])
            except ValueError:
                continue
            try:
                hbm = float(parts[5].split()[0])
            except (IndexError, ValueError):  # not sampled, or N/A
                hbm = None
            out.append((t, sm, power, hbm))
    return out


def summary(rows) -> str:
    if not rows:
        return "no samples"
    sm = [r[1] for r in rows]
    pw = [r[2] for r in rows]
    hbm = [r[3] for r in rows if r[3] is not None]
    temp = f", HBM max {max(hbm):.0f} C" if hbm else ""
    return f"SM {statistics.median(sm):.0f} MHz (min {min(sm):.0f}), power {statistics.median(pw):.0f} W (max {max(pw):.0f}){temp}, {len(rows)} samples"


def report(smi: str, runs_path: str, last: float) -> list:
    """One line per run: its window (to the next run's start, the last one's to the last sample)."""
    rows = samples(smi)
    runs = []
    with open(runs_path) as f:
        for line in f:
            if line.strip():
                hms, label = line.strip().split(" ", 1)
                runs.append((seconds(hms), label))
    out = []
    for i, (t0, label) in enumerate(runs):
        t1 = runs[i + 1][0] if i + 1 < len(runs) else (rows[-1][0] + 1e-6 if rows else t0)
        window = [r for r in rows if t0 <= r[0] < t1]
        tail = [r for r in window if r[0] >= t1 - last]
        out.append(f"{label:<22} {t1 - t0:5.1f} s | all: {summary(window)} | last {last:g} s: {summary(tail)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("smi")
    ap.add_argument("runs")
    ap.add_argument("--last", type=float, default=1.0, help="seconds at the end of each run summarised apart")
    args = ap.parse_args()
    print("\n".join(report(args.smi, args.runs, args.last)))


if __name__ == "__main__":
    main()
