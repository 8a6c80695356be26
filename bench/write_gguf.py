#!/usr/bin/env python3
"""Convert a Lily checkpoint (MLX affine 4-bit, as written by `lily synth`) into a GGUF of llama.cpp
arch `qwen35moe`, for the llama.cpp arm of the peer benchmark.

The MLX weights are dequantized exactly (scripts/transformers_goldens.py: w = scale*q + bias in f32,
norms un-shifted, conv1d and experts in the HF layout), then given llama.cpp's own qwen35moe
transforms (convert_hf_to_gguf.py, conversion/qwen.py, reference/model.md §4.3): norms +1 (not
linear_attn.norm), A_log -> -exp(A_log), conv1d squeezed, linear-attention V heads reordered
grouped->tiled (in_proj_qkv V rows, in_proj_z rows, in_proj_a/b rows, conv1d V channels, dt_bias,
A_log, out_proj input columns), experts.gate_up_proj split into ffn_gate_exps / ffn_up_exps. MTP and
vision tensors are dropped: block_count = num_hidden_layers and no nextn_predict_layers (llama.cpp's
converter writes block_count 41 / nextn_predict_layers 1 when config.json has mtp_num_hidden_layers,
even for a checkpoint without mtp.* tensors, as the tiny one is).

Tensor types follow convert_hf_to_gguf.py: 1-D tensors, *_norm.weight, ffn_gate_inp,
ffn_gate_inp_shexp, ssm_conv1d, ssm_a and ssm_dt.bias are F32; every other matrix gets --outtype:
  f32 | f16 | bf16 | q8_0 | q4_0   (quantized here with torch, on the GPU when there is one; the
  bytes equal gguf.quants' reference quantizers, see tests/bench/test_harness.py).
Q4_K_M cannot be produced by the gguf package (it has no K-quant quantizers): make it with
llama.cpp's `llama-quantize --allow-requantize MODEL-Q4_0.gguf MODEL-Q4_K_M.gguf Q4_K_M`
(bench/README.md), or from a q8_0/f16 GGUF where the disk allows.

Vocabulary: tokenizer.json of the checkpoint (byte-level BPE, `tokenizer.ggml.model = gpt2`,
`tokenizer.ggml.pre = qwen35`), padded to vocab_size with [PAD<id>] UNUSED tokens as the converter
does; merges and special ids via gguf.SpecialVocab.

    python bench/write_gguf.py --model DIR --out model-Q4_0.gguf --outtype q4_0 [--device cuda]

Needs torch, safetensors and gguf (use the gguf-py shipped in the llama-cpp-python sdist at
vendor/llama.cpp/gguf-py, or PyPI gguf>=0.17; the `attention.recurrent_layers` key is written by
hand when the package lacks add_recurrent_layers).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))

QK4_0 = 32
QK8_0 = 32


# ---------------------------------------------------------------- quantizers (torch, any device)
def quantize_q8_0(x):
    """ggml Q8_0 of a float tensor [..., n] (n % 32 == 0) -> uint8 numpy [..., n/32*34].
    Mirrors gguf.quants.Q8_0.quantize_blocks: d = amax/127 (f32), q = round-half-away(x/d)."""
    import torch
    x = x.to(torch.float32)
    shape = x.shape
    b = x.reshape(-1, QK8_0)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.sign(b * inv) * torch.floor(torch.abs(b * inv) + 0.5)  # np.round is half-even; gguf uses np_roundf
    out = torch.cat([d.to(torch.float16).view(torch.uint8).reshape(-1, 2), q.to(torch.int8).view(torch.uint8)], dim=-1)
    return out.reshape(*shape[:-1], shape[-1] // QK8_0 * 34).cpu().numpy()


def quantize_q4_0(x):
    """ggml Q4_0 -> uint8 numpy [..., n/32*18]. Mirrors gguf.quants.Q4_0.quantize_blocks: the
    signed value of largest magnitude maps to -8; d = max/-8; q = trunc(x/d + 8.5) clipped to 15;
    nibbles: low = element j, high = element j+16."""
    import torch
    x = x.to(torch.float32)
    shape = x.shape
    b = x.reshape(-1, QK4_0)
    imax = b.abs().argmax(dim=-1, keepdim=True)
    mx = torch.gather(b, -1, imax)
    d = mx / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    out = torch.cat([d.to(torch.float16).view(torch.uint8).reshape(-1, 2), qs], dim=-1)
    return out.reshape(*shape[:-1], shape[-1] // QK4_0 * 18).cpu().numpy()


# ---------------------------------------------------------------- qwen35moe tensor transforms
def reorder_v_heads(t, dim, num_k_heads, num_v_per_k, head_dim):
    """grouped-by-K-head -> tiled V-head order (llama.cpp _LinearAttentionVReorderBase._reorder_v_heads)."""
    shape = list(t.shape)
    dim = dim % len(shape)
    new_shape = shape[:dim] + [num_k_heads, num_v_per_k, head_dim] + shape[dim + 1:]
    t = t.reshape(*new_shape)
    perm = list(range(len(new_shape)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def gguf_tensors(name, t, tc):
    """HF-layout tensor (names as transformers_goldens.to_hf_state gives: model.layers.N.…) ->
    [(gguf_name, tensor)] with llama.cpp's qwen35moe transforms."""
    import torch
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    rv = nv // nk
    if name == "model.embed_tokens.weight":
        return [("token_embd.weight", t)]
    if name == "lm_head.weight":
        return [("output.weight", t)]
    if name == "model.norm.weight":
        return [("output_norm.weight", t + 1)]
    parts = name.split(".")
    assert parts[0] == "model" and parts[1] == "layers", name
    bid, rest = int(parts[2]), ".".join(parts[3:])
    p = f"blk.{bid}."
    simple = {
        "input_layernorm.weight": ("attn_norm.weight", 1), "post_attention_layernorm.weight": ("post_attention_norm.weight", 1),
        "self_attn.q_proj.weight": ("attn_q.weight", 0), "self_attn.k_proj.weight": ("attn_k.weight", 0),
        "self_attn.v_proj.weight": ("attn_v.weight", 0), "self_attn.o_proj.weight": ("attn_output.weight", 0),
        "self_attn.q_norm.weight": ("attn_q_norm.weight", 1), "self_attn.k_norm.weight": ("attn_k_norm.weight", 1),
        "linear_attn.norm.weight": ("ssm_norm.weight", 0), "mlp.gate.weight": ("ffn_gate_inp.weight", 0),
        "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", 0), "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", 0),
        "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", 0), "mlp.experts.down_proj": ("ffn_down_exps.weight", 0),
    }
    if rest in simple:
        n, add = simple[rest]
        return [(p + n, t + add if add else t)]
    if rest == "mlp.shared_expert_gate.weight":  # kept [1, H] (ne {H, 1}) as convert_hf_to_gguf.py does
        return [(p + "ffn_gate_inp_shexp.weight", t)]
    if rest == "mlp.experts.gate_up_proj":
        n_ff = t.shape[-2] // 2
        return [(p + "ffn_gate_exps.weight", t[..., :n_ff, :].contiguous()), (p + "ffn_up_exps.weight", t[..., n_ff:, :].contiguous())]
    if rest == "linear_attn.in_proj_qkv.weight":
        qk = 2 * nk * dk
        return [(p + "attn_qkv.weight", torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, nk, rv, dv)], 0))]
    if rest == "linear_attn.in_proj_z.weight":
        return [(p + "attn_gate.weight", reorder_v_heads(t, 0, nk, rv, dv))]
    if rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        n = "ssm_beta.weight" if "_b." in rest else "ssm_alpha.weight"
        return [(p + n, reorder_v_heads(t, 0, nk, rv, 1))]
    if rest == "linear_attn.conv1d.weight":
        c = t.reshape(t.shape[0], -1)  # [C,1,K] -> [C,K]
        qk = 2 * nk * dk
        return [(p + "ssm_conv1d.weight", torch.cat([c[:qk], reorder_v_heads(c[qk:], 0, nk, rv, dv)], 0))]
    if rest == "linear_attn.dt_bias":
        return [(p + "ssm_dt.bias", reorder_v_heads(t.reshape(-1, 1), 0, nk, rv, 1).reshape(-1))]
    if rest == "linear_attn.A_log":
        a = -torch.exp(t.to(torch.float32))
        return [(p + "ssm_a", reorder_v_heads(a.reshape(-1, 1), 0, nk, rv, 1).reshape(-1))]
    if rest == "linear_attn.out_proj.weight":
        return [(p + "ssm_out.weight", reorder_v_heads(t, 1, nk, rv, dv))]
    raise ValueError(f"no GGUF mapping for {name}")


