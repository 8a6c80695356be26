//! `config.json` of a Qwen3.5/3.6 MoE (`qwen3_5_moe`) MLX checkpoint: parsing, validation,
//! the two synthetic presets, and the writer used by `lily synth`.
//!
//! The parser and the writer live side by side so a synthetic checkpoint can never drift from
//! what the loader accepts.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Kind of token mixer in one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    LinearAttention,
    /// Gated full attention (`full_attention`).
    FullAttention,
}

impl LayerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::LinearAttention => "linear_attention",
            LayerKind::FullAttention => "full_attention",
        }
    }
}

/// MLX affine quantization parameters (the checkpoint-wide default; the router and the shared
/// expert gate are always 8-bit in this family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantConfig {
    pub bits: usize,
    pub group_size: usize,
}

/// Bits of the two small gate projections (`mlp.gate`, `mlp.shared_expert_gate`).
pub const GATE_BITS: usize = 8;

/// Validated text-model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layer_types: Vec<LayerKind>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    /// Token ids that end generation (generation_config / top-level config `eos_token_id`).
    pub eos_token_ids: Vec<u32>,
    pub quant: QuantConfig,
}

impl ModelConfig {
    /// Qwen3.6-35B-A3B exactly.
    pub fn qwen36_35b_a3b() -> Self {
        ModelConfig {
            vocab_size: 248_320,
            hidden_size: 2048,
            layer_types: hybrid_layers(40, 4),
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            partial_rotary_factor: 0.25,
            rope_theta: 10_000_000.0,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 262_144,
            linear_num_key_heads: 16,
            linear_num_value_heads: 32,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
            eos_token_ids: vec![248_046, 248_044],
            quant: QuantConfig { bits: 4, group_size: 64 },
        }
    }

    /// The same architecture at a small size with the real vocabulary: 4 layers (3 Gated
    /// DeltaNet + 1 attention), 8 experts, top-2. Every ratio that matters is kept (GQA, two
    /// value heads per key head, partial rotary, a shared expert) so each code path runs.
    pub fn tiny() -> Self {
        ModelConfig {
            vocab_size: 248_320,
            hidden_size: 128,
            layer_types: hybrid_layers(4, 4),
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            partial_rotary_factor: 0.25,
            rope_theta: 10_000_000.0,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 262_144,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 64,
            linear_value_head_dim: 64,
            linear_conv_kernel_dim: 4,
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 64,
            shared_expert_intermediate_size: 64,
            eos_token_ids: vec![248_046, 248_044],
            quant: QuantConfig { bits: 4, group_size: 64 },
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).floor() as usize
    }
    /// Rows of q_proj: query and output gate for every head.
    pub fn q_proj_rows(&self) -> usize {
        2 * self.num_attention_heads * self.head_dim
    }
    pub fn attn_inner(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    /// Gated DeltaNet q (= k) width.
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the causal conv: [q | k | v].
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }
    pub fn is_35b_a3b(&self) -> bool {
        *self == Self::qwen36_35b_a3b()
    }

