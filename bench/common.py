"""Shared pieces of the peer-benchmark arms: the measurement contract's prompt, digest and JSON line.

Every arm prints exactly one JSON line on stdout with the field names of `lily-bench`
(src/bin/lily-bench.rs): engine, backend, model, prompt_len, prompt_kind, decode_steps, warmup,
prefill{wall_secs, tok_s, first_token_id}, decode{wall_secs, tok_s, step_wall_secs, token_digest,
token_ids}. Python 3.10+ (the GPU machine has 3.12); no third-party imports here.
"""
import json
import os
import platform
import socket
import sys

PROMPT_KIND = "u32_golden_ratio_hash_mod_vocab"
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1


def prompt_tokens(n, vocab):
    """The contract's deterministic prompt: token i = ((i * 2654435761) mod 2^32) mod vocab."""
    return [((i * 2654435761) % (1 << 32)) % vocab for i in range(n)]


def fnv1a64(tokens):
    """64-bit FNV-1a over whole u32 token values (not bytes), as 16 lowercase hex digits."""
    h = FNV_OFFSET
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * FNV_PRIME) & MASK64
    return f"{h:016x}"


def text_config(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    return cfg.get("text_config", cfg)


def make_record(engine, backend, model, prompt_len, decode_steps, warmup, prefill_secs, first_token,
                step_secs, tokens, decode_secs=None, **extra):
    """One benchmark result with lily-bench's field names; validates the contract's invariants."""
    if len(step_secs) != decode_steps or len(tokens) != decode_steps:
        raise ValueError(f"expected {decode_steps} decode intervals/tokens, got {len(step_secs)}/{len(tokens)}")
    if decode_secs is None:
        decode_secs = float(sum(step_secs))
    for v in [prefill_secs, decode_secs, *step_secs]:
        if not (v > 0.0 and v < float("inf")):
            raise ValueError(f"non-finite or non-positive timing {v}")
    rec = {
        "schema_version": 1,
        "engine": engine,
        "backend": backend,
        "source_id": os.environ.get("LILY_BENCH_SOURCE_ID", "unknown"),
        "model": str(model),
        "prompt_len": prompt_len,
        "prompt_kind": PROMPT_KIND,
        "decode_steps": decode_steps,
        "warmup": bool(warmup),
        "prefill": {"wall_secs": prefill_secs, "tok_s": prompt_len / prefill_secs, "first_token_id": int(first_token)},
        "decode": {
            "wall_secs": decode_secs,
            "tok_s": decode_steps / decode_secs,
            "step_wall_secs": [float(s) for s in step_secs],
            "token_digest": fnv1a64(tokens),
            "token_ids": [int(t) for t in tokens],
        },
        "host": {"hostname": socket.gethostname(), "python": sys.version.split()[0], "platform": platform.platform()},
    }
    rec.update(extra)
    return rec


def emit(rec, json_out=None, label=None):
    text = json.dumps(rec)
    print(text, flush=True)
    print(f"{label or rec['engine']}: {rec['backend']} prompt {rec['prompt_len']} -> prefill {rec['prefill']['tok_s']:.1f} tok/s, "
          f"decode {rec['decode']['tok_s']:.2f} tok/s, digest {rec['decode']['token_digest']}", file=sys.stderr)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text + "\n")
