#!/usr/bin/env python3
"""Trains the fixture model: a Qwen3_5MoeForCausalLM with exactly the architecture of Lily's tiny
preset (`ModelConfig::tiny()`), the real 248,320-token vocabulary and Lily's tokenizer, on the
Python sources of Debian's libpython3.11-stdlib (its top-level modules), deterministically on one CPU thread.

Why: random weights give flat, chaotic distributions, so accuracy numbers on them cannot tell a
rounding difference from a bug (issue 21). This model has real, peaked distributions.

The 248K vocabulary is made cheap by training only the rows of tokens the corpus contains: the
model is built with a compact vocabulary of the U used ids, and the full-vocabulary softmax is
computed exactly, since every unused token's logit is exactly 0 (its lm_head row is zero):
    logsumexp(full) = logaddexp(logsumexp(used logits), log(V - U)).
At the end the compact embedding and head are scattered into V x hidden matrices that are zero
elsewhere, so the unused rows stay exactly zero (and the 4-bit file compresses).

Outputs (--out DIR):
  hf/            the HF-format checkpoint: config.json (Qwen3_5MoeForConditionalGeneration, text
                 config = the tiny preset), model.safetensors (bf16, official names
                 `model.language_model.*` and `lm_head.weight`, fused experts), tokenizer files
  compact.safetensors  the same weights with only the used rows of embed/lm_head (see
                 `write_compact`; what the repository commits); `expand_compact` rebuilds hf/
  heldout.txt    the held-out split (raw text, as `lily perplexity --file` reads it)
  fixture.json   metadata: python and corpus versions, sha256s, hyper-parameters, PPLs

Usage:
  python3 scripts/train_fixture.py --tokenizer DIR_WITH_tokenizer.json --out /tmp/fixture
  python3 scripts/train_fixture.py --expand tests/fixtures/qwen-fixture/compact.safetensors \
      --tokenizer DIR --out /tmp/fixture-hf     # rebuild the full HF directory only
"""
import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time

import torch
import torch.nn.functional as F

VOCAB = 248_320
HIDDEN = 128
STDLIB = "/usr/lib/python3.11"
# Bytes of source taken (train + held out), in sorted file order.
CORPUS_BYTES = 1_300_000
# The last tenth of every file's lines is held out.
HELDOUT_FRACTION = 0.1
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def text_config(vocab):
    """The tiny preset's text config (src/checkpoint/config.rs ModelConfig::tiny), vocabulary `vocab`."""
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return dict(
        model_type="qwen3_5_moe_text",
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        layer_types=layer_types,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        attn_output_gate=True,
        attention_bias=False,
        attention_dropout=0.0,
        partial_rotary_factor=0.25,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        max_position_embeddings=262_144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        router_aux_loss_coef=0.001,
        tie_word_embeddings=False,
        bos_token_id=248044,
        eos_token_id=248044,
        dtype="bfloat16",
    )