    /// Checks that the dimensions fit together (any consistent smaller model is accepted).
    pub fn validate(&self) -> Result<()> {
        let g = self.quant.group_size;
        let mut problems = Vec::new();
        let mut need = |ok: bool, what: String| {
            if !ok {
                problems.push(what)
            }
        };
        need(self.quant.bits == 4, format!("quantization bits {} (only 4-bit affine is supported)", self.quant.bits));
        need(self.quant.group_size == 64, format!("quantization group_size {} (only 64 is supported)", g));
        need(self.vocab_size > 0 && self.vocab_size <= u32::MAX as usize, format!("vocab_size {}", self.vocab_size));
        need(self.num_layers() > 0, "num_hidden_layers is 0".into());
        need(self.hidden_size.is_multiple_of(g), format!("hidden_size {} is not a multiple of the group size {g}", self.hidden_size));
        need(self.num_attention_heads > 0 && self.num_key_value_heads > 0, "attention heads must be positive".into());
        need(
            self.num_key_value_heads > 0 && self.num_attention_heads.is_multiple_of(self.num_key_value_heads),
            format!("num_attention_heads {} not divisible by num_key_value_heads {}", self.num_attention_heads, self.num_key_value_heads),
        );
        need(self.attn_inner().is_multiple_of(g), format!("num_attention_heads*head_dim {} not a multiple of {g}", self.attn_inner()));
        let rd = self.rotary_dim();
        need(rd.is_multiple_of(2) && rd <= self.head_dim && rd > 0, format!("rotary dim {rd} (head_dim {} x partial_rotary_factor {})", self.head_dim, self.partial_rotary_factor));
        need(
            self.linear_num_key_heads > 0 && self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads.max(1)),
            format!("linear_num_value_heads {} not a multiple of linear_num_key_heads {}", self.linear_num_value_heads, self.linear_num_key_heads),
        );
        need(self.gdn_value_dim().is_multiple_of(g), format!("GDN value width {} not a multiple of {g}", self.gdn_value_dim()));
        need(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim must be >= 1".into());
        need(self.num_experts > 0, "num_experts is 0 (dense checkpoints are not supported)".into());
        need(
            self.num_experts_per_tok >= 1 && self.num_experts_per_tok <= self.num_experts,
            format!("num_experts_per_tok {} with {} experts", self.num_experts_per_tok, self.num_experts),
        );
        need(self.moe_intermediate_size.is_multiple_of(g) && self.moe_intermediate_size > 0, format!("moe_intermediate_size {} not a positive multiple of {g}", self.moe_intermediate_size));
        need(
            self.shared_expert_intermediate_size.is_multiple_of(g) && self.shared_expert_intermediate_size > 0,
            format!("shared_expert_intermediate_size {} not a positive multiple of {g}", self.shared_expert_intermediate_size),
        );
        need(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0, "rms_norm_eps and rope_theta must be positive".into());
        need(
            self.layer_types.contains(&LayerKind::FullAttention)
                || self.layer_types.contains(&LayerKind::LinearAttention),
            "no layers".into(),
        );
        if !problems.is_empty() {
            bail!("inconsistent model config: {}", problems.join("; "));
        }
        Ok(())
    }

