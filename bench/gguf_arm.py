#!/usr/bin/env python3
"""llama.cpp arm of the peer benchmark: llama.cpp's own `llama-bench` on a GGUF written by
bench/write_gguf.py (arch qwen35moe). One process per (context, round), like the other arms.

llama-bench measures the two figures separately (with its own warmup run each):
  prefill: `-p CTX -n 0`            -> prompt tokens/s of a CTX-token prompt (n_batch 2048, n_ubatch 512 by default);
  decode:  `-p 0 -n STEPS -d CTX`   -> tokens/s of STEPS generated tokens after a CTX-token context.
It feeds random token ids and returns no token ids, so this arm has no digest (token_digest null):
its rows are published with "digest n/a". Prints one JSON line with lily-bench's field names
(engine "llama.cpp", variant = the GGUF's quant label).

    python bench/gguf_arm.py --llama-bench PATH --gguf model-Q4_0.gguf --variant Q4_0 --prompt-len 4096
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PROMPT_KIND, emit  # noqa: E402


def run_bench(exe, gguf, extra, args):
    cmd = [exe, "-m", gguf, "-o", "json", "-r", str(args.repetitions), "-ngl", str(args.ngl), "-fa", args.fa] + extra
    if args.threads:
        cmd += ["-t", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"llama-bench failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)[0], cmd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--variant", default=None, help="label, e.g. Q4_0 (default: from the file name)")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--fa", default="1", help="flash attention 0/1 (llama-bench -fa)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    pp, cmd_pp = run_bench(args.llama_bench, args.gguf, ["-p", str(args.prompt_len), "-n", "0"], args)
    tg, cmd_tg = run_bench(args.llama_bench, args.gguf, ["-p", "0", "-n", str(args.decode_steps), "-d", str(args.prompt_len)], args)
    pre_ts, dec_ts = float(pp["avg_ts"]), float(tg["avg_ts"])
    variant = args.variant or os.path.basename(args.gguf).rsplit(".", 1)[0].split("-")[-1]
    rec = {
        "schema_version": 1, "engine": "llama.cpp", "variant": variant,
        "backend": f"llama.cpp {pp.get('build_commit', '?')} {pp.get('backends', '?')} ngl={args.ngl} fa={args.fa}",
        "source_id": os.environ.get("LILY_BENCH_SOURCE_ID", "unknown"), "model": args.gguf,
        "prompt_len": args.prompt_len, "prompt_kind": "llama-bench random ids (not " + PROMPT_KIND + ")",
        "decode_steps": args.decode_steps, "warmup": True,
        "prefill": {"wall_secs": args.prompt_len / pre_ts, "tok_s": pre_ts, "first_token_id": None},
        "decode": {"wall_secs": args.decode_steps / dec_ts, "tok_s": dec_ts, "step_wall_secs": [],
                   "token_digest": None, "token_ids": []},
        "decode_mode": f"llama-bench tg{args.decode_steps}@d{args.prompt_len}",
        "llama_bench": {"pp": pp, "tg": tg, "cmd_pp": cmd_pp, "cmd_tg": cmd_tg},
    }
    emit(rec, args.json_out, label=f"llama.cpp {variant}")


if __name__ == "__main__":
    main()
