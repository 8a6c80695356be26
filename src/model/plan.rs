//! Weights of one qwen3_5_moe model, grouped per layer, borrowed from the mapped checkpoint.
//! Float vectors (norms, conv taps, gates) are small and converted to f32 here once; quantized
//! matrices stay in their MLX layout and are read directly by the backends.

use crate::checkpoint::layout::{LM_HEAD, MODEL_PREFIX};
use crate::checkpoint::store::QuantTensor;
use crate::checkpoint::{Checkpoint, LayerKind, ModelConfig};
use anyhow::Result;

/// Gated DeltaNet weights of one layer.
pub struct GdnWeights {
    /// `[q | k | v]` projection, `conv_dim` rows.
    pub in_qkv: QuantTensor,
    pub in_z: QuantTensor,
    pub in_b: QuantTensor,
    pub in_a: QuantTensor,
    /// Depthwise conv taps, tap-major `[K][conv_dim]`; tap K-1 multiplies the current token.
    pub conv_taps: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// `-exp(A_log)` per value head (the log-decay factor).
    pub neg_a: Vec<f32>,
    /// Gated RMSNorm gain (plain, not zero-centred).
    pub norm: Vec<f32>,
    pub out: QuantTensor,
}

/// Gated attention weights of one layer.
pub struct AttentionWeights {
    /// Per head: `head_dim` query rows then `head_dim` gate rows.
    pub q: QuantTensor,
    pub k: QuantTensor,
    pub v: QuantTensor,
    pub o: QuantTensor,
    /// Gains as stored by MLX (already `1 + w`).
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub enum MixerWeights {
    Gdn(GdnWeights),
    Attention(AttentionWeights),
}

/// Sparse MoE block: router, stacked experts (expert e owns rows `e*out..(e+1)*out`), shared
/// expert with its sigmoid gate.
pub struct MoeWeights {
    pub router: QuantTensor,
    pub gate_exps: QuantTensor,
    pub up_exps: QuantTensor,
    pub down_exps: QuantTensor,
    pub shared_gate: QuantTensor,
    pub shared_up: QuantTensor,
    pub shared_down: QuantTensor,
    pub shared_expert_gate: QuantTensor,
}

pub struct LayerWeights {
    /// Gains as stored by MLX (already `1 + w`).
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: MixerWeights,
    pub moe: MoeWeights,
}

pub struct ModelWeights {
    pub config: ModelConfig,
    pub embed: QuantTensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: QuantTensor,
}

impl ModelWeights {
    pub fn from_checkpoint(ck: &Checkpoint) -> Result<Self> {
        let cfg = ck.config.clone();
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let p = format!("{MODEL_PREFIX}layers.{i}.");
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    let la = format!("{p}linear_attn.");
                    let conv_dim = cfg.gdn_conv_dim();
                    let k = cfg.linear_conv_kernel_dim;
                    // Stored [C, K, 1] (MLX) or [C, 1, K] (HF): both are C-major with K taps
                    // contiguous, so element (c, t) is at c*K + t either way.
                    let raw = ck.float(&format!("{la}conv1d.weight"))?;
                    let mut conv_taps = vec![0.0; k * conv_dim];
                    for c in 0..conv_dim {
                        for t in 0..k {
                            conv_taps[t * conv_dim + c] = raw[c * k + t];
                        }
                    }
                    let neg_a = ck.float(&format!("{la}A_log"))?.iter().map(|a| -a.exp()).collect();
                    MixerWeights::Gdn(GdnWeights {
                        in_qkv: ck.quantized(&format!("{la}in_proj_qkv"))?,
                        in_z: ck.quantized(&format!("{la}in_proj_z"))?,
                        in_b: ck.quantized(&format!("{la}in_proj_b"))?,
                        in_a: ck.quantized(&format!("{la}in_proj_a"))?,
                        conv_taps,
                        dt_bias: ck.float(&format!("{la}dt_bias"))?,
                        neg_a,
                        norm: ck.float(&format!("{la}norm.weight"))?,
                        out: ck.quantized(&format!("{la}out_proj"))?,
                    })
                }
                LayerKind::FullAttention => {
                    let sa = format!("{p}self_attn.");
                    MixerWeights::Attention(AttentionWeights {
                        q: ck.quantized(&format!("{sa}q_proj"))?,
                        k: ck.quantized(&format!("{sa}k_proj"))?,
                        v: ck.quantized(&format!("{sa}v_proj"))?,
                        o: ck.quantized(&format!("{sa}o_proj"))?,
                        q_norm: ck.float(&format!("{sa}q_norm.weight"))?,
                        k_norm: ck.float(&format!("{sa}k_norm.weight"))?,
                    })
                }
            };
            let m = format!("{p}mlp.");
            layers.push(LayerWeights {
                input_norm: ck.float(&format!("{p}input_layernorm.weight"))?,
                post_norm: ck.float(&format!("{p}post_attention_layernorm.weight"))?,
                mixer,
                moe: MoeWeights {
                    router: ck.quantized(&format!("{m}gate"))?,
                    gate_exps: ck.quantized(&format!("{m}switch_mlp.gate_proj"))?,
                    up_exps: ck.quantized(&format!("{m}switch_mlp.up_proj"))?,
                    down_exps: ck.quantized(&format!("{m}switch_mlp.down_proj"))?,
                    shared_gate: ck.quantized(&format!("{m}shared_expert.gate_proj"))?,
                    shared_up: ck.quantized(&format!("{m}shared_expert.up_proj"))?,
                    shared_down: ck.quantized(&format!("{m}shared_expert.down_proj"))?,
                    shared_expert_gate: ck.quantized(&format!("{m}shared_expert_gate"))?,
                },
            });
        }
        Ok(ModelWeights {
            embed: ck.quantized(&format!("{MODEL_PREFIX}embed_tokens"))?,
            final_norm: ck.float(&format!("{MODEL_PREFIX}norm.weight"))?,
            lm_head: ck.quantized(LM_HEAD)?,
            layers,
            config: cfg,
        })
    }
}
