#!/usr/bin/env python3
"""One command for the peer benchmark: Lily vs MLX-LM vs transformers vs llama.cpp.

For every context (default 256,1024,4096,16384,32768,131072) and round (2), each available
engine runs as a fresh process (bench/*_arm.py, lily-bench); the raw JSON lines are appended to
OUT/<engine>.jsonl (failures to OUT/failures.jsonl). Runs already recorded in OUT are skipped, so
the command can be re-run to resume (the GPU machine allows 10 minutes per command). Round r runs
contexts ascending (r even) or descending, engines in order (r even) or reversed.

An (engine, context) is published only with exactly `--rounds` successful records whose decode
digests are all equal; otherwise its cell says "refused" (llama-bench returns no tokens: its
digest is "n/a" and said so). Engines that are not installed are listed as missing, never faked.
Then docs/benchmarks-peers.md is regenerated: tok/s medians, Lily/peer ratios, Lily as a fraction
of the H200 rooflines (bench/roofline.py), per-round digests, and an accuracy table
(teacher-forced logits over --accuracy-positions positions: `lily logits` vs
scripts/transformers_goldens.py and scripts/mlx_logits.py, via scripts/compare_logits.py).

    python bench/run_all.py --model DIR [--contexts 256,4096] [--engines lily,mlx-lm,transformers,llama.cpp]
        [--lily-bench target/release/lily-bench] [--lily target/release/lily] [--lily-backend auto]
        [--mlx-python PY] [--torch-python PY] [--llama-bench PATH --gguf Q4_0=F.gguf,Q4_K_M=G.gguf]
        [--out bench/results/DATE] [--doc docs/benchmarks-peers.md] [--note TEXT] [--report-only]
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import roofline  # noqa: E402

DEFAULT_CONTEXTS = "256,1024,4096,16384,32768,131072"
ENGINES = ["lily", "mlx-lm", "transformers", "llama.cpp"]


# ------------------------------------------------------------------ records and summary
def key_of(rec):
    """Column label of a record: the engine, plus the GGUF variant for llama.cpp."""
    return rec["engine"] + (f" {rec['variant']}" if rec.get("variant") else "")


def load_records(out):
    recs = []
    if os.path.isdir(out):
        for f in sorted(os.listdir(out)):
            if f.endswith(".jsonl") and f != "failures.jsonl" and f != "accuracy.jsonl":
                for line in open(os.path.join(out, f)):
                    if line.strip():
                        recs.append(json.loads(line))
    return recs


def load_manifests(out):
    """The manifest of every run_all invocation that wrote to OUT, oldest first."""
    ms = []
    if os.path.isdir(out):
        for f in sorted(os.listdir(out)):
            if f.startswith("manifest-") and f.endswith(".json"):
                try:
                    ms.append(json.load(open(os.path.join(out, f))))
                except (OSError, ValueError):
                    pass
    return sorted(ms, key=lambda m: m.get("started", ""))


def summarize(records, rounds):
    """{(label, ctx): cell}; a cell is published only with `rounds` records and one digest."""
    groups = {}
    for r in records:
        groups.setdefault((key_of(r), r["prompt_len"]), []).append(r)
    cells = {}
    for k, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.get("round", 0))
        digests = [r["decode"]["token_digest"] for r in rs]
        dec = [r["decode"]["tok_s"] for r in rs]
        pre = [r["prefill"]["tok_s"] for r in rs]
        cell = {"rounds": len(rs), "digests": digests, "decode": dec, "prefill": pre,
                "decode_median": statistics.median(dec), "prefill_median": statistics.median(pre),
                "decode_drift": max(dec) / min(dec) - 1, "prefill_drift": max(pre) / min(pre) - 1}
        if len(rs) != rounds:
            cell["status"] = f"refused: {len(rs)} of {rounds} rounds"
        elif all(d is None for d in digests):
            cell["status"] = "ok (digest n/a)"
        elif len(set(digests)) != 1:
            cell["status"] = "refused: digests differ between rounds" + first_divergence(rs)
            ops = sorted({o for r in rs for o in r.get("nondeterministic_ops") or []})
            if ops:
                cell["nondeterministic_ops"] = ops
        else:
            cell["status"] = "ok"
        cells[k] = cell
    return cells


def first_divergence(rs):
    """' (first at decode step N)': where the rounds' greedy tokens first differ (1-based), if known."""
    ids = [r["decode"].get("token_ids") for r in rs]
    if any(not t for t in ids):
        return ""
    for i in range(min(len(t) for t in ids)):
        if len({t[i] for t in ids}) > 1:
            return f" (first at decode step {i + 1})"
    return ""


