//! The input side of `lily quantize`: a Hugging Face Qwen3.5/3.6 MoE checkpoint directory
//! (`config.json`, one `model.safetensors` or shards listed by `model.safetensors.index.json`),
//! memory-mapped, with its tensor names brought to the MLX names that Lily's inventory uses
//! (`model.language_model.X` and text-only `model.X` -> `language_model.model.X`,
//! `lm_head.weight` -> `language_model.lm_head.weight`). Vision-tower and MTP tensors are
//! dropped, as mlx-community's conversions drop them. Anything that is not such a checkpoint is
//! a one-line error naming the file (and tensor).

use crate::checkpoint::config::ModelConfig;
use crate::checkpoint::layout::{DType, LM_HEAD, MODEL_PREFIX};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// One input tensor: where its bytes are and what they are.
#[derive(Debug, Clone)]
pub struct SrcTensor {
    /// Its name in the input file (for messages).
    pub hf_name: String,
    pub shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// An opened HF checkpoint.
pub struct HfSource {
    pub dir: PathBuf,
    /// The input config.json, wrapped as the multimodal `qwen3_5_moe` config when the input is a
    /// text-only `qwen3_5_moe_text` one.
    pub config_json: Value,
    pub config: ModelConfig,
    pub shards: Vec<(PathBuf, Mmap)>,
    /// By MLX name.
    pub tensors: BTreeMap<String, SrcTensor>,
}

/// Tensors the MLX text model does not keep.
fn is_dropped(name: &str) -> bool {
    ["model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "mtp.", "model.mtp.", "model.language_model.mtp."]
        .iter()
        .any(|p| name.starts_with(p))
}

/// The MLX name of an HF text-model tensor, or None when it is not one.
fn mlx_name(name: &str) -> Option<String> {
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        Some(format!("{MODEL_PREFIX}{rest}"))
    } else if name == "lm_head.weight" {
        Some(format!("{LM_HEAD}.weight"))
    } else {
        name.strip_prefix("model.").map(|rest| format!("{MODEL_PREFIX}{rest}"))
    }
}

impl HfSource {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("{}: does not exist", dir.display());
        }
        if !dir.is_dir() {
            if dir.extension().is_some_and(|e| e == "gguf") {
                bail!("{}: a GGUF file; lily quantize takes a Hugging Face bf16 safetensors directory", dir.display());
            }
            bail!("{}: not a directory (pass the Hugging Face checkpoint directory)", dir.display());
        }
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            let gguf = std::fs::read_dir(dir).ok().into_iter().flatten().flatten().any(|e| e.path().extension().is_some_and(|x| x == "gguf"));
            if gguf {
                bail!("{}: contains GGUF files and no config.json; lily quantize takes a Hugging Face bf16 safetensors directory", dir.display());
            }
            bail!("{}: missing (not a Hugging Face checkpoint directory)", config_path.display());
        }
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("{}: cannot read", config_path.display()))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: not valid JSON: {e}", config_path.display()))?;
        let config_json = wrap_config(root).with_context(|| config_path.display().to_string())?;
        // Validate the architecture with Lily's own parser: a 4-bit quantization block is what the
        // output will have.
        let mut probe = config_json.clone();
        probe["quantization"] = json!({"group_size": 64, "bits": 4});
        let config = ModelConfig::from_json(&probe).with_context(|| config_path.display().to_string())?;

        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (idx, name) in shard_files(dir)?.into_iter().enumerate() {
            let path = dir.join(&name);
            let file = File::open(&path).with_context(|| format!("{}: cannot open shard", path.display()))?;
            // SAFETY: read-only map of an input that is not modified while we convert it.
            let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{}: cannot map shard", path.display()))?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..])
                .map_err(|e| anyhow!("{}: corrupt or truncated safetensors file: {e}", path.display()))?;
            for (tname, info) in meta.tensors() {
                if is_dropped(&tname) {
                    continue;
                }
                let dtype = match info.dtype {
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::U32 if tname.ends_with(".weight") => {
                        bail!("{}: tensor {tname} is U32: this checkpoint is already quantized (lily quantize takes bf16 weights)", path.display())
                    }
                    other => bail!("{}: tensor {tname} has dtype {other:?}; lily quantize takes bf16 (or f16/f32) weights", path.display()),
                };
                if tname.ends_with(".scales") || tname.ends_with(".weight_scale_inv") || tname.ends_with(".weight_scale") {
                    bail!("{}: tensor {tname}: this checkpoint is already quantized (lily quantize takes bf16 weights)", path.display());
                }
                let Some(mlx) = mlx_name(&tname) else {
                    bail!("{}: unexpected tensor {tname} (not a qwen3_5_moe text-model tensor)", path.display());
                };
                let (s, e) = info.data_offsets;
                let t = SrcTensor { hf_name: tname.clone(), shard: idx, dtype, shape: info.shape.clone(), start: 8 + header_len + s, end: 8 + header_len + e };
                if let Some(prev) = tensors.insert(mlx, t) {
                    bail!("{}: tensor {tname} appears twice (also as {} in {})", path.display(), prev.hf_name, shards.get(prev.shard).map(|(p, _): &(PathBuf, Mmap)| p.display().to_string()).unwrap_or_else(|| path.display().to_string()));
                }
            }
            shards.push((path, map));
        }
        Ok(HfSource { dir: dir.to_path_buf(), config_json, config, shards, tensors })
    }

    pub fn get(&self, mlx: &str) -> Result<&SrcTensor> {
        self.tensors.get(mlx).ok_or_else(|| {
            let hf = mlx.strip_prefix(MODEL_PREFIX).map(|r| format!("model.language_model.{r}")).unwrap_or_else(|| "lm_head.weight".into());
            anyhow!("{}: missing tensor {hf}", self.dir.display())
        })
    }

    pub fn bytes(&self, t: &SrcTensor) -> &[u8] {
        &self.shards[t.shard].1[t.start..t.end]
    }

    pub fn file_of(&self, t: &SrcTensor) -> String {
        self.shards[t.shard].0.display().to_string()
    }
}

