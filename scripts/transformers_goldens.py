#!/usr/bin/env python3
"""Reference outputs of HF transformers' Qwen3_5MoeForCausalLM on a Lily MLX 4-bit checkpoint.

The MLX weights are dequantized exactly (w = scale*q + bias, in f32), converted back to the HF
layout (norms un-shifted by 1, conv1d to [C,1,K], switch_mlp -> fused experts), and the model is
run in float32 with eager attention. Outputs:

  * teacher-forced logits for a 64-token prompt (every position): the top-20 ids/values and the
    logits of a fixed probe set of ids, plus the full-row logsumexp;
  * a 32-token greedy continuation (the model's forward with its cache: chunked GDN for the
    prompt, recurrent steps after) with the top-5 logits of each step.

Generated once and committed (tests/goldens/tiny_transformers.json); the Rust test rebuilds the
same checkpoint with `lily synth --preset tiny --seed 0` and compares.

    cargo run --release -- synth --preset tiny --seed 0 --out /tmp/tiny
    python scripts/transformers_goldens.py --model /tmp/tiny --out tests/goldens/tiny_transformers.json

Needs torch and transformers>=5.17 (a CPU torch is enough; the tiny model runs in seconds).
"""
import argparse
import json
import os

import torch
from safetensors import safe_open
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

PROMPT_LEN = 64
GEN_LEN = 32
TOPK = 20
PROBES = 256
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def prompt_ids(n, vocab):
    # The lily-bench contract's token formula, kept below the special-token range.
    return [((i * 2654435761) % 2**32) % min(vocab, 248044) for i in range(n)]


def probe_ids(vocab):
    return sorted({(j * 7919 * 104729 + 12345) % vocab for j in range(PROBES)})


def load_tensors(model_dir):
    idx_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        files = sorted(set(json.load(open(idx_path))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(os.path.join(model_dir, f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def dequantize(w, scales, biases, group, device="cpu"):
    """MLX affine: codes packed LSB-first into uint32 along the input dim (computed in f32)."""
    w = w.to(device).to(torch.int64) & 0xFFFFFFFF
    scales, biases = scales.to(device), biases.to(device)
    in_words = w.shape[-1]
    groups = scales.shape[-1]
    cols = groups * group
    bits = in_words * 32 // cols
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=w.device) * bits
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*w.shape[:-1], cols).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group, dim=-1)
    b = biases.to(torch.float32).repeat_interleave(group, dim=-1)
    return s * codes + b


def to_hf_state(tensors, group, device="cpu", dtype=torch.float32):
    state = {}
    bases = {k[: -len(".weight")] for k in tensors if k.endswith(".weight") and k[: -len(".weight")] + ".scales" in tensors}
    for k, t in tensors.items():
        if k.startswith(("vision_tower.", "mtp.")):
            continue
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base in bases:
            t = dequantize(t, tensors[base + ".scales"], tensors[base + ".biases"], group, device)
        else:
            t = t.to(device).to(torch.float32)
        name = k.replace("language_model.model.", "model.").replace("language_model.lm_head", "lm_head")
        if name.endswith(ZERO_CENTRED) or name == "model.norm.weight":
            t = t - 1.0  # MLX stores 1+w; HF adds the 1 back
        if name.endswith("conv1d.weight") and t.shape[-1] == 1:
            t = t.permute(0, 2, 1).contiguous()  # MLX [C,K,1] -> HF [C,1,K]
        state[name] = t if name.endswith("A_log") else t.to(dtype)
    # switch_mlp.{gate,up,down}_proj -> experts.gate_up_proj / experts.down_proj
    for name in list(state):
        if name.endswith("mlp.switch_mlp.gate_proj.weight"):
            p = name[: -len("switch_mlp.gate_proj.weight")]
            gate = state.pop(name)
            up = state.pop(p + "switch_mlp.up_proj.weight")
            down = state.pop(p + "switch_mlp.down_proj.weight")
            state[p + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            state[p + "experts.down_proj"] = down.contiguous()
    return state


# The text_config fields that Qwen3_5MoeTextConfig takes from a Lily / MLX config.json.
CONFIG_KEYS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "rope_parameters", "full_attention_interval",
    "attn_output_gate", "tie_word_embeddings",
]


def build_model(model_dir, device, dtype, attn):
    """Qwen3_5MoeForCausalLM holding the dequantized weights of a Lily checkpoint, on `device`,
    in `dtype` (A_log stays float32), with attention implementation `attn`."""
    cfg_json = json.load(open(os.path.join(model_dir, "config.json")))
    tc = cfg_json["text_config"]
    group = cfg_json["quantization"]["group_size"]
    config = Qwen3_5MoeTextConfig(**{k: tc[k] for k in CONFIG_KEYS if k in tc})
    config._attn_implementation = attn
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    state = to_hf_state(load_tensors(model_dir), group, device, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing={missing[:8]} unexpected={unexpected[:8]}")
    del state
    # Buffers (rotary inv_freq) were created on meta: rebuild them on the device.
    for mod in model.modules():
        if getattr(mod, "inv_freq", None) is not None and mod.inv_freq.is_meta:
            inv, _ = mod.compute_default_rope_parameters(mod.config, torch.device(device))
            mod.inv_freq = inv
            mod.original_inv_freq = inv.clone()
    return model.to(device).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed-note", default="lily synth --preset tiny --seed 0")
    ap.add_argument("--positions", type=int, default=PROMPT_LEN, help="teacher-forced prompt length")
    ap.add_argument("--greedy", type=int, default=GEN_LEN, help="greedy continuation length (0: none)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    model = build_model(args.model, args.device, dtype, "eager")
    vocab = model.config.vocab_size
    ids = prompt_ids(args.positions, vocab)
    probes = probe_ids(vocab)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=args.device)).logits[0].to(torch.float32)  # [T, V]
        positions = []
        for t in range(args.positions):
            row = logits[t]
            top = torch.topk(row, TOPK)
            positions.append({
                "top_ids": top.indices.tolist(),
                "top_logits": top.values.tolist(),
                "probe_logits": row[probes].tolist(),
                "logsumexp": float(torch.logsumexp(row.double(), 0)),
            })
        # Greedy decode with the model's own cache (chunked GDN for the prompt, recurrent
        # steps after). A manual loop, not model.generate: in transformers 5.17 generate()
        # on this model diverged from both its teacher-forced logits and this cached forward
        # from the second token on, while those two agree with each other.
        out = model(torch.tensor([ids], device=args.device), use_cache=True)
        cache = out.past_key_values
        row = out.logits[0, -1].to(torch.float32)
        new, steps = [], []
        for _ in range(args.greedy):
            top = torch.topk(row, 5)
            steps.append({"top_ids": top.indices.tolist(), "top_logits": top.values.tolist()})
            nxt = int(torch.argmax(row))
            new.append(nxt)
            out = model(torch.tensor([[nxt]], device=args.device), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1].to(torch.float32)

    import transformers
    out = {
        "source": f"transformers {transformers.__version__} Qwen3_5MoeForCausalLM, {args.dtype} on {args.device}, eager attention, on the dequantized MLX weights",
        "checkpoint": args.seed_note,
        "prompt_ids": ids,
        "probe_ids": probes,
        "positions": positions,
        "greedy_ids": new,
        "greedy_steps": steps,
    }
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"wrote {args.out}: {args.positions} positions, greedy {new[:8]}...")


if __name__ == "__main__":
    main()