F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def tensor_kind(gname, ndim, outtype, row_len):
    """The GGUF type of one tensor (convert_hf_to_gguf.py's rules)."""
    if ndim <= 1 or gname.endswith("_norm.weight") or gname.endswith(F32_SUFFIXES) or not gname.endswith(".weight"):
        return "f32"
    if outtype in ("q4_0", "q8_0") and row_len % 32 != 0:
        return "f16"
    return outtype


def encode(t, kind):
    """-> (numpy data, raw_dtype or None)."""
    import gguf
    import torch
    if kind == "f32":
        return t.to(torch.float32).cpu().numpy(), None
    if kind == "f16":
        return t.to(torch.float16).cpu().numpy(), None
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint8), gguf.GGMLQuantizationType.BF16
    if kind == "q8_0":
        return quantize_q8_0(t), gguf.GGMLQuantizationType.Q8_0
    if kind == "q4_0":
        return quantize_q4_0(t), gguf.GGMLQuantizationType.Q4_0
    raise ValueError(kind)


# ---------------------------------------------------------------- vocabulary and metadata
def add_vocab(w, model_dir, vocab_size):
    import gguf
    tj = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            c = added[i]["content"]
            looks_special = (c.startswith("<|") and c.endswith("|>")) or (c.startswith("<\uff5c") and c.endswith("\uff5c>"))
            # convert_hf_to_gguf.py: special or special-looking added tokens are CONTROL
            types.append(gguf.TokenType.CONTROL if added[i].get("special") or looks_special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    sv = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    sv.add_to_gguf(w)
    return sum(t == gguf.TokenType.NORMAL for t in types)


FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}


