//! Opening a checkpoint directory: `config.json`, `model.safetensors.index.json`, memory-mapped
//! shards, and a fail-closed check of every tensor's name, dtype and shape against
//! [`expected_weights`](super::layout::expected_weights). Every problem is one line naming the
//! file and the tensor.

use super::config::ModelConfig;
use super::layout::{expected_weights, DType, WeightKind, LM_HEAD, MODEL_PREFIX};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The bytes of one tensor: a window of a mapped shard, or an owned copy when the window is
/// not aligned for its element type.
#[derive(Clone)]
pub enum TensorBytes {
    Mapped { map: Arc<Mmap>, start: usize, len: usize },
    /// u64 storage keeps the copy 8-byte aligned.
    Owned { words: Arc<Vec<u64>>, len: usize },
}

impl TensorBytes {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, start, len } => &map[*start..*start + *len],
            TensorBytes::Owned { words, len } => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
        }
    }
    pub fn len(&self) -> usize {
        match self {
            TensorBytes::Mapped { len, .. } | TensorBytes::Owned { len, .. } => *len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies to aligned storage if the mapped window is not 4-byte aligned (safetensors only
    /// guarantees alignment by convention).
    fn aligned(self) -> Self {
        if (self.as_bytes().as_ptr() as usize).is_multiple_of(8) {
            return self;
        }
        let bytes = self.as_bytes();
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        TensorBytes::Owned { words: Arc::new(words), len: bytes.len() }
    }
}

/// Metadata of one stored tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A float tensor, read as f32 whatever its stored dtype.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::U32 => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
    }
}

/// An MLX affine-quantized weight `[rows, cols]` (stacked experts are flattened: expert e owns
/// rows `e*out .. (e+1)*out`).
#[derive(Clone)]
pub struct QuantTensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub bits: usize,
    pub group: usize,
    /// `[rows, cols*bits/32]` u32 words.
    pub weight: TensorBytes,
    /// `[rows, cols/group]` each, in `scale_dtype`.
    pub scales: TensorBytes,
    pub biases: TensorBytes,
    pub scale_dtype: DType,
}

impl QuantTensor {
    pub fn words(&self) -> &[u32] {
        bytemuck::cast_slice(self.weight.as_bytes())
    }
    pub fn words_per_row(&self) -> usize {
        self.cols * self.bits / 32
    }
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group
    }
    pub fn stored_bytes(&self) -> usize {
        self.weight.len() + self.scales.len() + self.biases.len()
    }
}

/// An opened, validated checkpoint.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    shards: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: HashMap<String, TensorInfo>,
    /// Prefix the checkpoint uses for text-model tensors (mlx-vlm `language_model.model.` or
    /// mlx-lm `model.`) and for the head.
    model_prefix: String,
    head_name: String,
}

/// Tensors a text engine skips: vision tower and multi-token-prediction head.
fn is_skipped(name: &str) -> bool {
    ["vision_tower.", "model.visual.", "visual.", "mtp.", "language_model.mtp.", "model.mtp.", "language_model.vision_tower."].iter().any(|p| name.starts_with(p))
}

