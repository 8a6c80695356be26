#!/usr/bin/env python3
"""What a device call brought back, in one reading: the GPU test suites' results, each lily-bench
arm beside the base arm of the same shape, the digests that must be equal, the hand-over
microbenchmark's differences between ways, and the serving load test's table.

    python3 scripts/call_summary.py OUT_DIR [--base base] [--same A=B ...] [--step-windows N]

OUT_DIR holds what scripts/device_check.sh and the call scripts wrote: tests-*.log, *ab.jsonl
(lily-bench lines carrying their arm's label as "arm"), handover.jsonl, *serve_load*.jsonl
(bench/serve_load.py, one line per mode and concurrency). An arm "X rest" is set
beside "BASE rest" (e.g. "all b16" beside "base b16"). --same A=B names two arm prefixes whose
digests must be equal on every shape both ran (e.g. --same all=all9: "all b1 4K" against
"all9 b1 4K"); a difference is printed as MISMATCH and makes the exit status 1.
--step-windows N adds, per single-sequence arm, the median decode step (us) over each window of
N steps (`step_wall_secs`): where a decode's steps change speed, and whether a gap between
arms stays or fades.
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys


def tests(out):
    """(suite, passed, failed, failed test names, exit line) per tests-*.log."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "tests-*.log"))):
        text = open(path, errors="replace").read()
        suite = os.path.basename(path)[len("tests-"):-len(".log")]
        passed = sum(int(m) for m in re.findall(r"test result: \w+\. (\d+) passed", text))
        failed = sum(int(m) for m in re.findall(r"(\d+) failed", " ".join(re.findall(r"test result:[^\n]*", text))))
        names = sorted(set(re.findall(r"^test (\S+) \.\.\. FAILED", text, re.M)))
        rc = re.findall(r"^rc=(\d+)", text, re.M)
        rows.append((suite, passed, failed, names, rc[-1] if rc else "?"))
    return rows


def arms(out):
    """{label: lily-bench line} over every *ab.jsonl (later files win a repeated label; the
    smoke runs left out)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "*ab.jsonl"))):
        for line in open(path, errors="replace"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "arm" in d and not d["arm"].startswith("smoke"):
                found[d["arm"]] = d
    return found


def rate(d):
    """The arm's headline decode rate: the batch's aggregate, else the one sequence's."""
    dec = d.get("decode", {})
    return dec.get("aggregate_tok_s") if d.get("batch") else dec.get("tok_s")


def split(label):
    head, _, rest = label.partition(" ")
    return head, rest


def arm_table(found, base):
    lines = ["| arm | prefill tok/s | vs base | decode tok/s | vs base | digest |", "|---|---:|---:|---:|---:|---|"]
    pct = lambda a, b: f"{100.0 * (a / b - 1.0):+.1f}%" if a and b else ""
    for label, d in found.items():
        head, rest = split(label)
        b = found.get(f"{base} {rest}") if head != base else None
        pf, dr = d.get("prefill", {}).get("tok_s"), rate(d)
        bpf, bdr = (b.get("prefill", {}).get("tok_s"), rate(b)) if b else (None, None)
        lines.append(f"| {label} | {pf:,.0f} | {pct(pf, bpf)} | {dr:,.1f} | {pct(dr, bdr)} | {d.get('decode', {}).get('token_digest', '')} |")
    return lines


def step_windows(found, n):
    """Per single-sequence arm with its step times: the median step (us) of each window of n."""
    lines = []
    for label, d in found.items():
        steps = d.get("decode", {}).get("step_wall_secs")
        if d.get("batch") or not steps:
            continue
        meds = [statistics.median(steps[i:i + n]) * 1e6 for i in range(0, len(steps), n)]
        lines.append(f"{label:<28} " + " ".join(f"{m:6.0f}" for m in meds))
    return lines


def digests(d):
    """A run's digests: one per sequence for batches, else the one."""
    dec = d.get("decode", {})
    return dec.get("token_digests") or [dec.get("token_digest")]


def same_checks(found, pairs):
    """(line, ok) per shape both prefixes of each pair ran."""
    out = []
    for a, b in pairs:
        for label, d in found.items():
            head, rest = split(label)
            other = found.get(f"{b} {rest}")
            if head != a or other is None:
                continue
            ok = digests(d) == digests(other)
            out.append((f"{'same' if ok else 'MISMATCH'}: {label} / {b} {rest}", ok))
    return out