    /// Parses and validates the `config.json` of an MLX `qwen3_5_moe` checkpoint.
    pub fn from_config_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let root: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        Self::from_json(&root).with_context(|| format!("{}", path.display()))
    }

    pub fn from_json(root: &Value) -> Result<Self> {
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        if model_type != "qwen3_5_moe" {
            bail!(
                "model_type {:?} is not supported (Lily runs the qwen3_5_moe family: Qwen3.5/3.6-35B-A3B and smaller MoE variants)",
                model_type
            );
        }
        let text = root.get("text_config").context("missing text_config")?;
        let quant = root
            .get("quantization")
            .or_else(|| root.get("quantization_config"))
            .context("no \"quantization\" block: only MLX affine 4-bit checkpoints are supported (this looks like a bf16/HF checkpoint)")?;
        let mode = quant.get("mode").and_then(Value::as_str).unwrap_or("affine");
        if mode != "affine" {
            bail!("quantization mode {mode:?} is not supported (only MLX affine)");
        }
        let quant = QuantConfig { bits: get_usize(quant, "bits")?, group_size: get_usize(quant, "group_size")? };

        let num_layers = get_usize(text, "num_hidden_layers")?;
        let layer_types = match text.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::LinearAttention),
                    Some("full_attention") => Ok(LayerKind::FullAttention),
                    other => bail!("unknown layer type {other:?} in layer_types"),
                })
                .collect::<Result<Vec<_>>>()?,
            _ => hybrid_layers(num_layers, text.get("full_attention_interval").and_then(Value::as_u64).unwrap_or(4) as usize),
        };
        if layer_types.len() != num_layers {
            bail!("layer_types has {} entries but num_hidden_layers is {num_layers}", layer_types.len());
        }
        if text.get("tie_word_embeddings").and_then(Value::as_bool).or_else(|| root.get("tie_word_embeddings").and_then(Value::as_bool)) == Some(true) {
            bail!("tie_word_embeddings=true is not supported (Qwen3.6-35B-A3B has an untied lm_head)");
        }
        if text.get("attn_output_gate").and_then(Value::as_bool) == Some(false) {
            bail!("attn_output_gate=false is not supported");
        }
        let rope = text.get("rope_parameters").or_else(|| text.get("rope_scaling"));
        let rope_get = |key: &str| rope.and_then(|r| r.get(key)).or_else(|| text.get(key)).and_then(Value::as_f64);
        let eos = root.get("eos_token_id").or_else(|| text.get("eos_token_id"));
        let eos_token_ids = match eos {
            Some(Value::Number(n)) => vec![n.as_u64().context("eos_token_id")? as u32],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            _ => vec![],
        };
        let cfg = ModelConfig {
            vocab_size: get_usize(text, "vocab_size")?,
            hidden_size: get_usize(text, "hidden_size")?,
            layer_types,
            num_attention_heads: get_usize(text, "num_attention_heads")?,
            num_key_value_heads: get_usize(text, "num_key_value_heads")?,
            head_dim: get_usize(text, "head_dim")?,
            partial_rotary_factor: rope_get("partial_rotary_factor").unwrap_or(0.25),
            rope_theta: rope_get("rope_theta").unwrap_or(10_000_000.0),
            rms_norm_eps: text.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            max_position_embeddings: text.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(262_144) as usize,
            linear_num_key_heads: get_usize(text, "linear_num_key_heads")?,
            linear_num_value_heads: get_usize(text, "linear_num_value_heads")?,
            linear_key_head_dim: get_usize(text, "linear_key_head_dim")?,
            linear_value_head_dim: get_usize(text, "linear_value_head_dim")?,
            linear_conv_kernel_dim: get_usize(text, "linear_conv_kernel_dim")?,
            num_experts: get_usize(text, "num_experts")?,
            num_experts_per_tok: get_usize(text, "num_experts_per_tok")?,
            moe_intermediate_size: get_usize(text, "moe_intermediate_size")?,
            shared_expert_intermediate_size: get_usize(text, "shared_expert_intermediate_size")?,
            eos_token_ids,
            quant,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` of an mlx-community conversion (mlx-vlm layout: multimodal wrapper,
    /// `text_config`, `quantization` with the 8-bit gate exceptions, duplicated as
    /// `quantization_config`).
    pub fn to_config_json(&self) -> Value {
        let mut quant = serde_json::Map::new();
        quant.insert("group_size".into(), json!(self.quant.group_size));
        quant.insert("bits".into(), json!(self.quant.bits));
        quant.insert("mode".into(), json!("affine"));
        for i in 0..self.num_layers() {
            for gate in ["mlp.gate", "mlp.shared_expert_gate"] {
                quant.insert(
                    format!("language_model.model.layers.{i}.{gate}"),
                    json!({"group_size": self.quant.group_size, "bits": GATE_BITS}),
                );
            }
        }
        let layer_types: Vec<&str> = self.layer_types.iter().map(|k| k.as_str()).collect();
        let interval = self.layer_types.iter().position(|k| *k == LayerKind::FullAttention).map(|p| p + 1).unwrap_or(4);
        // Interleaved MRoPE sections (T, H, W) over the rotary frequencies: [11, 11, 10] for the
        // real 64-dim rotary; scaled the same way for smaller presets. Text-only positions make
        // them irrelevant to the math, but transformers checks they cover the frequencies.
        let half = self.rotary_dim() / 2;
        let sec = half.div_ceil(3);
        let mrope_section = [sec, sec, half - 2 * sec];
        json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "image_token_id": 248056,
            "video_token_id": 248057,
            "vision_start_token_id": 248053,
            "vision_end_token_id": 248054,
            "eos_token_id": self.eos_token_ids,
            "dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_layers(),
                "layer_types": layer_types,
                "full_attention_interval": interval,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "attn_output_gate": true,
                "attention_bias": false,
                "attention_dropout": 0.0,
                "partial_rotary_factor": self.partial_rotary_factor,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                    "mrope_section": mrope_section,
                    "mrope_interleaved": true
                },
                "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.rms_norm_eps,
                "hidden_act": "silu",
                "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads,
                "linear_key_head_dim": self.linear_key_head_dim,
                "linear_value_head_dim": self.linear_value_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                "mamba_ssm_dtype": "float32",
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "router_aux_loss_coef": 0.001,
                "output_router_logits": false,
                "mtp_num_hidden_layers": 1,
                "mtp_use_dedicated_embeddings": false,
                "tie_word_embeddings": false,
                "bos_token_id": 248044,
                "eos_token_id": 248044,
                "pad_token_id": null,
                "use_cache": true,
                "initializer_range": 0.02,
                "dtype": "bfloat16"
            },
            "quantization": Value::Object(quant.clone()),
            "quantization_config": Value::Object(quant),
        })
    }
}

/// `[lin, lin, lin, full] * n/interval`: layer i is full attention iff (i+1) % interval == 0.
pub fn hybrid_layers(n: usize, interval: usize) -> Vec<LayerKind> {
    (0..n)
        .map(|i| if interval > 0 && (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
        .collect()
}

fn get_usize(v: &Value, key: &str) -> Result<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize).with_context(|| format!("missing or non-integer field {key:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_round_trip_through_json() {
        for cfg in [ModelConfig::qwen36_35b_a3b(), ModelConfig::tiny()] {
            cfg.validate().unwrap();
            let back = ModelConfig::from_json(&cfg.to_config_json()).unwrap();
            assert_eq!(back, cfg);
        }
        assert!(ModelConfig::qwen36_35b_a3b().is_35b_a3b());
        assert!(!ModelConfig::tiny().is_35b_a3b());
    }

    #[test]
    fn real_derived_dims() {
        let c = ModelConfig::qwen36_35b_a3b();
        assert_eq!(c.rotary_dim(), 64);
        assert_eq!(c.q_proj_rows(), 8192);
        assert_eq!(c.gdn_conv_dim(), 8192);
        assert_eq!(c.gdn_value_dim(), 4096);
        let full: Vec<usize> = (0..40).filter(|&i| c.layer_types[i] == LayerKind::FullAttention).collect();
        assert_eq!(full, vec![3, 7, 11, 15, 19, 23, 27, 31, 35, 39]);
    }

    #[test]
    fn rejects_unsupported_checkpoints() {
        let mut j = ModelConfig::tiny().to_config_json();
        j.as_object_mut().unwrap().remove("quantization");
        j.as_object_mut().unwrap().remove("quantization_config");
        let e = ModelConfig::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("quantization"), "{e}");

        let mut j = ModelConfig::tiny().to_config_json();
        j["model_type"] = json!("llama");
        assert!(ModelConfig::from_json(&j).unwrap_err().to_string().contains("llama"));

        let mut j = ModelConfig::tiny().to_config_json();
        j["quantization"]["bits"] = json!(8);
        assert!(format!("{:#}", ModelConfig::from_json(&j).unwrap_err()).contains("bits 8"));

        let mut j = ModelConfig::tiny().to_config_json();
        j["text_config"]["num_experts"] = json!(0);
        assert!(format!("{:#}", ModelConfig::from_json(&j).unwrap_err()).contains("dense"));

        let mut j = ModelConfig::tiny().to_config_json();
        j["text_config"]["num_hidden_layers"] = json!(5);
        assert!(format!("{:#}", ModelConfig::from_json(&j).unwrap_err()).contains("layer_types"));
    }
}
