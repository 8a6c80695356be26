//! The exact tensor inventory of an MLX 4-bit `qwen3_5_moe` checkpoint (mlx-community layout),
//! derived from a [`ModelConfig`]. The loader checks a checkpoint against it; `lily synth`
//! writes it. One list, two users.

use super::config::{LayerKind, ModelConfig, GATE_BITS};

/// Prefix of every text-model tensor in the mlx-vlm conversion.
pub const MODEL_PREFIX: &str = "language_model.model.";
/// The untied output head.
pub const LM_HEAD: &str = "language_model.lm_head";

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
    U32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::U32 => "U32",
        }
    }
}

/// What one logical weight is.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightKind {
    /// An MLX affine-quantized linear map `[experts?, out, in]` stored as the triple
    /// `<name>.weight` (U32 `[.., out, in*bits/32]`), `<name>.scales` and `<name>.biases`
    /// (`[.., out, in/group]`).
    Quantized { experts: Option<usize>, out: usize, inp: usize, bits: usize },
    /// A float tensor stored under `name` exactly. `alt_shapes` lists accepted alternatives
    /// (conv1d is accepted in both the MLX `[C,K,1]` and the HF `[C,1,K]` orientation);
    /// `dtypes` lists accepted dtypes, the first being what `lily synth` writes.
    Float { shape: Vec<usize>, alt_shapes: Vec<Vec<usize>>, dtypes: Vec<DType> },
}

/// One logical weight of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightSpec {
    /// For quantized weights the base name (without `.weight`), else the full tensor name.
    pub name: String,
    pub kind: WeightKind,
    /// What the synthesizer should fill it with.
    pub init: Init,
}

/// How `lily synth` initialises a weight (chosen so activations stay O(1) through the network).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Gaussian with this standard deviation.
    Normal(f32),
    /// `center + uniform(-spread, spread)`.
    Around { center: f32, spread: f32 },
    /// Uniform in [lo, hi).
    Uniform { lo: f32, hi: f32 },
}

/// A stored tensor as it appears in the safetensors files.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl WeightSpec {
    /// The stored tensors of this weight, in the dtype/shape `lily synth` writes.
    pub fn stored(&self, group: usize) -> Vec<StoredTensor> {
        match &self.kind {
            WeightKind::Quantized { experts, out, inp, bits } => {
                let lead: Vec<usize> = experts.iter().copied().collect();
                let mk = |suffix: &str, dtype: DType, cols: usize| {
                    let mut shape = lead.clone();
                    shape.extend([*out, cols]);
                    StoredTensor { name: format!("{}.{suffix}", self.name), dtype, shape }
                };
                vec![mk("weight", DType::U32, inp * bits / 32), mk("scales", DType::BF16, inp / group), mk("biases", DType::BF16, inp / group)]
            }
            WeightKind::Float { shape, dtypes, .. } => {
                vec![StoredTensor { name: self.name.clone(), dtype: dtypes[0], shape: shape.clone() }]
            }
        }
    }

    /// Number of model parameters (logical elements).
    pub fn num_params(&self) -> usize {
        match &self.kind {
            WeightKind::Quantized { experts, out, inp, .. } => experts.unwrap_or(1) * out * inp,
            WeightKind::Float { shape, .. } => shape.iter().product(),
        }
    }
}

