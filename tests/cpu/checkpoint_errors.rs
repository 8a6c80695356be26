//! Every damaged or unsupported checkpoint is a one-line error naming the file and tensor.

use crate::common::{tiny_checkpoint, tiny_copy};
use lily::checkpoint::Checkpoint;
use std::path::Path;

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened but should not", dir.display()),
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(!msg.contains('\n'), "error is not one line: {msg}");
            msg
        }
    }
}

fn first_shard(dir: &Path) -> std::path::PathBuf {
    let mut shards: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect();
    shards.sort();
    shards.remove(0)
}

/// Replaces `from` by `to` (same length) inside the JSON header of `shard`.
fn patch_header(shard: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    assert!(header.contains(from), "{from} not in header");
    let patched = header.replacen(from, to, 1);
    bytes[8..8 + n].copy_from_slice(patched.as_bytes());
    std::fs::write(shard, bytes).unwrap();
}

#[test]
fn valid_checkpoint_opens() {
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    assert_eq!(ck.config, lily::checkpoint::ModelConfig::tiny());
    assert!(ck.tensor_count() > 100);
}

#[test]
fn missing_directory() {
    let msg = open_err(Path::new("/nonexistent/lily-model"));
    assert!(msg.contains("does not exist") && msg.contains("/nonexistent/lily-model"), "{msg}");
}

#[test]
fn missing_config() {
    let dir = tiny_copy();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(open_err(&dir).contains("config.json"));
}

#[test]
fn gguf_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model-Q4_K_M.gguf"), b"GGUF").unwrap();
    assert!(open_err(dir.path()).contains("GGUF"));
}

#[test]
fn bf16_checkpoint_without_quantization() {
    let dir = tiny_copy();
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization");
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let msg = open_err(&dir);
    assert!(msg.contains("quantization") && msg.contains("config.json"), "{msg}");
}

#[test]
fn missing_shard() {
    let dir = tiny_copy();
    let shard = first_shard(&dir);
    std::fs::remove_file(&shard).unwrap();
    let msg = open_err(&dir);
    assert!(msg.contains("missing shard") && msg.contains(shard.file_name().unwrap().to_str().unwrap()), "{msg}");
}

#[test]
fn truncated_shard() {
    let dir = tiny_copy();
    let shard = first_shard(&dir);
    let len = std::fs::metadata(&shard).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_len(len - 1000).unwrap();
    let msg = open_err(&dir);
    assert!(msg.contains("truncated") && msg.contains(shard.file_name().unwrap().to_str().unwrap()), "{msg}");
}

#[test]
fn wrong_dtype_names_tensor() {
    let dir = tiny_copy();
    let shard = first_shard(&dir);
    // The first BF16 tensor of the shard becomes F16 (same byte size): norms must be BF16/F32
    // and scales must be float, so the loader must reject it by name.
    patch_header(&shard, "\"BF16\"", "\"F16\" ");
    let msg = open_err(&dir);
    assert!(msg.contains("tensor ") && msg.contains("dtype") || msg.contains("scales"), "{msg}");
}

#[test]
fn missing_tensor_names_it() {
    let dir = tiny_copy();
    let shard = first_shard(&dir);
    patch_header(&shard, "input_layernorm.weight", "input_layernorm.wEight");
    let msg = open_err(&dir);
    assert!(msg.contains("missing tensor") && msg.contains("input_layernorm.weight"), "{msg}");
}

#[test]
fn wrong_shape_names_tensor() {
    let dir = tiny_copy();
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["text_config"]["moe_intermediate_size"] = serde_json::json!(128);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let msg = open_err(&dir);
    assert!(msg.contains("shape") && msg.contains("switch_mlp"), "{msg}");
}

/// Adds a shard holding `names` (small BF16 tensors) to the checkpoint's index.
fn add_shard(dir: &Path, file: &str, names: &[&str]) {
    let data = vec![0u8; 16];
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        names.iter().map(|n| (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![2, 4], &data).unwrap())).collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join(file)).unwrap();
    let idx_path = dir.join("model.safetensors.index.json");
    let mut idx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&idx_path).unwrap()).unwrap();
    for n in names {
        idx["weight_map"][*n] = serde_json::json!(file);
    }
    std::fs::write(&idx_path, idx.to_string()).unwrap();
}

#[test]
fn vision_and_mtp_tensors_are_ignored() {
    let dir = tiny_copy();
    add_shard(&dir, "extra.safetensors", &["vision_tower.blocks.0.attn.qkv.weight", "mtp.fc.weight", "language_model.mtp.norm.weight"]);
    Checkpoint::open(&dir).unwrap();
}

#[test]
fn unknown_tensor_is_rejected_by_name() {
    let dir = tiny_copy();
    add_shard(&dir, "extra.safetensors", &["language_model.model.layers.0.mlp.experts.0.gate_proj.weight"]);
    let msg = open_err(&dir);
    assert!(msg.contains("unexpected tensor") && msg.contains("experts.0.gate_proj") && msg.contains("extra.safetensors"), "{msg}");
}

#[test]
fn duplicate_tensor_across_shards_is_rejected() {
    let dir = tiny_copy();
    add_shard(&dir, "extra.safetensors", &["language_model.model.norm.weight"]);
    let msg = open_err(&dir);
    assert!(msg.contains("two shards") && msg.contains("norm.weight"), "{msg}");
}
