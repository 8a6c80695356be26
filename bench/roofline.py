"""Bytes and FLOPs per token of a qwen3_5_moe checkpoint (MLX affine 4-bit g64, 8-bit router and
shared-expert gate): the formulas of shared/reference/bench/bytes_per_token.py, parametrised by
config.json so that they also apply to the tiny synthetic checkpoint. For the 35B-A3B shapes this
gives 1.88 GB/token -> ~2,290 tok/s at 4.3 TB/s (decode) and ~150K tok/s at 790 TFLOP/s (prefill).
A decode step of B sequences reads the dense weights and each distinct expert once for all of
them, and every sequence's own state and KV (batch_decode_*).
"""

H200_BANDWIDTH = 4.3e12     # B/s, HBM3e as measured in reference/kernels.md
H200_BF16_FLOPS = 790e12    # dense bf16 GEMM rate measured on the H200 (kernels.md §4.3)
Q4 = 0.5 + 4 / 64
Q8 = 1 + 4 / 64


def _dims(tc):
    H, V = tc["hidden_size"], tc["vocab_size"]
    lt = tc["layer_types"]
    NG = sum(t == "linear_attention" for t in lt)
    NA = len(lt) - NG
    return dict(H=H, V=V, NG=NG, NA=NA, L=len(lt), E=tc["num_experts"], K=tc["num_experts_per_tok"],
                MI=tc["moe_intermediate_size"], SI=tc["shared_expert_intermediate_size"],
                nk=tc["linear_num_key_heads"], nv=tc["linear_num_value_heads"], dk=tc["linear_key_head_dim"],
                dv=tc["linear_value_head_dim"], ck=tc["linear_conv_kernel_dim"], nh=tc["num_attention_heads"],
                nkv=tc["num_key_value_heads"], hd=tc["head_dim"])


def decode_bytes_per_token(tc, ctx):
    return batch_decode_bytes_per_step(tc, ctx, 1)


def experts_touched(tc, batch):
    """Expected distinct routed experts a layer reads in one step of `batch` tokens, each token
    picking K of E (uniform, independent routing: the synthetic checkpoint's random router)."""
    d = _dims(tc)
    return d["E"] * (1 - (1 - d["K"] / d["E"]) ** batch)


def batch_decode_bytes_per_step(tc, ctx, batch):
    """Bytes one decode step of `batch` sequences (each at context `ctx`) moves: the dense weights
    and the distinct experts once, each sequence's Gated DeltaNet state and conv ring read and
    written, its KV read. batch = 1 is the single-stream decode (K experts per layer)."""
    d = _dims(tc)
    H, V, NG, NA, E, K, MI, SI = (d[k] for k in ("H", "V", "NG", "NA", "E", "K", "MI", "SI"))
    conv_ch = 2 * d["nk"] * d["dk"] + d["nv"] * d["dv"]
    gdn_rows = conv_ch + d["nv"] * d["dv"] + 2 * d["nv"]
    gdn_b = gdn_rows * H * Q4 + H * d["nv"] * d["dv"] * Q4 + conv_ch * d["ck"] * 2 + d["nv"] * 4 + d["nv"] * 2 + d["dv"] * 4
    qkv_rows = d["nh"] * d["hd"] * 2 + 2 * d["nkv"] * d["hd"]
    attn_b = qkv_rows * H * Q4 + H * d["nh"] * d["hd"] * Q4 + 2 * d["hd"] * 2
    touched = K if batch == 1 else experts_touched(tc, batch)
    moe_b = E * H * Q8 + H * Q8 + touched * 3 * MI * H * Q4 + 3 * SI * H * Q4 + 2 * H * 2
    w_step = NG * (gdn_b + moe_b) + NA * (attn_b + moe_b) + V * H * Q4 + batch * H * Q4 + H * 2
    state = NG * d["nv"] * d["dk"] * d["dv"] * 4
    conv = NG * conv_ch * (d["ck"] - 1) * 2
    kv_pos = NA * 2 * d["nkv"] * d["hd"] * 2
    return w_step + batch * (2 * state + 2 * conv + kv_pos * ctx)


def prefill_flops_per_token(tc, prompt):
    d = _dims(tc)
    H = d["H"]
    conv_ch = 2 * d["nk"] * d["dk"] + d["nv"] * d["dv"]
    gdn_rows = conv_ch + d["nv"] * d["dv"] + 2 * d["nv"]
    qkv_rows = d["nh"] * d["hd"] * 2 + 2 * d["nkv"] * d["hd"]
    mm = (d["NG"] * (gdn_rows * H + H * d["nv"] * d["dv"]) + d["NA"] * (qkv_rows * H + H * d["nh"] * d["hd"])
          + d["L"] * (d["E"] * H + H + (d["K"] + 1) * 3 * d["MI"] * H))
    gdn_f = d["NG"] * d["nv"] * 2 * (3 * 64 * d["dk"] + 3 * d["dk"] * d["dv"])
    return 2 * mm + d["NA"] * 2 * 2 * d["nh"] * d["hd"] * prompt / 2 + gdn_f


def decode_roofline(tc, ctx, bandwidth=H200_BANDWIDTH):
    return bandwidth / decode_bytes_per_token(tc, ctx)


def batch_decode_roofline(tc, ctx, batch, bandwidth=H200_BANDWIDTH):
    """Aggregate tok/s bound of decoding `batch` sequences together at context `ctx`."""
    return batch * bandwidth / batch_decode_bytes_per_step(tc, ctx, batch)


def prefill_roofline(tc, prompt, flops=H200_BF16_FLOPS):
    return flops / prefill_flops_per_token(tc, prompt)