def fmt(v, nd=1):
    if v is None:
        return "—"
    return f"{v:,.{nd}f}" if v >= 10 or nd == 0 else f"{v:,.{max(nd, 2)}f}"


def published(cells, label, ctx, field):
    c = cells.get((label, ctx))
    if c is None or not c["status"].startswith("ok"):
        return None
    return c[field + "_median"]


def render(cells, contexts, labels, missing, accuracy, meta, tc):
    """The markdown of docs/benchmarks-peers.md."""
    peers = [l for l in labels if l != "lily"]
    L = [f"# Lily vs peers — {meta['title']}", ""]
    if meta.get("note"):
        L += [f"> **{meta['note']}**", ""]
    L += [f"Generated by `python bench/run_all.py` on {meta['date']} (host `{meta['host']}`: {meta['machine']}); "
          f"raw JSON lines in `{meta['out_rel']}/`. Checkpoint: `{meta['model']}` "
          f"(hidden {tc['hidden_size']}, {tc['num_hidden_layers']} layers, {tc['num_experts']} experts). "
          f"Unit: tokens/s, median of {meta['rounds']} rounds, batch 1, greedy, {meta['decode_steps']} decode steps.", ""]
    for field, title, roof in (("decode", "Decode (tokens/s after a context of N tokens)", "bandwidth"),
                               ("prefill", "Prefill (prompt tokens/s, time to the first token)", "bf16 compute")):
        L += [f"## {title}", ""]
        hdr = ["Context"] + labels + [f"Lily / {p}" for p in peers] + [f"Lily / {roof} roofline"]
        L += ["| " + " | ".join(hdr) + " |", "|" + "---:|" * len(hdr)]
        for ctx in contexts:
            row = [f"{ctx:,}"]
            for l in labels:
                v = published(cells, l, ctx, field)
                c = cells.get((l, ctx))
                row.append(fmt(v) if v is not None else ("refused" if c else ("missing" if l in missing else "—")))
            ours = published(cells, "lily", ctx, field)
            for p in peers:
                pv = published(cells, p, ctx, field)
                row.append(f"{ours / pv:.3f}x" if ours and pv else "—")
            rl = roofline.decode_roofline(tc, ctx) if field == "decode" else roofline.prefill_roofline(tc, ctx)
            row.append(f"{100 * ours / rl:.2f}% of {rl:,.0f}" if ours else f"— of {rl:,.0f}")
            L.append("| " + " | ".join(row) + " |")
        L.append("")
    L += ["Rooflines (bench/roofline.py, the formulas of shared/reference/bench/bytes_per_token.py on this checkpoint's "
          "config): decode = 4.3 TB/s ÷ bytes touched per token (weights of the 8 routed + shared experts, attention/GDN "
          "projections, lm_head, GDN state read+write, KV of the context; 1.88 GB/token → ~2,290 tok/s for the 35B at 4K); "
          "prefill = 790 TFLOP/s (measured H200 dense bf16) ÷ FLOPs per prompt token (~150K tok/s for the 35B at short "
          "prompts). Both are H200 figures.", "",
          "Cells: a number is the median of the rounds, published only when every round ran and the digests repeat; "
          "\"refused\" = recorded but not publishable (a round missing or digests differ; the per-round figures are "
          "below); \"missing\" = the engine was not installed; \"—\" = not run.", ""]
    L += ["## Rounds and digests", "",
          "| Engine | Context | Status | Decode tok/s per round | Prefill tok/s per round | Digest(s) | Backend |",
          "|---|---:|---|---|---|---|---|"]
    for l in labels:
        for ctx in contexts:
            c = cells.get((l, ctx))
            if not c:
                continue
            dg = sorted({d for d in c["digests"] if d}) or ["n/a"]
            L.append(f"| {l} | {ctx:,} | {c['status']} | {' / '.join(fmt(x, 2) for x in c['decode'])} | "
                     f"{' / '.join(fmt(x) for x in c['prefill'])} | {', '.join('`' + d + '`' for d in dg)} | {meta['backends'].get(l, '')} |")
    L.append("")
    nondet = sorted({(l, o) for (l, _), c in cells.items() for o in c.get("nondeterministic_ops", [])})
    if nondet:
        L += ["Ops that ran without a deterministic kernel in refused cells (the engine's own warnings): "
              + "; ".join(f"{l}: `{o}`" for l, o in nondet), ""]
    L += ["## Accuracy (teacher-forced logits)", ""]
    if accuracy:
        L += ["| Reference | Candidate | Positions | Top-1 agreement | Relative logit error | Max abs logit error | Mean abs top-1 log-prob error |",
              "|---|---|---:|---:|---:|---:|---:|"]
        for a in accuracy:
            if "error" in a:
                L.append(f"| {a['reference']} | {a['candidate']} | — | {a['error']} | | | |")
            else:
                L.append(f"| {a['reference_source']} | {a['candidate_source']} | {a['positions']} | {a['top1_agreement']:.4f} | "
                         f"{a['relative_logit_error']:.3e} | {a['max_abs_logit_error']:.3e} | {a['mean_abs_top1_logprob_error']:.3e} |")
        L += ["", "Logits compared at each reference position's top-20 ids and a fixed set of 256 probe ids "
              "(scripts/compare_logits.py); prompt token i = ((i·2654435761) mod 2³²) mod min(vocab, 248044).", ""]
    else:
        L += ["Not run.", ""]
    if missing:
        L += ["## Engines not measured", ""] + [f"* **{k}**: {v}" for k, v in sorted(missing.items())] + [""]
    L += ["## Method", "",
          "* Contract (shared/seeds/000): prompt token i = ((i·2654435761) mod 2³²) mod vocab_size; fresh process per "
          "(engine, context, round); exact-shape warmup; prefill = time until the first generated token is on the host; "
          "decode = the next 64 tokens; 64-bit FNV-1a over the whole u32 decode token ids; a cell is published only if its "
          "digest repeats in every round. Cross-engine digests are informational (each engine follows its own greedy path).",
          "* **Lily**: `lily-bench` (one JSON line).",
          "* **MLX-LM** (bench/mlx_arm.py): the checkpoint loaded unchanged with `mlx_lm.load`; prefill = first yield of "
          "`mlx_lm.generate.generate_step`, decode = the next 64 inter-yield intervals, lookahead drained with "
          "`mx.synchronize` outside the timers; greedy on the bf16 logprobs; includes its full-vocabulary logsumexp.",
          "* **transformers** (bench/transformers_arm.py): `Qwen3_5MoeForCausalLM` on the exactly dequantized weights "
          "(bf16 + sdpa on CUDA, f32 + eager on CPU), one forward of the prompt then single-token forwards with its cache. "
          "A general-runtime baseline: without flash-linear-attention it runs the torch GDN fallback (no fused GDN kernels). "
          "torch's default sdpa kernel choice did not repeat its greedy tokens run to run on the H200, so the arm runs with "
          "the kernel scripts/tf_determinism.py found repeating (`--tf-args`; the Backend column names it).",
          "* **llama.cpp** (bench/gguf_arm.py): `llama-bench` on a GGUF written by bench/write_gguf.py from the same "
          "checkpoint; prefill = `-p N -n 0`, decode = `-p 0 -n 64 -d N`. llama-bench uses random prompt ids and returns no "
          "tokens, so these cells have no digest and its prefill is pure prompt processing (no first-token sampling).", ""]
    L += ["## Versions", ""] + [f"* {k}: {v}" for k, v in sorted(meta["versions"].items())] + [""]
    return "\n".join(L)


