#!/usr/bin/env python3
"""Where does transformers' bf16 greedy decode stop repeating? (the transformers arm's refusal)

bench/transformers_arm.py publishes a cell only when two fresh processes produce the same greedy
tokens; on the H200 (2026-11-29) its bf16 rounds diverged after 8 to 38 decode steps even with
torch's deterministic algorithms on. This tool finds the first module whose output differs:

    python scripts/tf_determinism.py --model DIR --out a.json      # process 1
    python scripts/tf_determinism.py --model DIR --out b.json      # process 2
    python scripts/tf_determinism.py --compare a.json b.json       # across processes

Each process loads the model once (as the arm does: bf16, sdpa, deterministic algorithms) and,
for every experts implementation asked for, runs the prompt plus --steps greedy decode steps
twice. Forward hooks record a bitwise checksum of every decoder-layer mixer / MoE / router /
experts / shared-expert output and of the logits, in call order. The JSON holds the traces;
the process prints the first difference between its own two repeats, --compare the first
difference between two processes' traces of the same implementation.
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


def compare(a_path, b_path, pick):
    """Print where two processes' traces part; with `pick`, print (last line) the first experts
    implementation whose tokens repeat within each process and across them, and fail if none does."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    stable = []
    for impl in a["runs"]:
        if impl not in b["runs"]:
            continue
        ra, rb = a["runs"][impl][0], b["runs"][impl][0]
        describe(f"{impl} across processes", ra["trace"], rb["trace"], ra["tokens"], rb["tokens"])
        reps = a["runs"][impl] + b["runs"][impl]
        if all(r["tokens"] == reps[0]["tokens"] for r in reps):
            stable.append(impl)
    if pick:
        if not stable:
            raise SystemExit("no experts implementation repeats its greedy tokens")
        print(stable[0])


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

    def greedy():
        trace.clear()
        tokens, gaps = [], []
        with torch.inference_mode():
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
    for impl in args.experts.split(","):
        model.set_experts_implementation(impl)
        reps = [greedy() for _ in range(2)]
        result["runs"][impl] = reps
        describe(f"{impl} within one process", reps[0]["trace"], reps[1]["trace"], reps[0]["tokens"], reps[1]["tokens"])
        print(f"{impl}: tokens {reps[0]['tokens'][:12]}..., smallest top-2 gap {min(reps[0]['top2_gaps']):.4g}")
    json.dump(result, open(args.out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--experts", default="grouped_mm,eager", help="experts implementations to try, in order")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--pick", action="store_true", help="with --compare: print the first implementation that repeats")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, args.pick)
    elif args.model and args.out:
        run(args)
    else:
        ap.error("--model and --out, or --compare A B")


if __name__ == "__main__":
    main()
