#!/usr/bin/env python3
"""Where does transformers' bf16 greedy decode stop repeating? (the transformers arm's refusal)

bench/transformers_arm.py publishes a cell only when two fresh processes produce the same greedy
tokens; on the H200 (2026-11-29) its bf16 rounds diverged after 6 to 38 decode steps even with
torch's deterministic algorithms on. This tool finds the first module whose output differs, and
which attention / experts variant repeats:

    python scripts/tf_determinism.py --model DIR --out a.json [--variants sdpa,sdpa-flash,eager] [--pick]
    python scripts/tf_determinism.py --compare a.json b.json       # across processes

A variant is ATTN[/EXPERTS]: ATTN is `sdpa` (torch picks the kernel), `sdpa-flash`,
`sdpa-efficient`, `sdpa-math`, `sdpa-cudnn` (torch.nn.attention.sdpa_kernel pins one) or
`eager`; EXPERTS a transformers experts implementation (default: the model's, grouped_mm).
The process loads the model once (as the arm does: bf16, deterministic algorithms) and, for
each variant, runs the prompt plus --steps greedy decode steps twice. Forward hooks record a
bitwise checksum of every decoder layer's mixer / MoE / router / experts / shared-expert output
and of the logits, in call order; the first difference between the two repeats is printed.
With --pick the last line is the transformers_arm.py arguments of the first variant whose
repeats are identical (exit 1 if none is).

First finding (H200, torch 2.11, 2026-11-29): with sdpa's default kernel choice, the first
difference is a full-attention layer's output at a decode step (6, 16 or 24 in three of four
runs), for grouped_mm and eager experts alike.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

HOOKED = ("linear_attn", "self_attn", "mlp", "mlp.gate", "mlp.experts", "mlp.shared_expert", "mlp.shared_expert_gate")


def checksum(t):
    """Bitwise checksum of a tensor: its bytes as int64 weighted by position (order-sensitive)."""
    import torch

    b = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
    return int((b * w).sum().item())


def first_difference(a, b):
    """(index, entry a, entry b) of the first differing trace entry, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), None, None
    return None


def describe(label, trace_a, trace_b, tokens_a, tokens_b):
    d = first_difference(trace_a, trace_b)
    first_tok = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    if d is None:
        print(f"{label}: identical ({len(trace_a)} checksums, {len(tokens_a)} tokens)")
    else:
        i, x, y = d
        print(f"{label}: first checksum difference at entry {i}: {x} vs {y}; first token difference at step {first_tok}")


def compare(a_path, b_path):
    """Print where two processes' traces of each variant part."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    for variant in a["runs"]:
        if variant in b["runs"]:
            ra, rb = a["runs"][variant][0], b["runs"][variant][0]
            describe(f"{variant} across processes", ra["trace"], rb["trace"], ra["tokens"], rb["tokens"])


def variant_setup(model, variant):
    """Configure `model` for `variant`; returns (context manager factory, transformers_arm.py args)."""
    from transformers_arm import SDPA_KERNELS, attention_kernels

    attn, _, experts = variant.partition("/")
    arm_args = []
    if experts:
        model.set_experts_implementation(experts)
        arm_args += ["--experts", experts]
    if attn == "eager":
        model.config._attn_implementation = "eager"
        return (lambda: attention_kernels(None)), arm_args + ["--attn", "eager"]
    model.config._attn_implementation = "sdpa"
    if attn == "sdpa":
        return (lambda: attention_kernels(None)), arm_args + ["--attn", "sdpa"]
    backend = attn.removeprefix("sdpa-")
    if backend not in SDPA_KERNELS:
        raise SystemExit(f"unknown variant {variant}")
    return (lambda: attention_kernels(backend)), arm_args + ["--attn", "sdpa", "--sdpa-backend", backend]


def run(args):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    import transformers_goldens as tg
    from common import prompt_tokens, text_config

    model = tg.build_model(args.model, "cuda", torch.bfloat16, "sdpa")
    vocab = text_config(args.model)["vocab_size"]
    ids = torch.tensor([prompt_tokens(args.prompt_len, vocab)], device="cuda")
    trace = []

    def hook(name):
        def f(_mod, _inp, out):
            t = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(t):
                trace.append(f"{state['step']}:{name}:{checksum(t)}")
        return f

    state = {"step": 0}
    layers = model.model.layers
    for i, layer in enumerate(layers):
        for sub in HOOKED:
            mod = layer
            for part in sub.split("."):
                mod = getattr(mod, part, None)
                if mod is None:
                    break
            if mod is not None:
                mod.register_forward_hook(hook(f"{i}.{sub}"))

    def greedy(ctx):
        trace.clear()
        tokens, gaps = [], []
        with torch.inference_mode(), ctx():
            state["step"] = 0
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            for step in range(args.steps + 1):
                row = out.logits[0, -1]
                trace.append(f"{step}:logits:{checksum(row)}")
                top = torch.topk(row.float(), 2)
                tokens.append(int(top.indices[0]))
                gaps.append(float(top.values[0] - top.values[1]))
                if step == args.steps:
                    break
                state["step"] = step + 1
                out = model(input_ids=torch.tensor([[tokens[-1]]], device="cuda"),
                            past_key_values=out.past_key_values, use_cache=True)
        torch.cuda.synchronize()
        return {"tokens": tokens, "top2_gaps": gaps, "trace": list(trace)}

    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "prompt_len": args.prompt_len,
              "steps": args.steps, "runs": {}}
    picked = None
    for variant in args.variants.split(","):
        ctx, arm_args = variant_setup(model, variant)
        try:
            reps = [greedy(ctx) for _ in range(2)]
        except RuntimeError as e:  # e.g. "No available kernel": the pinned sdpa kernel cannot take these inputs
            print(f"{variant}: cannot run: {str(e).splitlines()[0][:200]}")
            continue
        result["runs"][variant] = reps
        describe(f"{variant} within one process", reps[0]["trace"], reps[1]["trace"], reps[0]["tokens"], reps[1]["tokens"])
        print(f"{variant}: tokens {reps[0]['tokens'][:12]}..., smallest top-2 gap {min(reps[0]['top2_gaps']):.4g}")
        if picked is None and reps[0]["trace"] == reps[1]["trace"]:
            picked = arm_args
    json.dump(result, open(args.out, "w"))
    if args.pick:
        if picked is None:
            raise SystemExit("no variant repeats its greedy tokens")
        print(" ".join(picked))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", default="sdpa,sdpa-flash,sdpa-efficient,sdpa-math,eager",
                    help="ATTN[/EXPERTS] variants to try, in order (see the module doc)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--pick", action="store_true", help="print the first variant that repeats (its arm arguments)")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.model and args.out:
        run(args)
    else:
        ap.error("--model and --out, or --compare A B")


if __name__ == "__main__":
    main()
