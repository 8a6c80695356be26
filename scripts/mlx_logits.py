#!/usr/bin/env python3
"""Teacher-forced logits of mlx-lm on a Lily checkpoint, in the JSON format of
`lily logits` / scripts/transformers_goldens.py (compare with scripts/compare_logits.py).

Loading the checkpoint with `mlx_lm.load` unchanged is itself the check that `lily synth` writes
the real mlx-community layout. Runs on mlx's CPU backend (`pip install "mlx[cpu]" mlx-lm`) or its
CUDA backend.

    python scripts/mlx_logits.py --model DIR --positions 64 --out mlx.json
"""
import argparse
import json

import mlx.core as mx
from mlx_lm import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--out", required=True)
    ap.add_argument("--float32", action="store_true", help="cast every parameter (incl. quantization scales/biases) to float32 first")
    args = ap.parse_args()
    model, _tokenizer = load(args.model)
    if args.float32:
        # Exact for bf16 scales/biases; isolates mlx-lm's semantics from its bf16 numerics.
        model.set_dtype(mx.float32)
    cfg = json.load(open(f"{args.model}/config.json"))["text_config"]
    vocab = cfg["vocab_size"]
    ids = [((i * 2654435761) % 2**32) % min(vocab, 248044) for i in range(args.positions)]
    probes = sorted({(j * 7919 * 104729 + 12345) % vocab for j in range(256)})
    logits = model(mx.array([ids]))[0].astype(mx.float32)  # [T, V]
    mx.eval(logits)
    rows = []
    for t in range(args.positions):
        row = logits[t]
        top = mx.argsort(-row)[:20]
        rows.append({
            "top_ids": top.tolist(),
            "top_logits": row[top].tolist(),
            "probe_logits": row[mx.array(probes)].tolist(),
            "logsumexp": float(mx.logsumexp(row)),
        })
    import mlx_lm
    prec = "float32" if args.float32 else "native (bf16)"
    out = {"source": f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}, {mx.default_device()}, {prec})", "checkpoint": args.model,
           "prompt_ids": ids, "probe_ids": probes, "positions": rows}
    json.dump(out, open(args.out, "w"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