/// The input config as the multimodal `qwen3_5_moe` config Lily reads; refuses quantized inputs
/// and other architectures.
fn wrap_config(root: Value) -> Result<Value> {
    for key in ["quantization", "quantization_config"] {
        if root.get(key).is_some() || root.get("text_config").and_then(|t| t.get(key)).is_some() {
            bail!("has a {key:?} block: this checkpoint is already quantized (lily quantize takes the bf16 Hugging Face checkpoint)");
        }
    }
    let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
    match model_type.as_str() {
        "qwen3_5_moe" => Ok(root),
        // A text-only save (Qwen3_5MoeForCausalLM): the multimodal wrapper around it.
        "qwen3_5_moe_text" => Ok(json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": root.get("tie_word_embeddings").cloned().unwrap_or(json!(false)),
            "eos_token_id": root.get("eos_token_id").cloned().unwrap_or(Value::Null),
            "text_config": root,
        })),
        other => bail!("model_type {other:?} is not supported (lily quantize converts the qwen3_5_moe family: Qwen3.5/3.6-35B-A3B and smaller MoE variants)"),
    }
}

/// The safetensors files of `dir`: the index's, else `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("{}: cannot read", index.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: not valid JSON: {e}", index.display()))?;
        let map = v.get("weight_map").and_then(Value::as_object).with_context(|| format!("{}: no weight_map", index.display()))?;
        let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
        files.sort();
        files.dedup();
        for f in &files {
            if !dir.join(f).exists() {
                bail!("{}: missing shard {f} (listed in model.safetensors.index.json)", dir.display());
            }
        }
        return Ok(files);
    }
    if dir.join("model.safetensors").exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_mlx() {
        assert_eq!(mlx_name("model.language_model.layers.3.mlp.gate.weight").unwrap(), "language_model.model.layers.3.mlp.gate.weight");
        assert_eq!(mlx_name("model.embed_tokens.weight").unwrap(), "language_model.model.embed_tokens.weight");
        assert_eq!(mlx_name("lm_head.weight").unwrap(), "language_model.lm_head.weight");
        assert!(mlx_name("something.else").is_none());
        assert!(is_dropped("model.visual.blocks.0.attn.qkv.weight") && is_dropped("mtp.fc.weight"));
        assert!(!is_dropped("model.language_model.layers.0.mlp.gate.weight"));
    }

    #[test]
    fn configs_are_wrapped_or_refused() {
        let text = json!({"model_type": "qwen3_5_moe_text", "vocab_size": 10});
        assert_eq!(wrap_config(text).unwrap()["text_config"]["vocab_size"], 10);
        let e = wrap_config(json!({"model_type": "llama"})).unwrap_err().to_string();
        assert!(e.contains("llama"), "{e}");
        let e = wrap_config(json!({"model_type": "qwen3_5_moe", "quantization": {"bits": 4}})).unwrap_err().to_string();
        assert!(e.contains("already quantized"), "{e}");
    }
}