# ------------------------------------------------------------------ running the arms
def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LILY_") or k == "LILY_BENCH_SOURCE_ID"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def probe(cmd, timeout=120):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
        return p.returncode == 0, (p.stdout.strip() or p.stderr.strip()[-300:])
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)


def discover(args):
    """{label: argv-builder} for the engines that are installed; {label: reason} for the rest."""
    arms, missing, versions = {}, {}, {}
    want = args.engines.split(",")
    if "lily" in want:
        if os.path.isfile(args.lily_bench) and os.access(args.lily_bench, os.X_OK):
            arms["lily"] = lambda ctx: [args.lily_bench, "--model", args.model, "--prompt-len", str(ctx),
                                        "--decode-steps", str(args.decode_steps), "--backend", args.lily_backend]
        else:
            missing["lily"] = f"lily-bench not found at {args.lily_bench} (cargo build --release --bins)"
    if "mlx-lm" in want:
        ok, out = probe([args.mlx_python, "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())"])
        if ok:
            versions["mlx, mlx-lm, device"] = out
            arms["mlx-lm"] = lambda ctx: [args.mlx_python, os.path.join(HERE, "mlx_arm.py"), "--model", args.model,
                                          "--prompt-len", str(ctx), "--decode-steps", str(args.decode_steps)]
        else:
            missing["mlx-lm"] = f"not installed for {args.mlx_python}: {out}"
    if "transformers" in want:
        ok, out = probe([args.torch_python, "-c", "import torch, transformers; from transformers import Qwen3_5MoeForCausalLM; "
                         "print(torch.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"])
        if ok:
            versions["torch, transformers, device"] = out
            arms["transformers"] = lambda ctx: [args.torch_python, os.path.join(HERE, "transformers_arm.py"), "--model", args.model,
                                                "--prompt-len", str(ctx), "--decode-steps", str(args.decode_steps)] + \
                shlex.split(args.tf_args)
        else:
            missing["transformers"] = f"not installed for {args.torch_python}: {out}"
    if "llama.cpp" in want:
        ggufs = [g.split("=", 1) for g in args.gguf.split(",") if g] if args.gguf else []
        if not (args.llama_bench and os.path.isfile(args.llama_bench)):
            missing["llama.cpp"] = f"llama-bench not found ({args.llama_bench or 'pass --llama-bench'}; build it from the llama-cpp-python sdist, bench/README.md)"
        elif not ggufs:
            missing["llama.cpp"] = "no GGUF given (--gguf Q4_0=PATH,...; bench/write_gguf.py)"
        else:
            for variant, path in ggufs:
                label = f"llama.cpp {variant}"
                if not os.path.isfile(path):
                    missing[label] = f"GGUF {path} not found"
                    continue
                arms[label] = (lambda v, p: lambda ctx: [sys.executable, os.path.join(HERE, "gguf_arm.py"), "--llama-bench", args.llama_bench,
                                                         "--gguf", p, "--variant", v, "--prompt-len", str(ctx),
                                                         "--decode-steps", str(args.decode_steps)])(variant, path)
    return arms, missing, versions