impl Checkpoint {
    /// Opens `dir`, maps every shard and validates all tensors against the config.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("model directory {} does not exist", dir.display());
        }
        if !dir.is_dir() {
            if dir.extension().is_some_and(|e| e == "gguf") {
                bail!("{}: GGUF files are not supported; pass an MLX 4-bit checkpoint directory", dir.display());
            }
            bail!("{} is not a directory (pass the checkpoint directory)", dir.display());
        }
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            let gguf = std::fs::read_dir(dir).ok().into_iter().flatten().flatten().any(|e| e.path().extension().is_some_and(|x| x == "gguf"));
            if gguf {
                bail!("{}: contains GGUF files but no config.json; GGUF checkpoints are not supported (use the MLX 4-bit conversion)", dir.display());
            }
            bail!("{}: missing config.json (not a Hugging Face / MLX checkpoint directory)", config_path.display());
        }
        let config = ModelConfig::from_config_json(&config_path)?;

        let shard_names = shard_files(dir)?;
        let mut shards = Vec::new();
        let mut tensors: HashMap<String, TensorInfo> = HashMap::new();
        for (idx, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).with_context(|| format!("{}: cannot open shard", path.display()))?;
            // SAFETY: the file is opened read-only; like every mmap-based loader we assume the
            // checkpoint is not modified while it is being served.
            let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{}: cannot map shard", path.display()))?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..])
                .map_err(|e| anyhow!("{}: corrupt or truncated safetensors shard: {e}", path.display()))?;
            let data_start = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let dtype = match info.dtype {
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::U32 => DType::U32,
                    other => {
                        if is_skipped(&tname) {
                            continue;
                        }
                        bail!("{}: tensor {tname} has unsupported dtype {other:?}", path.display())
                    }
                };
                let (s, e) = info.data_offsets;
                let t = TensorInfo { shard: idx, dtype, shape: info.shape.clone(), start: data_start + s, end: data_start + e };
                if let Some(prev) = tensors.insert(tname.clone(), t) {
                    bail!("tensor {tname} appears in two shards: {} and {}", shard_names[prev.shard], name);
                }
            }
            shards.push((path, Arc::new(map)));
        }

        let (model_prefix, head_name) = if tensors.contains_key(&format!("{MODEL_PREFIX}embed_tokens.weight")) {
            (MODEL_PREFIX.to_string(), LM_HEAD.to_string())
        } else if tensors.contains_key("model.embed_tokens.weight") {
            ("model.".to_string(), "lm_head".to_string())
        } else if tensors.contains_key("model.language_model.embed_tokens.weight") {
            bail!("{}: this is an unconverted Hugging Face checkpoint (model.language_model.*); convert it to MLX 4-bit first", dir.display());
        } else {
            bail!("{}: missing tensor {MODEL_PREFIX}embed_tokens.weight", dir.display());
        };
        let ckpt = Checkpoint { dir: dir.to_path_buf(), config, shards, tensors, model_prefix, head_name };
        ckpt.validate()?;
        Ok(ckpt)
    }

    /// The checkpoint's own name of a canonical (mlx-vlm) tensor name.
    fn actual_name(&self, canonical: &str) -> String {
        if let Some(rest) = canonical.strip_prefix(MODEL_PREFIX) {
            format!("{}{rest}", self.model_prefix)
        } else if let Some(rest) = canonical.strip_prefix(LM_HEAD) {
            format!("{}{rest}", self.head_name)
        } else {
            canonical.to_string()
        }
    }

    fn shard_name(&self, info: &TensorInfo) -> String {
        self.shards[info.shard].0.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    }

    fn info(&self, canonical: &str) -> Result<(&TensorInfo, String)> {
        let name = self.actual_name(canonical);
        match self.tensors.get(&name) {
            Some(i) => Ok((i, name)),
            None => bail!("{}: missing tensor {name}", self.dir.display()),
        }
    }

    /// Fail-closed validation: every expected tensor present with the right dtype and shape,
    /// and nothing else besides skipped vision/MTP tensors.
    fn validate(&self) -> Result<()> {
        let cfg = &self.config;
        let mut consumed = BTreeSet::new();
        for spec in expected_weights(cfg) {
            match &spec.kind {
                WeightKind::Quantized { experts, out, inp, bits } => {
                    let lead: Vec<usize> = experts.iter().copied().collect();
                    let (w, wname) = self.info(&format!("{}.weight", spec.name))?;
                    let (s, sname) = self.info(&format!("{}.scales", spec.name))?;
                    let (b, bname) = self.info(&format!("{}.biases", spec.name))?;
                    let at = |n: &str, i: &TensorInfo| format!("{} ({})", n, self.shard_name(i));
                    if w.dtype != DType::U32 {
                        bail!("tensor {}: dtype {} but a quantized weight must be U32 (is this a bf16 checkpoint?)", at(&wname, w), w.dtype.name());
                    }
                    if s.dtype != b.dtype || !matches!(s.dtype, DType::BF16 | DType::F16 | DType::F32) {
                        bail!("tensor {}: scales {} / biases {} must share a float dtype", at(&sname, s), s.dtype.name(), b.dtype.name());
                    }
                    let g = cfg.quant.group_size;
                    let mut want_s = lead.clone();
                    want_s.extend([*out, inp / g]);
                    for (n, i) in [(&sname, s), (&bname, b)] {
                        if i.shape != want_s {
                            bail!("tensor {}: shape {:?}, expected {:?}", at(n, i), i.shape, want_s);
                        }
                    }
                    let mut want_w = lead.clone();
                    want_w.extend([*out, inp * bits / 32]);
                    if w.shape != want_w {
                        let got_bits = w.shape.last().map(|c| c * 32 / inp.max(&1)).unwrap_or(0);
                        bail!(
                            "tensor {}: shape {:?}, expected {:?} ({bits}-bit, group {g}; the stored shape implies {got_bits}-bit)",
                            at(&wname, w),
                            w.shape,
                            want_w
                        );
                    }
                    consumed.extend([wname, sname, bname]);
                }
                WeightKind::Float { shape, alt_shapes, dtypes } => {
                    let (t, name) = self.info(&spec.name)?;
                    if !dtypes.contains(&t.dtype) {
                        let allowed: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
                        bail!("tensor {name} ({}): dtype {}, expected {}", self.shard_name(t), t.dtype.name(), allowed.join(" or "));
                    }
                    if &t.shape != shape && !alt_shapes.contains(&t.shape) {
                        bail!("tensor {name} ({}): shape {:?}, expected {:?}", self.shard_name(t), t.shape, shape);
                    }
                    consumed.insert(name);
                }
            }
        }
        let extra: Vec<&String> = self.tensors.keys().filter(|n| !consumed.contains(*n) && !is_skipped(n)).collect::<BTreeSet<_>>().into_iter().take(5).collect();
        if !extra.is_empty() {
            let first = extra[0];
            let hint = if first.contains(".experts.") {
                " (per-expert or unconverted expert tensors: expected stacked switch_mlp.*)"
            } else {
                ""
            };
            bail!(
                "{}: unexpected tensor {} ({}){hint}; this is not a qwen3_5_moe MLX 4-bit checkpoint of the configured shape",
                self.dir.display(),
                first,
                self.shard_name(&self.tensors[first])
            );
        }
        Ok(())
    }

    fn bytes(&self, info: &TensorInfo) -> TensorBytes {
        TensorBytes::Mapped { map: self.shards[info.shard].1.clone(), start: info.start, len: info.end - info.start }.aligned()
    }

    /// A float tensor (canonical name) as f32.
    pub fn float(&self, canonical: &str) -> Result<Vec<f32>> {
        let (info, _) = self.info(canonical)?;
        Ok(to_f32(info.dtype, self.bytes(info).as_bytes()))
    }

    /// A quantized weight by its canonical base name (without `.weight`).
    pub fn quantized(&self, base: &str) -> Result<QuantTensor> {
        let (w, _) = self.info(&format!("{base}.weight"))?;
        let (s, _) = self.info(&format!("{base}.scales"))?;
        let (b, _) = self.info(&format!("{base}.biases"))?;
        let lead: usize = w.shape[..w.shape.len() - 1].iter().product();
        let scale_cols = *s.shape.last().unwrap();
        let words = *w.shape.last().unwrap();
        let group = self.config.quant.group_size;
        let cols = scale_cols * group;
        let bits = words * 32 / cols;
        Ok(QuantTensor {
            name: base.to_string(),
            rows: lead,
            cols,
            bits,
            group,
            weight: self.bytes(w),
            scales: self.bytes(s),
            biases: self.bytes(b),
            scale_dtype: s.dtype,
        })
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|(p, _)| p.as_path()).collect()
    }
    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.end - t.start).sum()
    }
    /// (dtype, count, bytes) summary for `lily info`.
    pub fn dtype_summary(&self) -> BTreeMap<&'static str, (usize, usize)> {
        let mut m = BTreeMap::new();
        for t in self.tensors.values() {
            let e = m.entry(t.dtype.name()).or_insert((0, 0));
            e.0 += 1;
            e.1 += t.end - t.start;
        }
        m
    }
}

/// Shard file names: from `model.safetensors.index.json` when present, else `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("{}: cannot read", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).with_context(|| format!("{}: no weight_map", index.display()))?;
        let files: BTreeSet<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
        if files.is_empty() {
            bail!("{}: empty weight_map", index.display());
        }
        for f in &files {
            if f.contains('/') || f.contains("..") {
                bail!("{}: shard name {f:?} escapes the checkpoint directory", index.display());
            }
            if !dir.join(f).exists() {
                bail!("{}: missing shard (listed in model.safetensors.index.json)", dir.join(f).display());
            }
        }
        return Ok(files.into_iter().collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    bail!("{}: no model.safetensors.index.json and no model.safetensors", dir.display())
}