def handover(out):
    """Per chain (size, blocks, neighbour): us per phase of each way, and the differences that
    docs/cuda.md reads (launches - persistent, launches - no-wait, persistent - no-wait)."""
    path = os.path.join(out, "handover.jsonl")
    if not os.path.exists(path):
        return []
    chains = {}
    for line in open(path, errors="replace"):
        try:
            h = json.loads(line)["handover"]
        except (ValueError, KeyError, TypeError):
            continue
        key = (h["phase_bytes"], h["blocks"], h["neighbour"])
        chains.setdefault(key, {})[h["way"]] = h["us_per_phase"]
    lines = ["| MB per phase | blocks | wait for | L | L no pf | P | P no pf | F | L - P | L - F | P - F |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (size, blocks, nb), w in sorted(chains.items()):
        L, L0 = w.get("launches+prefetch"), w.get("launches")
        P, P0 = w.get("persistent+prefetch"), w.get("persistent")
        F = w.get("no-wait+prefetch")
        f = lambda v: f"{v:.2f}" if v is not None else ""
        d = lambda x, y: f"{x - y:+.2f}" if x is not None and y is not None else ""
        lines.append(f"| {size / 1e6:.2f} | {blocks} | {'one block' if nb else 'the grid'} | {f(L)} | {f(L0)} | {f(P)} | {f(P0)} | {f(F)} | {d(L, P)} | {d(L, F)} | {d(P, F)} |")
    return lines


def serve_load(out):
    """The load test's table (as docs/benchmarks.md keeps it): per concurrency, each mode's
    aggregate tok/s, TTFT p50 and inter-token latency p95, one table per *serve_load*.jsonl."""
    tables = []
    for path in sorted(glob.glob(os.path.join(out, "*serve_load*.jsonl"))):
        rows, modes = {}, []
        for line in open(path, errors="replace"):
            try:
                d = json.loads(line)
                cell = (d["decode"]["aggregate_tok_s"], d["ttft_secs"]["p50"], d["itl_secs"]["p95"])
                key = (d["concurrency"], d["mode"])
            except (ValueError, KeyError, TypeError):
                continue
            rows[key] = cell
            if d["mode"] not in modes:
                modes.append(d["mode"])
        if not rows:
            continue
        head = "| C | " + " | ".join(f"{m} tok/s | TTFT p50 s | ITL p95 ms" for m in modes) + " |"
        lines = [f"{os.path.basename(path)}:", "", head, "|---:|" + "---:|---:|---:|" * len(modes)]
        for c in sorted({c for c, _ in rows}):
            cells = []
            for m in modes:
                v = rows.get((c, m))
                cells.append(f"{v[0]:,.1f} | {v[1]:.3f} | {v[2] * 1e3:.1f}" if v else " | | ")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        tables.append(lines)
    return tables


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--base", default="base")
    ap.add_argument("--same", action="append", default=[], metavar="A=B")
    ap.add_argument("--step-windows", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.out):
        print(f"call_summary: {args.out} is not a directory", file=sys.stderr)
        return 2
    pairs = []
    for s in args.same:
        a, eq, b = s.partition("=")
        if not eq or not a or not b:
            print(f"call_summary: --same takes A=B, not {s!r}", file=sys.stderr)
            return 2
        pairs.append((a, b))
    ok = True
    print("## GPU tests")
    for suite, passed, failed, names, rc in tests(args.out):
        print(f"- {suite}: {passed} passed, {failed} failed, rc {rc}" + (f" ({', '.join(names)})" if names else ""))
        ok &= failed == 0 and rc == "0"
    found = arms(args.out)
    if found:
        print("\n## lily-bench arms\n")
        print("\n".join(arm_table(found, args.base)))
    if args.step_windows > 0:
        windows = step_windows(found, args.step_windows)
        if windows:
            print(f"\n## Median decode step (us) per {args.step_windows} steps\n")
            print("\n".join(windows))
    checks = same_checks(found, pairs)
    if checks:
        print("\n## Digests that must be equal\n")
        for line, good in checks:
            print(f"- {line}")
            ok &= good
    ho = handover(args.out)
    if len(ho) > 2:
        print("\n## Hand-over (us per phase; L launches, P persistent, F no wait; prefetch unless 'no pf')\n")
        print("\n".join(ho))
    for table in serve_load(args.out):
        print("\n## Serving load test\n")
        print("\n".join(table))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