def run_matrix(args, arms, contexts):
    done = {(key_of(r), r["prompt_len"], r.get("round")) for r in load_records(args.out)}
    labels = [l for l in ENGINES_ORDER(arms)]
    t_start = time.time()
    for rnd in range(args.rounds):
        ctxs = contexts if rnd % 2 == 0 else contexts[::-1]
        order = labels if rnd % 2 == 0 else labels[::-1]
        for ctx in ctxs:
            for label in order:
                if (label, ctx, rnd) in done:
                    continue
                if args.max_seconds and time.time() - t_start > args.max_seconds:
                    print(f"run_all: --max-seconds {args.max_seconds} reached; re-run the same command to resume", file=sys.stderr)
                    return False
                cmd = arms[label](ctx)
                print(f"run_all: round {rnd} context {ctx} {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
                t0 = time.time()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.arm_timeout, env=clean_env(), cwd=ROOT)
                    rc, out, err = p.returncode, p.stdout, p.stderr
                except subprocess.TimeoutExpired as e:
                    rc, out, err = "timeout", e.stdout or "", (e.stderr or "") if isinstance(e.stderr, str) else ""
                lines = [l for l in (out or "").splitlines() if l.startswith("{")]
                fname = label.replace(" ", "_").replace("/", "_") + ".jsonl"
                if rc == 0 and len(lines) == 1:
                    rec = json.loads(lines[0])
                    rec.update(round=rnd, wall_process_secs=time.time() - t0,
                               recorded_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
                    with open(os.path.join(args.out, fname), "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"run_all:   prefill {rec['prefill']['tok_s']:.1f} tok/s, decode {rec['decode']['tok_s']:.2f} tok/s, "
                          f"digest {rec['decode']['token_digest']} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
                else:
                    with open(os.path.join(args.out, "failures.jsonl"), "a") as f:
                        f.write(json.dumps({"label": label, "prompt_len": ctx, "round": rnd, "rc": rc, "cmd": cmd,
                                            "stderr_tail": (err or "")[-4000:]}) + "\n")
                    print(f"run_all:   FAILED rc={rc}: {(err or '')[-600:]}", file=sys.stderr, flush=True)
    return True


def ENGINES_ORDER(arms):
    return sorted(arms, key=lambda l: (ENGINES.index(l.split(" ")[0]), l))


def run_accuracy(args, arms):
    """Teacher-forced logits of Lily, transformers and mlx-lm on the same prompt; compare_logits.py."""
    acc_dir = os.path.join(args.out, "accuracy")
    os.makedirs(acc_dir, exist_ok=True)
    P = str(args.accuracy_positions)
    files = {}
    jobs = []
    if "lily" in arms:
        jobs.append(("lily", [args.lily, "logits", "--model", args.model, "--positions", P, "--backend", args.lily_backend]))
    if "transformers" in arms:
        dev = "--device cuda --dtype bfloat16" if args.accuracy_tf_cuda else "--device cpu --dtype float32"
        jobs.append(("transformers", [args.torch_python, os.path.join(ROOT, "scripts", "transformers_goldens.py"), "--model", args.model,
                                      "--positions", P, "--greedy", "0", *dev.split()]))
    if "mlx-lm" in arms:
        jobs.append(("mlx-lm", [args.mlx_python, os.path.join(ROOT, "scripts", "mlx_logits.py"), "--model", args.model, "--positions", P]))
    results = []
    for name, cmd in jobs:
        path = os.path.join(acc_dir, f"{name}.json")
        if not os.path.exists(path):
            print(f"run_all: accuracy: {name}", file=sys.stderr, flush=True)
            p = subprocess.run(cmd + ["--out", path], capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=args.arm_timeout)
            if p.returncode != 0:
                results.append({"reference": name, "candidate": "", "error": f"{name} logits failed: {p.stderr.strip()[-200:]}"})
                continue
        files[name] = path
    pairs = [("transformers", "lily"), ("mlx-lm", "lily"), ("transformers", "mlx-lm")]
    for ref, cand in pairs:
        if ref in files and cand in files:
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_logits.py"), files[ref], files[cand], "--json"],
                               capture_output=True, text=True)
            if p.returncode == 0:
                r = json.loads(p.stdout)
                r.update(reference_source=r.pop("reference"), candidate_source=r.pop("candidate"))
                results.append(r)
            else:
                results.append({"reference": ref, "candidate": cand, "error": p.stderr.strip()[-200:]})
    with open(os.path.join(args.out, "accuracy.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    return results


def machine():
    try:
        g = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if g.returncode == 0 and g.stdout.strip():
            return "GPU " + g.stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU only: {cpu}, {os.cpu_count()} cores"


def main():
    today = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default=DEFAULT_CONTEXTS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--lily-bench", default=os.path.join(ROOT, "target", "release", "lily-bench"))
    ap.add_argument("--lily", default=os.path.join(ROOT, "target", "release", "lily"))
    ap.add_argument("--lily-backend", default="auto")
    ap.add_argument("--mlx-python", default=sys.executable)
    ap.add_argument("--torch-python", default=sys.executable)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--gguf", default="", help="VARIANT=PATH[,VARIANT=PATH] e.g. Q4_0=/data/m-Q4_0.gguf,Q4_K_M=/data/m-Q4_K_M.gguf")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", today))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks-peers.md"))
    ap.add_argument("--title", default="H200")
    ap.add_argument("--note", default="")
    ap.add_argument("--accuracy-positions", type=int, default=192)
    ap.add_argument("--accuracy-tf-cuda", action="store_true", help="transformers reference in bf16 on CUDA (default f32 on CPU)")
    ap.add_argument("--tf-args", default="", help="extra transformers_arm.py arguments, e.g. '--attn sdpa --sdpa-backend flash'")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--arm-timeout", type=int, default=1800)
    ap.add_argument("--max-seconds", type=float, default=0, help="start no new arm after this many seconds (resume later)")
    ap.add_argument("--report-only", action="store_true", help="only regenerate the doc from OUT")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.rounds < 2:
        raise SystemExit("--rounds must be >= 2 (digests must repeat)")
    os.makedirs(args.out, exist_ok=True)
    arms, missing, versions = discover(args)
    complete = True
    if not args.report_only:
        from common import text_config as _tc
        json.dump({"argv": sys.argv, "arms": sorted(arms), "missing": missing, "versions": versions | {"python": sys.version.split()[0]}, "machine": machine(),
                   "host": platform.node(), "text_config": _tc(args.model),
                   "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                  open(os.path.join(args.out, f"manifest-{int(time.time())}.json"), "w"), indent=1)
        complete = run_matrix(args, arms, contexts)
    accuracy = []
    acc_path = os.path.join(args.out, "accuracy.jsonl")
    if complete and not args.no_accuracy and not args.report_only:
        accuracy = run_accuracy(args, arms)
    elif os.path.exists(acc_path):
        accuracy = [json.loads(l) for l in open(acc_path) if l.strip()]
    records = [r for r in load_records(args.out) if r["prompt_len"] in contexts]
    cells = summarize(records, args.rounds)
    labels = ENGINES_ORDER({key_of(r): 1 for r in records} | {l: 1 for l in arms})
    manifests = load_manifests(args.out)
    if args.report_only and manifests:
        # What the GPU runs could not find, not what this machine lacks.
        missing = {}
        for m in manifests:
            missing.update({k: v for k, v in m.get("missing", {}).items() if not any(key_of(r) == k for r in records)})
    for l in missing:
        if l not in labels:
            labels.append(l)
    backends = {}
    for r in records:
        b = r.get("backend", "")
        if r.get("attn_implementation"):  # transformers: which attention ran (the kernel, when pinned)
            b += f", {r['attn_implementation']}" + (f" {r['sdpa_backend']} kernel" if r.get("sdpa_backend") else "")
        backends[key_of(r)] = b
    # The runs' own manifests say where they ran: --report-only on another machine (no checkpoint,
    # no engines) still renders the GPU machine, its engine versions and the checkpoint's shapes.
    from common import text_config
    if os.path.exists(os.path.join(args.model, "config.json")):
        tc = text_config(args.model)
    elif manifests and manifests[-1].get("text_config"):
        tc = manifests[-1]["text_config"]
    else:
        raise SystemExit(f"no config.json in {args.model} and no manifest in {args.out} records one")
    run_versions, run_machine, run_host = {}, None, None
    for m in manifests:
        run_versions.update(m.get("versions", {}))
        run_machine, run_host = m.get("machine", run_machine), m.get("host", run_host)
    if args.report_only and run_machine:
        machine_txt, host = run_machine, run_host or "unrecorded"
    else:
        machine_txt, host = machine(), platform.node()
    dates = sorted({r["recorded_at"][:10] for r in records if r.get("recorded_at")})
    meta = {"title": args.title, "note": args.note, "date": " / ".join(dates) or today, "host": host, "machine": machine_txt,
            "out_rel": os.path.relpath(args.out, ROOT), "model": args.model, "rounds": args.rounds,
            "decode_steps": args.decode_steps, "versions": run_versions if args.report_only and manifests else versions | {"python": sys.version.split()[0]},
            "backends": backends}
    md = render(cells, contexts, labels, missing, accuracy, meta, tc)
    os.makedirs(os.path.dirname(args.doc), exist_ok=True)
    with open(args.doc, "w") as f:
        f.write(md + "\n")
    bad = [f"{l}@{c}: {cell['status']}" for (l, c), cell in cells.items() if not cell["status"].startswith("ok")]
    print(md)
    print(f"run_all: wrote {args.doc}; {len(cells)} cells, {len(bad)} refused {bad}; missing: {sorted(missing)}", file=sys.stderr)
    sys.exit(0 if complete and not bad else 2)


if __name__ == "__main__":
    main()
