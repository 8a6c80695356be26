//! `lily quantize --hf DIR --out DIR`: a Hugging Face bf16 Qwen3.5/3.6 MoE checkpoint -> the
//! mlx-community MLX affine 4-bit layout that Lily loads (the names, dtypes and shapes of
//! `crate::checkpoint::layout`, which `lily synth` writes too), with the router (`mlp.gate`) and
//! `mlp.shared_expert_gate` at 8 bits, group 64 everywhere. Tensor bytes are identical to
//! `mlx_lm.convert -q` (tests/cpu/quantize.rs checks this on the trained fixture).
//!
//! * Streaming: the input is memory-mapped and converted one output weight at a time, rows in
//!   parallel (rayon); only that weight's output is held, then written at its precomputed offset.
//! * The output headers are known before any data is converted (every shape follows from
//!   config.json), so shards are laid out up front as mlx-lm lays them (greedy, 5 GB).
//! * Atomic: written into a hidden sibling directory that is renamed into place at the end.

mod convert;
mod source;

use crate::checkpoint::config::{ModelConfig, GATE_BITS};
use crate::checkpoint::layout::{expected_weights, DType};
use crate::synth::{assign_shards, write_json};
use anyhow::{anyhow, bail, Context, Result};
use convert::Job;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Map, Value};
use source::HfSource;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// mlx-lm's default `max_file_size_gb` (5), in bytes of tensor data per shard.
const SHARD_LIMIT: u64 = 5 << 30;

/// What [`quantize_checkpoint`] wrote.
#[derive(Debug)]
pub struct QuantizeReport {
    pub dir: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
    pub shards: usize,
    pub seconds: f64,
}

/// One stored output tensor and where it goes.
struct Planned {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    nbytes: u64,
    shard: usize,
    offset: u64,
}