def add_metadata(w, tc, outtype, name):
    import gguf
    arch = "qwen35moe"
    n_layer = tc["num_hidden_layers"]
    w.add_name(name)
    w.add_block_count(n_layer)
    w.add_context_length(tc["max_position_embeddings"])
    w.add_embedding_length(tc["hidden_size"])
    w.add_head_count(tc["num_attention_heads"])
    w.add_head_count_kv(tc["num_key_value_heads"])
    w.add_key_length(tc["head_dim"])
    w.add_value_length(tc["head_dim"])
    rope = tc.get("rope_parameters", {})
    w.add_rope_freq_base(rope.get("rope_theta", 1e7))
    w.add_layer_norm_rms_eps(tc["rms_norm_eps"])
    w.add_expert_count(tc["num_experts"])
    w.add_expert_used_count(tc["num_experts_per_tok"])
    w.add_file_type(FILE_TYPES[outtype])
    w.add_expert_feed_forward_length(tc["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(tc["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(tc["linear_conv_kernel_dim"])
    w.add_ssm_state_size(tc["linear_key_head_dim"])
    w.add_ssm_group_count(tc["linear_num_key_heads"])
    w.add_ssm_time_step_rank(tc["linear_num_value_heads"])
    w.add_ssm_inner_size(tc["linear_value_head_dim"] * tc["linear_num_value_heads"])
    recurrent = [t == "linear_attention" for t in tc["layer_types"]]
    if hasattr(w, "add_recurrent_layers"):
        w.add_recurrent_layers(recurrent)
    else:
        w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(tc.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(tc["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def layer_groups(keys):
    """Checkpoint keys grouped so that each group holds whole layers (to_hf_state needs a layer's
    switch_mlp gate/up/down together); dequantizing group by group bounds the memory."""
    groups = {}
    for k in keys:
        if k.startswith(("vision_tower.", "mtp.")):
            continue
        p = k.split(".")
        key = int(p[3]) if len(p) > 3 and p[2] == "layers" else -1
        groups.setdefault(key, []).append(k)
    return [groups[g] for g in sorted(groups)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--outtype", default="q4_0", choices=sorted(FILE_TYPES))
    ap.add_argument("--device", default=None, help="dequantize/quantize on this torch device (default cuda if available)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()

    import gguf
    import torch
    import transformers_goldens as tg

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    tc, group = cfg["text_config"], cfg["quantization"]["group_size"]
    t0 = time.time()
    w = gguf.GGUFWriter(args.out, "qwen35moe")
    add_metadata(w, tc, args.outtype, args.name or f"lily-{os.path.basename(os.path.normpath(args.model))}")
    n_normal = add_vocab(w, args.model, tc["vocab_size"])

    tensors = tg.load_tensors(args.model)
    n, nbytes, kinds = 0, 0, {}
    for keys in layer_groups(tensors):
        sub = {k: tensors.pop(k) for k in keys}
        state = tg.to_hf_state(sub, group, device, torch.float32)
        for name in sorted(state):
            for gname, t in gguf_tensors(name, state[name], tc):
                kind = tensor_kind(gname, t.ndim, args.outtype, t.shape[-1])
                data, raw = encode(t, kind)
                if raw is None:
                    w.add_tensor(gname, data)
                else:
                    w.add_tensor(gname, data, raw_dtype=raw)
                n += 1
                nbytes += data.nbytes
                kinds[kind] = kinds.get(kind, 0) + 1
        del state, sub
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: {n} tensors ({kinds}), {nbytes / 1e9:.2f} GB of tensor data, {n_normal} BPE tokens, "
          f"outtype {args.outtype}, {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
