#!/usr/bin/env python3
"""MLX-LM arm of the peer benchmark: mlx_lm.generate.generate_step on a Lily checkpoint, loaded
unchanged with mlx_lm.load, timed exactly as the seed contract's bench_mlx.py:

* prompt token i = ((i*2654435761) mod 2^32) mod vocab_size (text_config), batch 1, greedy
  (generate_step's default sampler: argmax of the logprobs);
* warmup: one generate_step run of the exact prompt for 1 token, drained with
  mx.synchronize(generation_stream), then mx.clear_cache() and mx.reset_peak_memory();
* measured: generate_step(max_tokens = steps + 1); prefill = time to the first yield; decode =
  the next `steps` inter-yield intervals; the scheduled lookahead is drained with
  mx.synchronize(generation_stream) after the timer stops;
* digest: 64-bit FNV-1a over whole u32 values of yields 1..steps (the first yield is
  `first_token_id`).

Prints one JSON line with lily-bench's field names (engine "mlx-lm").

    python bench/mlx_arm.py --model DIR --prompt-len 4096 [--decode-steps 64] [--json-out F]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, make_record, prompt_tokens, text_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.prompt_len <= 0 or args.decode_steps <= 0:
        raise SystemExit("--prompt-len and --decode-steps must be positive")

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load
    from mlx_lm.generate import generate_step, generation_stream

    model, _tokenizer = load(args.model)
    vocab = text_config(args.model)["vocab_size"]
    prompt = mx.array(prompt_tokens(args.prompt_len, vocab), dtype=mx.uint32)

    if not args.no_warmup:
        for _ in generate_step(prompt, model, max_tokens=1):
            pass
        mx.synchronize(generation_stream)
        mx.clear_cache()
        mx.reset_peak_memory()

    steps = args.decode_steps
    gen = generate_step(prompt, model, max_tokens=steps + 1)
    t0 = time.perf_counter()
    first, _ = next(gen)
    t_first = time.perf_counter()
    tokens, intervals = [], []
    last = t_first
    for _ in range(steps):
        tok, _ = next(gen)
        now = time.perf_counter()
        tokens.append(int(tok))
        intervals.append(now - last)
        last = now
    decode_secs = last - t_first
    gen.close()
    mx.synchronize(generation_stream)  # drain the unused lookahead outside the timer

    rec = make_record(
        "mlx-lm", f"mlx {mx.__version__} {mx.default_device()}", args.model, args.prompt_len, steps,
        not args.no_warmup, t_first - t0, first, intervals, tokens, decode_secs=decode_secs,
        decode_mode="mlx_lm.generate_step_inter_yield_async_eval",
        versions={"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        peak_memory_bytes=int(mx.get_peak_memory()),
    )
    emit(rec, args.json_out)


if __name__ == "__main__":
    main()