/// Converts the HF checkpoint in `hf` into `out` (which must not exist or be empty).
pub fn quantize_checkpoint(hf: &Path, out: &Path, progress: bool) -> Result<QuantizeReport> {
    let t0 = Instant::now();
    let src = HfSource::open(hf)?;
    let cfg = &src.config;
    let group = cfg.quant.group_size;
    let specs = expected_weights(cfg);
    let jobs = convert::plan(&src, &specs, group)?;
    // Every input tensor must be used: a leftover means a checkpoint of another shape.
    let used: std::collections::BTreeSet<&str> = jobs.iter().map(|j| match j {
        Job::Quantize { src, .. } | Job::Float { src, .. } => src.as_str(),
    }).collect();
    if let Some((_, t)) = src.tensors.iter().find(|(n, _)| !used.contains(n.as_str())) {
        bail!("{}: unexpected tensor {} (not part of a qwen3_5_moe text model of this config.json)", src.file_of(t), t.hf_name);
    }

    let mut planned = plan_outputs(&src, &jobs, group);
    let sizes: Vec<u64> = planned.iter().map(|p| p.nbytes).collect();
    let shard_of = assign_shards(&sizes, SHARD_LIMIT);
    let n_shards = shard_of.last().map_or(1, |s| s + 1);
    let mut offset = vec![0u64; n_shards];
    for (p, s) in planned.iter_mut().zip(&shard_of) {
        p.shard = *s;
        p.offset = offset[*s];
        offset[*s] += p.nbytes;
    }
    let names: Vec<String> = (0..n_shards)
        .map(|i| if n_shards == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n_shards) })
        .collect();

    let target = Target::prepare(out)?;
    let result = write_all(&src, cfg, &jobs, &planned, &names, &target.tmp, progress);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&target.tmp);
        return Err(e);
    }
    std::fs::rename(&target.tmp, &target.dir).map_err(|e| anyhow!("{}: cannot move the output into place: {e}", target.dir.display()))?;
    Ok(QuantizeReport {
        dir: target.dir,
        tensors: planned.len(),
        bytes: planned.iter().map(|p| p.nbytes).sum(),
        shards: n_shards,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The stored tensors of every job, in job order.
fn plan_outputs(src: &HfSource, jobs: &[Job], group: usize) -> Vec<Planned> {
    let mut out = Vec::new();
    let mk = |name: String, dtype: DType, shape: Vec<usize>| {
        let nbytes = shape.iter().product::<usize>() as u64 * dtype.size() as u64;
        Planned { name, dtype, shape, nbytes, shard: 0, offset: 0 }
    };
    for job in jobs {
        match job {
            Job::Quantize { name, out_rows, cols, bits, lead, .. } => {
                let rows_per = out_rows / lead.first().copied().unwrap_or(1);
                let shape = |c: usize| lead.iter().copied().chain([rows_per, c]).collect::<Vec<_>>();
                out.push(mk(format!("{name}.weight"), DType::U32, shape(cols * bits / 32)));
                out.push(mk(format!("{name}.scales"), DType::BF16, shape(cols / group)));
                out.push(mk(format!("{name}.biases"), DType::BF16, shape(cols / group)));
            }
            Job::Float { name, src: s, shape, keep_dtype, .. } => {
                let dtype = if *keep_dtype { src.tensors[s].dtype } else { DType::BF16 };
                out.push(mk(name.clone(), dtype, shape.clone()));
            }
        }
    }
    out
}

fn write_all(src: &HfSource, cfg: &ModelConfig, jobs: &[Job], planned: &[Planned], names: &[String], dir: &Path, progress: bool) -> Result<()> {
    // Headers first: every shape is known.
    let mut files = Vec::new();
    let mut data_start = Vec::new();
    for (s, name) in names.iter().enumerate() {
        let path = dir.join(name);
        let header = shard_header(planned, s);
        let f = File::create(&path).map_err(|e| anyhow!("{}: cannot create: {e}", path.display()))?;
        f.write_all_at(&header, 0).map_err(|e| anyhow!("{}: write failed: {e}", path.display()))?;
        data_start.push(header.len() as u64);
        files.push((path, f));
    }
    let total: u64 = src.tensors.values().map(|t| (t.end - t.start) as u64).sum();
    let bar = if progress {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{spinner} quantize [{elapsed_precise}] [{bar:40}] {bytes}/{total_bytes} ({binary_bytes_per_sec}, eta {eta}) {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let mut next = 0;
    for job in jobs {
        let (src_name, pieces): (&str, Vec<Vec<u8>>) = match job {
            Job::Quantize { src: s, name, .. } => {
                bar.set_message(name.clone());
                (s, convert::quantize(src, job)?.into())
            }
            Job::Float { src: s, .. } => (s, vec![convert::float(src, job)?.1]),
        };
        for bytes in pieces {
            let p = &planned[next];
            next += 1;
            debug_assert_eq!(bytes.len() as u64, p.nbytes, "{}", p.name);
            let (path, f) = &files[p.shard];
            f.write_all_at(&bytes, data_start[p.shard] + p.offset).map_err(|e| anyhow!("{}: write failed: {e}", path.display()))?;
        }
        // A fused gate_up feeds two jobs: count its bytes once, on its second half.
        let t = &src.tensors[src_name];
        let counts = !matches!(job, Job::Quantize { rows: convert::Rows::FusedHalf { half: 0, .. }, .. });
        if counts {
            bar.inc((t.end - t.start) as u64);
        }
    }
    bar.finish_and_clear();

    // mlx-lm writes the weight map sorted by name, and the index even for one shard.
    let mut map = Map::new();
    let mut sorted: Vec<&Planned> = planned.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for p in sorted {
        map.insert(p.name.clone(), json!(names[p.shard]));
    }
    let total_size: u64 = planned.iter().map(|p| p.nbytes).sum();
    write_json(&dir.join("model.safetensors.index.json"), &json!({"metadata": {"total_size": total_size}, "weight_map": Value::Object(map)}))?;
    write_json(&dir.join("config.json"), &output_config(&src.config_json, cfg))?;
    copy_side_files(&src.dir, dir)
}

/// The input config plus the quantization block mlx-lm writes (and its `quantization_config`
/// copy): 4-bit group 64, and 8 bits for each layer's router and shared-expert gate.
fn output_config(input: &Value, cfg: &ModelConfig) -> Value {
    let mut q = Map::new();
    q.insert("group_size".into(), json!(cfg.quant.group_size));
    q.insert("bits".into(), json!(cfg.quant.bits));
    q.insert("mode".into(), json!("affine"));
    for i in 0..cfg.num_layers() {
        for gate in ["mlp.gate", "mlp.shared_expert_gate"] {
            q.insert(format!("language_model.model.layers.{i}.{gate}"), json!({"group_size": cfg.quant.group_size, "bits": GATE_BITS}));
        }
    }
    let mut out = input.clone();
    out["quantization"] = Value::Object(q.clone());
    out["quantization_config"] = Value::Object(q);
    out
}

/// Tokenizer, chat template, generation config and the like: every other small file.
fn copy_side_files(from: &Path, to: &Path) -> Result<()> {
    for entry in std::fs::read_dir(from).with_context(|| format!("{}: cannot list", from.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let skip = name.ends_with(".safetensors") || name == "model.safetensors.index.json" || name == "config.json" || name.starts_with('.');
        if skip || !entry.file_type()?.is_file() || entry.metadata()?.len() > 256 << 20 {
            continue;
        }
        std::fs::copy(entry.path(), to.join(&name)).map_err(|e| anyhow!("{}: cannot copy: {e}", entry.path().display()))?;
    }
    Ok(())
}

/// The safetensors header of shard `shard` (8-byte length, JSON padded to 8 bytes).
fn shard_header(planned: &[Planned], shard: usize) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("__metadata__".into(), json!({"format": "mlx"}));
    for p in planned.iter().filter(|p| p.shard == shard) {
        m.insert(p.name.clone(), json!({"dtype": p.dtype.name(), "shape": p.shape, "data_offsets": [p.offset, p.offset + p.nbytes]}));
    }
    let mut text = serde_json::to_vec(&Value::Object(m)).expect("header serialises");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

/// The output directory and the hidden sibling it is written into.
struct Target {
    dir: PathBuf,
    tmp: PathBuf,
}

impl Target {
    fn prepare(out: &Path) -> Result<Self> {
        let dir = std::path::absolute(out).map_err(|e| anyhow!("{}: invalid path: {e}", out.display()))?;
        if dir.exists() {
            let empty = dir.is_dir() && std::fs::read_dir(&dir).map(|mut d| d.next().is_none()).unwrap_or(false);
            if !empty {
                bail!("{}: already exists and is not an empty directory; refusing to overwrite it", dir.display());
            }
            std::fs::remove_dir(&dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
        }
        let name = dir.file_name().with_context(|| format!("{}: output path has no directory name", dir.display()))?;
        let parent = dir.parent().with_context(|| format!("{}: output path has no parent", dir.display()))?;
        std::fs::create_dir_all(parent).map_err(|e| anyhow!("{}: cannot create directory: {e}", parent.display()))?;
        let tmp = parent.join(format!(".{}.lily-quantize-partial", name.to_string_lossy()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| anyhow!("{}: cannot remove stale directory: {e}", tmp.display()))?;
        }
        std::fs::create_dir(&tmp).map_err(|e| anyhow!("{}: cannot create directory: {e}", tmp.display()))?;
        Ok(Target { dir, tmp })
    }
}