/// Every weight of the text model, in checkpoint order (embedding, layers, final norm, head).
pub fn expected_weights(cfg: &ModelConfig) -> Vec<WeightSpec> {
    let h = cfg.hidden_size;
    let bits = cfg.quant.bits;
    // Standard deviation that keeps a linear map's output at the scale of its input.
    let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
    let q = |name: String, out: usize, inp: usize, std: f32| WeightSpec {
        name,
        kind: WeightKind::Quantized { experts: None, out, inp, bits },
        init: Init::Normal(std),
    };
    let norm = |name: String, n: usize| WeightSpec {
        name,
        kind: WeightKind::Float { shape: vec![n], alt_shapes: vec![], dtypes: vec![DType::BF16, DType::F32] },
        // MLX stores 1+w for the zero-centred norms; real checkpoints sit near 1.
        init: Init::Around { center: 1.0, spread: 0.1 },
    };
    let mut out = Vec::new();
    out.push(q(format!("{MODEL_PREFIX}embed_tokens"), cfg.vocab_size, h, 1.0));
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let p = format!("{MODEL_PREFIX}layers.{i}.");
        out.push(norm(format!("{p}input_layernorm.weight"), h));
        match kind {
            LayerKind::LinearAttention => {
                let la = format!("{p}linear_attn.");
                let conv = cfg.gdn_conv_dim();
                let k = cfg.linear_conv_kernel_dim;
                let nv = cfg.linear_num_value_heads;
                out.push(q(format!("{la}in_proj_qkv"), conv, h, fan_in(h)));
                out.push(q(format!("{la}in_proj_z"), cfg.gdn_value_dim(), h, fan_in(h)));
                out.push(q(format!("{la}in_proj_b"), nv, h, fan_in(h)));
                out.push(q(format!("{la}in_proj_a"), nv, h, fan_in(h)));
                out.push(WeightSpec {
                    name: format!("{la}conv1d.weight"),
                    kind: WeightKind::Float { shape: vec![conv, k, 1], alt_shapes: vec![vec![conv, 1, k]], dtypes: vec![DType::BF16] },
                    init: Init::Normal(1.0 / (k as f32).sqrt()),
                });
                out.push(WeightSpec {
                    name: format!("{la}dt_bias"),
                    kind: WeightKind::Float { shape: vec![nv], alt_shapes: vec![], dtypes: vec![DType::BF16, DType::F32] },
                    init: Init::Around { center: 0.0, spread: 1.0 },
                });
                // Decay exp(-exp(A_log) softplus(.)) spread over fast and slow heads, as trained models have.
                out.push(WeightSpec {
                    name: format!("{la}A_log"),
                    kind: WeightKind::Float { shape: vec![nv], alt_shapes: vec![], dtypes: vec![DType::BF16, DType::F32] },
                    init: Init::Uniform { lo: -3.0, hi: 1.0 },
                });
                out.push(WeightSpec {
                    name: format!("{la}norm.weight"),
                    kind: WeightKind::Float { shape: vec![cfg.linear_value_head_dim], alt_shapes: vec![], dtypes: vec![DType::BF16, DType::F32] },
                    init: Init::Around { center: 1.0, spread: 0.1 },
                });
                out.push(q(format!("{la}out_proj"), h, cfg.gdn_value_dim(), fan_in(cfg.gdn_value_dim())));
            }
            LayerKind::FullAttention => {
                let sa = format!("{p}self_attn.");
                out.push(q(format!("{sa}q_proj"), cfg.q_proj_rows(), h, fan_in(h)));
                out.push(q(format!("{sa}k_proj"), cfg.kv_dim(), h, fan_in(h)));
                out.push(q(format!("{sa}v_proj"), cfg.kv_dim(), h, fan_in(h)));
                out.push(q(format!("{sa}o_proj"), h, cfg.attn_inner(), fan_in(cfg.attn_inner())));
                out.push(norm(format!("{sa}q_norm.weight"), cfg.head_dim));
                out.push(norm(format!("{sa}k_norm.weight"), cfg.head_dim));
            }
        }
        out.push(norm(format!("{p}post_attention_layernorm.weight"), h));
        let m = format!("{p}mlp.");
        let (e, mi, si) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
        out.push(WeightSpec {
            name: format!("{m}gate"),
            kind: WeightKind::Quantized { experts: None, out: e, inp: h, bits: GATE_BITS },
            init: Init::Normal(fan_in(h)),
        });
        let expert = |name: &str, o: usize, i: usize| WeightSpec {
            name: format!("{m}switch_mlp.{name}"),
            kind: WeightKind::Quantized { experts: Some(e), out: o, inp: i, bits },
            init: Init::Normal(fan_in(i)),
        };
        out.push(expert("gate_proj", mi, h));
        out.push(expert("up_proj", mi, h));
        out.push(expert("down_proj", h, mi));
        out.push(q(format!("{m}shared_expert.gate_proj"), si, h, fan_in(h)));
        out.push(q(format!("{m}shared_expert.up_proj"), si, h, fan_in(h)));
        out.push(q(format!("{m}shared_expert.down_proj"), h, si, fan_in(si)));
        out.push(WeightSpec {
            name: format!("{m}shared_expert_gate"),
            kind: WeightKind::Quantized { experts: None, out: 1, inp: h, bits: GATE_BITS },
            init: Init::Normal(fan_in(h)),
        });
    }
    out.push(norm(format!("{MODEL_PREFIX}norm.weight"), h));
    out.push(q(LM_HEAD.to_string(), cfg.vocab_size, h, fan_in(h)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_model_tensor_count_and_size() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let w = expected_weights(&cfg);
        let stored: usize = w.iter().map(|s| s.stored(64).len()).sum();
        // 30 GDN layers x 30 + 10 attention layers x 27 + embed(3) + norm(1) + head(3), and no
        // vision/MTP tensors: the mlx-lm count of the text model.
        assert_eq!(stored, 30 * (1 + 4 * 3 + 4 + 3 + 1 + 8 * 3) + 10 * (1 + 4 * 3 + 2 + 1 + 8 * 3) + 7);
        let params: usize = w.iter().map(WeightSpec::num_params).sum();
        assert!((34.0e9..36.0e9).contains(&(params as f64)), "{params}");
    }
}
