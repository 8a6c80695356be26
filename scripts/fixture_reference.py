#!/usr/bin/env python3
"""The Python rows of the fixture's accuracy table (docs/correctness.md, issue 21), scored exactly
as `lily perplexity` scores: the held-out text tokenized as one raw text, chunks of --ctx tokens
each from an empty context, the predictions of tokens ctx/2+1 .. ctx-1 of each chunk.

Paths (--paths, comma-separated; `reference` is always run first):
  reference     transformers float32 on the dequantized 4-bit weights (--mlx): THE reference;
                its log-probabilities go to --save in the file format of
                `lily perplexity --save-logits` (LogProbFile, src/engine/perplexity.rs), so
                `lily perplexity --kl-against FILE` compares any Lily path with it
  hf-bf16       transformers bfloat16 on the unquantized HF weights (--hf)
  mlx           mlx-lm on the 4-bit checkpoint (--mlx), its default (bf16) arithmetic

Each path prints one JSON line: PPL, its uncertainty, and KL(reference || path) / top-1
agreement computed from the f16-rounded log-probabilities, as Lily's `divergence` does.

  python3 scripts/fixture_reference.py --mlx /tmp/fixture-4bit --hf /tmp/fixture-hf \\
      --file tests/fixtures/qwen-fixture/heldout.txt --chunks 8 --save /tmp/ref.logp
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def chunk_ids(ids, ctx, max_chunks):
    n = len(ids) // ctx
    if max_chunks:
        n = min(n, max_chunks)
    if n == 0:
        raise SystemExit(f"the text has {len(ids)} tokens; at least one chunk of --ctx {ctx} is needed")
    return [ids[c * ctx:(c + 1) * ctx] for c in range(n)]


class Run:
    """Scored positions of one path: the true token's log-probability and the f16 rows."""

    def __init__(self, name, vocab):
        self.name, self.vocab = name, vocab
        self.tokens, self.logprobs, self.rows = [], [], []

    def add(self, logits, chunk, ctx):
        """`logits`: [ctx, V] float tensor of one chunk."""
        lp = torch.log_softmax(logits.double(), dim=-1)
        first = ctx // 2
        for t in range(first, ctx - 1):
            tok = chunk[t + 1]
            self.tokens.append(tok)
            self.logprobs.append(float(lp[t, tok]))
            self.rows.append(lp[t].clamp(min=-65000.0).to(torch.float16).numpy())

    def ppl(self):
        nll = -np.array(self.logprobs, dtype=np.float64)
        mean = nll.mean()
        se = nll.std(ddof=1) / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
        return {"tokens_scored": len(nll), "ppl": math.exp(mean), "ppl_stderr": math.exp(mean) * se, "mean_nll": mean}

    def save(self, path):
        with open(path, "wb") as fh:
            fh.write(b"LILYLOGP" + struct.pack("<II", 1, self.vocab))
            for tok, lp, row in zip(self.tokens, self.logprobs, self.rows):
                fh.write(struct.pack("<If", tok, lp))
                fh.write(row.astype("<f2").tobytes())


def divergence(ref, run):
    kls, agree, max_delta = [], 0, 0.0
    for i in range(len(ref.tokens)):
        assert ref.tokens[i] == run.tokens[i]
        a = ref.rows[i].astype(np.float64)
        b = run.rows[i].astype(np.float64)
        kls.append(max(float(np.sum(np.exp(a) * (a - b))), 0.0))
        agree += int(np.argmax(ref.rows[i]) == np.argmax(run.rows[i]))
        max_delta = max(max_delta, abs(np.float32(ref.logprobs[i]) - np.float32(run.logprobs[i])))
    kls = np.array(kls)
    return {
        "mean_kl": float(kls.mean()),
        "kl_stderr": float(kls.std(ddof=1) / math.sqrt(len(kls))) if len(kls) > 1 else 0.0,
        "p99_kl": float(np.sort(kls)[round(0.99 * (len(kls) - 1))]),
        "max_kl": float(kls.max()),
        "top1_agreement": agree / len(kls),
        "max_true_logprob_delta": float(max_delta),
    }


def torch_run(name, model, chunks, ctx, vocab):
    run = Run(name, vocab)
    with torch.no_grad():
        for chunk in chunks:
            logits = model(torch.tensor([chunk])).logits[0].float()
            run.add(logits, chunk, ctx)
    return run


def hf_bf16_model(hf_dir):
    """Qwen3_5MoeForCausalLM in bfloat16 holding the HF checkpoint's weights unchanged."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    tc = json.load(open(os.path.join(hf_dir, "config.json")))["text_config"]
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in tc.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(cfg)
    state = {k.replace("model.language_model.", "model."): v for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing={missing[:8]} unexpected={unexpected[:8]}")
    return model.to(torch.bfloat16).eval()


def mlx_run(mlx_dir, chunks, ctx, vocab):
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(mlx_dir)
    run = Run("mlx", vocab)
    for chunk in chunks:
        logits = model(mx.array([chunk]))[0].astype(mx.float32)
        run.add(torch.from_numpy(np.array(logits)), chunk, ctx)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlx", required=True, help="the 4-bit MLX checkpoint (lily quantize / mlx_lm.convert output)")
    ap.add_argument("--hf", help="the unquantized HF checkpoint (for hf-bf16)")
    ap.add_argument("--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=0)
    ap.add_argument("--save", help="write the reference's log-probabilities here (lily LogProbFile)")
    ap.add_argument("--paths", default="reference,hf-bf16,mlx")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer
    import transformers_goldens

    text = open(args.file, encoding="utf-8").read()
    ids = Tokenizer.from_file(os.path.join(args.mlx, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    chunks = chunk_ids(ids, args.ctx, args.chunks)
    vocab = json.load(open(os.path.join(args.mlx, "config.json")))["text_config"]["vocab_size"]
    print(f"{args.file}: {len(ids)} tokens, {len(chunks)} chunks of {args.ctx}", file=sys.stderr)

    model = transformers_goldens.build_model(args.mlx, "cpu", torch.float32, "eager")
    ref = torch_run("reference", model, chunks, args.ctx, vocab)
    del model
    if args.save:
        ref.save(args.save)
    print(json.dumps({"path": "transformers f32, dequantized 4-bit (reference)", **ref.ppl()}), flush=True)
    for path in args.paths.split(","):
        if path == "reference":
            continue
        if path == "hf-bf16":
            if not args.hf:
                raise SystemExit("hf-bf16 needs --hf")
            run = torch_run(path, hf_bf16_model(args.hf), chunks, args.ctx, vocab)
            label = "transformers bf16, unquantized"
        elif path == "mlx":
            run = mlx_run(args.mlx, chunks, args.ctx, vocab)
            label = "mlx-lm 4-bit (CPU)"
        else:
            raise SystemExit(f"unknown path {path}")
        print(json.dumps({"path": label, **run.ppl(), "against": divergence(ref, run)}), flush=True)


if __name__ == "__main__":
    main()