def hf_config_json():
    """config.json of the HF checkpoint, shaped like the official Qwen3.6-35B-A3B one (multimodal
    wrapper, text_config); the fixture has no vision weights."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "eos_token_id": [248046, 248044],
        "dtype": "bfloat16",
        "text_config": text_config(VOCAB),
    }


def build_model(vocab):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text_config(vocab).items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    cfg.output_router_logits = True
    return Qwen3_5MoeForCausalLM(cfg)


# ---------------------------------------------------------------------------------------------
# Corpus


def corpus_files(root):
    """The top-level modules of the standard library (no packages), sorted by name."""
    return sorted(f for f in os.listdir(root) if f.endswith(".py") and os.path.isfile(os.path.join(root, f)))


def split_corpus(root):
    """(train_texts, heldout_texts), in sorted file order, until CORPUS_BYTES: each file as
    `# <name>\n<source>`, its last HELDOUT_FRACTION of lines held out (`# <name> (end)\n...`).
    Holding out the end of every file keeps the held-out text in the training text's
    vocabulary (a whole held-out module would bring identifiers the model never saw), while no
    held-out line is ever trained on. The byte budget keeps the used vocabulary, and so the
    committed fixture, small; training sees each token about twice in its step budget anyway."""
    train, held, total = [], [], 0
    for rel in corpus_files(root):
        with open(os.path.join(root, rel), "rb") as fh:
            raw = fh.read()
        try:
            src = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if total + len(raw) > CORPUS_BYTES:
            break
        total += len(raw)
        lines = src.splitlines(keepends=True)
        cut = len(lines) - int(len(lines) * HELDOUT_FRACTION)
        head, tail = "".join(lines[:cut]), "".join(lines[cut:])
        train.append(f"# {rel}\n{head}")
        if tail:
            held.append(f"# {rel} (end)\n{tail}" + ("" if tail.endswith("\n") else "\n"))
    return train, held


def sha256(b):
    return hashlib.sha256(b).hexdigest()


# ---------------------------------------------------------------------------------------------
# Loss over the full vocabulary from the compact one


def full_vocab_nll(logits, targets, unused):
    """Per-position NLL under the full-vocabulary softmax: the `unused` tokens have logit 0."""
    logits = logits.float()
    lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), torch.tensor(math.log(unused)))
    return lse - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def embed_with_zero_rows(model, ids):
    """Input embeddings of compact ids where -1 (a token without a row) embeds as zeros, as its
    zero row in the full checkpoint does."""
    ids = torch.as_tensor(ids)
    e = model.get_input_embeddings()(ids.clamp(min=0))
    return e * (ids >= 0).unsqueeze(-1).to(e.dtype)


def chunked_eval(model, ids, ctx, max_chunks=0):
    """Mean NLL the way `lily perplexity` scores (chunks of ctx, predictions of tokens
    ctx/2+1 .. ctx-1 of each chunk), under the full-vocabulary softmax; a target without a row
    (-1) has logit exactly 0."""
    unused = VOCAB - model.config.vocab_size
    n = len(ids) // ctx
    if max_chunks:
        n = min(n, max_chunks)
    tot, cnt = 0.0, 0
    model.eval()
    with torch.no_grad():
        for c in range(n):
            x = torch.tensor([ids[c * ctx:(c + 1) * ctx]])
            logits = model(inputs_embeds=embed_with_zero_rows(model, x)).logits[0].float()
            first = ctx // 2
            tgt = x[0, first + 1:]
            lg = logits[first:ctx - 1]
            lse = torch.logaddexp(torch.logsumexp(lg, dim=-1), torch.tensor(math.log(unused)))
            true = torch.where(tgt >= 0, lg.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros(()))
            nll = lse - true
            tot += float(nll.double().sum())
            cnt += nll.numel()
    model.train()
    return tot / max(cnt, 1), cnt


def unigram_nll(train_ids, held_ids, ctx):
    """Add-one (Laplace) unigram over the full vocabulary, fitted on the training split, scored on
    the same held-out positions as the model."""
    counts = torch.bincount(torch.tensor(train_ids), minlength=VOCAB).double()
    logp = torch.log((counts + 1.0) / (counts.sum() + VOCAB))
    n = len(held_ids) // ctx
    scored = []
    for c in range(n):
        chunk = held_ids[c * ctx:(c + 1) * ctx]
        scored.extend(chunk[ctx // 2 + 1:ctx])
    return float(-logp[torch.tensor(scored)].mean()), len(scored)


# ---------------------------------------------------------------------------------------------
# Checkpoint writing


def hf_state(model, used):
    """The compact model's weights under the official HF names, bf16, with embed/lm_head
    scattered into full V x hidden matrices (zero rows for unused tokens)."""
    out = {}
    idx = torch.tensor(used)
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.bfloat16)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
            full[idx] = t
            t = full
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        out[name] = t.contiguous()
    return out


def write_compact(state, used, path):
    """Everything but the two vocabulary matrices as in the HF file, those as their used rows
    (`fixture.embed_rows`, `fixture.lm_head_rows`) with the ids (`fixture.used_ids`, I32)."""
    from safetensors.torch import save_file

    idx = torch.tensor(used)
    compact = {k: v for k, v in state.items() if k not in ("model.language_model.embed_tokens.weight", "lm_head.weight")}
    compact["fixture.used_ids"] = idx.to(torch.int32)
    compact["fixture.embed_rows"] = state["model.language_model.embed_tokens.weight"][idx].contiguous()
    compact["fixture.lm_head_rows"] = state["lm_head.weight"][idx].contiguous()
    save_file(compact, path, metadata={"format": "pt", "lily_fixture": "compact"})


def expand_compact(path):
    from safetensors.torch import load_file

    c = load_file(path)
    idx = c.pop("fixture.used_ids").to(torch.int64)
    for src, dst in (("fixture.embed_rows", "model.language_model.embed_tokens.weight"), ("fixture.lm_head_rows", "lm_head.weight")):
        full = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
        full[idx] = c.pop(src)
        c[dst] = full
    return c


def write_hf_dir(state, out_dir, tokenizer_dir):
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    # Sorted names, as save_pretrained writes them.
    save_file({k: state[k] for k in sorted(state)}, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_config_json(), fh, indent=2)
        fh.write("\n")
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="directory with Lily's tokenizer files (`lily synth --preset tiny` writes them)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--expand", help="only rebuild the HF directory from this compact.safetensors")
    ap.add_argument("--stdlib", default=STDLIB)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-coef", type=float, default=0.05, help="router load-balancing loss weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=512, help="held-out evaluation chunking (as lily perplexity)")
    args = ap.parse_args()

    if args.expand:
        write_hf_dir(expand_compact(args.expand), args.out, args.tokenizer)
        print(f"wrote {args.out}")
        return

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    train_docs, held_docs = split_corpus(args.stdlib)
    train_text, held_text = "".join(train_docs), "".join(held_docs)
    # Lily tokenizes the held-out file as one text; so do we (same ids as `lily perplexity`).
    held_ids = tok.encode(held_text, add_special_tokens=False).ids
    train_ids = []
    for d in train_docs:
        train_ids.extend(tok.encode(d, add_special_tokens=False).ids)
    # Only tokens the training text contains get rows; held-out tokens it lacks keep zero rows
    # (logit exactly 0, like every other unused token).
    used = sorted(set(train_ids))
    U = len(used)
    remap = torch.full((VOCAB,), -1, dtype=torch.int64)
    remap[torch.tensor(used)] = torch.arange(U)
    train_c = remap[torch.tensor(train_ids)]
    held_c = remap[torch.tensor(held_ids)].tolist()  # -1: a token without a row
    print(f"corpus: {len(train_docs)} train files ({len(train_text.encode())} bytes, {len(train_ids)} tokens), "
          f"{len(held_docs)} held-out ({len(held_text.encode())} bytes, {len(held_ids)} tokens), {U} used ids", flush=True)

    model = build_model(U)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    )
    gen = torch.Generator().manual_seed(args.seed)
    unused = VOCAB - U
    t0 = time.time()
    log = []
    for step in range(args.steps):
        starts = torch.randint(0, len(train_c) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train_c[s:s + args.seq] for s in starts.tolist()])
        y = torch.stack([train_c[s + 1:s + args.seq + 1] for s in starts.tolist()])
        out = model(input_ids=x, output_router_logits=True)
        lm = full_vocab_nll(out.logits, y, unused).mean()
        loss = lm + args.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step} loss {lm.item():.4f} aux {out.aux_loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} {el:.0f}s", flush=True)
            log.append({"step": step, "loss": round(lm.item(), 4), "aux": round(out.aux_loss.item(), 4)})
    train_secs = time.time() - t0

    # Expert use over the held-out text (load balance check).
    counts = torch.zeros(4, 8, dtype=torch.int64)
    with torch.no_grad():
        model.eval()
        out = model(inputs_embeds=embed_with_zero_rows(model, [held_c[:2048]]), output_router_logits=True)
        for li, rl in enumerate(out.router_logits):
            top = rl.topk(2, dim=-1).indices.flatten()
            counts[li] += torch.bincount(top, minlength=8)
    held_nll, scored = chunked_eval(model, held_c, args.ctx)
    uni_nll, uni_scored = unigram_nll(train_ids, held_ids, args.ctx)
    print(f"held-out PPL (compact model, f32, full-vocab softmax) {math.exp(held_nll):.3f} over {scored} tokens; "
          f"unigram (add-one, full vocabulary) {math.exp(uni_nll):.1f}", flush=True)
    print(f"expert use per layer (held-out, first 2048 tokens): {counts.tolist()}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    state = hf_state(model, used)
    write_hf_dir(state, os.path.join(args.out, "hf"), args.tokenizer)
    write_compact(state, used, os.path.join(args.out, "compact.safetensors"))
    with open(os.path.join(args.out, "heldout.txt"), "w") as fh:
        fh.write(held_text)
    import tokenizers
    import transformers

    meta = {
        "what": "Lily fixture model: Qwen3_5MoeForCausalLM with ModelConfig::tiny()'s architecture, trained by scripts/train_fixture.py",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "corpus": {
            "source": f"{args.stdlib}/*.py (top-level modules, sorted by name, the first {CORPUS_BYTES} bytes)",
            "package": "Debian libpython3.11-stdlib " + debian_version("libpython3.11-stdlib"),
            "train_files": len(train_docs),
            "heldout_files": len(held_docs),
            "train_bytes": len(train_text.encode()),
            "heldout_bytes": len(held_text.encode()),
            "train_sha256": sha256(train_text.encode()),
            "heldout_sha256": sha256(held_text.encode()),
            "train_tokens": len(train_ids),
            "heldout_tokens": len(held_ids),
            "used_ids": U,
            "heldout_tokens_without_rows": sum(1 for i in held_c if i < 0),
        },
        "training": {
            "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "aux_coef": args.aux_coef, "threads": 1, "seconds": round(train_secs, 1), "params_compact": n_params,
            "log": log,
        },
        "heldout": {
            "ctx": args.ctx, "scored_tokens": scored,
            "model_ppl_f32_compact": math.exp(held_nll),
            "unigram_ppl_add_one": math.exp(uni_nll),
        },
        "expert_use_heldout_2048": counts.tolist(),
        "hf_sha256": sha256(open(os.path.join(args.out, "hf", "model.safetensors"), "rb").read()),
    }
    with open(os.path.join(args.out, "fixture.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    print(json.dumps(meta["heldout"]), flush=True)


def debian_version(pkg):
    try:
        import subprocess

        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
