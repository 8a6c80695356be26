//! `lily synth`: random-weight checkpoints with the exact layout of
//! `mlx-community/Qwen3.6-35B-A3B-4bit` (config.json, generation_config.json,
//! model.safetensors.index.json, `model-0000i-of-0000K.safetensors` shards of at most 5 GB,
//! tokenizer files).
//!
//! * Streaming: headers are computed up front (every shape is known); tensor bytes are
//!   generated in 1 MiB chunks by rayon workers, each written at its precomputed file offset
//!   (`pwrite`), the shards concurrently. Peak RSS is ~60 MB for the 19.5 GB preset, which takes
//!   ~3–7 s on a 16-core H200 host and ~40 s on a 2-core VM (disk-bound there).
//! * Quantized weights are generated directly in the quantized domain: uniformly random codes
//!   (raw random words) plus per-group BF16 scale/bias chosen so `scale*q + bias` has mean ~0 and
//!   the spec's init standard deviation (scales jittered ×U(0.75, 1.25) per group).
//! * Deterministic: the bytes depend only on `(cfg, seed)` — counter-based splitmix64 streams
//!   keyed by tensor name, IEEE-exact arithmetic only — not on thread count or machine.
//! * Atomic: everything is written into a hidden sibling directory that is renamed into place
//!   at the end; a non-empty directory is only replaced if it is a previous synth output
//!   (it carries the [`MARKER`] file).

pub(crate) mod gen;
mod write;

use crate::checkpoint::config::ModelConfig;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

pub use write::assign_shards;

/// Name of the marker file that identifies a directory written by `lily synth`.
pub const MARKER: &str = "lily_synth.json";

/// Hugging Face's default `max_shard_size` ("5GB"), in bytes of tensor data per shard.
pub const DEFAULT_SHARD_LIMIT: u64 = 5_000_000_000;

/// A named model configuration to synthesize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// [`ModelConfig::tiny`]: 4 layers, hidden 128, 8 experts, the real 248,320 vocabulary (~40 MB).
    Tiny,
    /// [`ModelConfig::qwen36_35b_a3b`]: the real model's shapes (~19.4 GB).
    Qwen35bA3b,
}

impl Preset {
    pub const ALL: [Preset; 2] = [Preset::Tiny, Preset::Qwen35bA3b];

    pub fn config(&self) -> ModelConfig {
        match self {
            Preset::Tiny => ModelConfig::tiny(),
            Preset::Qwen35bA3b => ModelConfig::qwen36_35b_a3b(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Qwen35bA3b => "35b-a3b",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tiny" => Ok(Preset::Tiny),
            "35b-a3b" | "35b" | "qwen3.6-35b-a3b" | "qwen36-35b-a3b" => Ok(Preset::Qwen35bA3b),
            _ => bail!("unknown preset {s:?} (expected one of: tiny, 35b-a3b)"),
        }
    }
}

/// What [`synthesize`] wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub dir: PathBuf,
    /// Stored tensors (weights, scales, biases and float tensors).
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_bytes: u64,
    /// Bytes of the shard files (tensor data plus headers).
    pub file_bytes: u64,
    /// Number of shard files.
    pub shards: usize,
    pub shard_files: Vec<String>,
    /// Wall time of the whole call.
    pub elapsed: Duration,
    /// Wall time spent generating and writing the shards.
    pub shard_elapsed: Duration,
}

impl SynthReport {
    /// Shard generation+write throughput in GB/s (10^9 bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.file_bytes as f64 / 1e9 / self.shard_elapsed.as_secs_f64().max(1e-9)
    }
}

impl fmt::Display for SynthReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wrote {}: {} tensors, {:.2} GB in {} shard(s) in {:.1}s (shards at {:.2} GB/s)",
            self.dir.display(),
            self.tensors,
            self.total_bytes as f64 / 1e9,
            self.shards,
            self.elapsed.as_secs_f64(),
            self.gb_per_s()
        )
    }
}

/// Knobs of [`synthesize_with`]; [`synthesize`] uses the defaults.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Maximum bytes of tensor data per shard.
    pub shard_limit: u64,
    /// Generation chunk size in bytes (rounded down to a multiple of 8). Does not affect output.
    pub chunk_bytes: usize,
    /// Show a progress bar (bytes) on stderr.
    pub progress: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions { shard_limit: DEFAULT_SHARD_LIMIT, chunk_bytes: 1 << 20, progress: false }
    }
}

/// Writes a random-weight checkpoint for `cfg` into `out_dir` (see the module docs).
pub fn synthesize(cfg: &ModelConfig, out_dir: &Path, seed: u64, progress: bool) -> Result<SynthReport> {
    synthesize_with(cfg, out_dir, seed, &SynthOptions { progress, ..SynthOptions::default() })
}

/// [`synthesize`] with explicit options (shard size limit, chunk size).
pub fn synthesize_with(cfg: &ModelConfig, out_dir: &Path, seed: u64, opts: &SynthOptions) -> Result<SynthReport> {
    let t0 = Instant::now();
    cfg.validate()?;
    let target = Target::prepare(out_dir)?;
    let result = write_all(cfg, &target.tmp, seed, opts);
    let (tensors, total_bytes, file_bytes, shard_files, shard_elapsed) = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&target.tmp);
            return Err(e);
        }
    };
    target.commit()?;
    Ok(SynthReport {
        dir: target.dir,
        tensors,
        total_bytes,
        file_bytes,
        shards: shard_files.len(),
        shard_files,
        elapsed: t0.elapsed(),
        shard_elapsed,
    })
}

/// Writes every file into `dir` (the temporary directory).
type Written = (usize, u64, u64, Vec<String>, Duration);

fn write_all(cfg: &ModelConfig, dir: &Path, seed: u64, opts: &SynthOptions) -> Result<Written> {
    let mut tensors = write::plan_tensors(cfg, seed);
    let n_shards = write::layout_shards(&mut tensors, opts.shard_limit.max(1));
    let shard_files: Vec<String> = (0..n_shards).map(|i| write::shard_name(i, n_shards)).collect();
    let total_bytes: u64 = tensors.iter().map(|t| t.nbytes).sum();

    write_json(&dir.join("config.json"), &cfg.to_config_json())?;
    write_json(&dir.join("generation_config.json"), &generation_config(cfg))?;
    // mlx-lm writes the weight map sorted by tensor name.
    let mut names: Vec<(&str, usize)> = tensors.iter().map(|t| (t.name.as_str(), t.shard)).collect();
    names.sort_unstable();
    let mut map = Map::new();
    for (name, shard) in names {
        map.insert(name.to_string(), json!(shard_files[shard]));
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &json!({"metadata": {"total_size": total_bytes}, "weight_map": Value::Object(map)}),
    )?;
    crate::tokenizer::write_tokenizer_files(dir)?;

    let t0 = Instant::now();
    let file_bytes = write::write_shards(dir, &tensors, n_shards, opts.chunk_bytes, opts.progress)?;
    let shard_elapsed = t0.elapsed();

    // The marker goes last: its presence means "a complete lily synth output".
    write_json(
        &dir.join(MARKER),
        &json!({
            "generator": "lily synth",
            "lily_version": env!("CARGO_PKG_VERSION"),
            "seed": seed,
            "preset": Preset::ALL.iter().find(|p| p.config() == *cfg).map(|p| p.name()),
            "tensors": tensors.len(),
            "total_size": total_bytes,
        }),
    )?;
    Ok((tensors.len(), total_bytes, file_bytes, shard_files, shard_elapsed))
}

fn generation_config(cfg: &ModelConfig) -> Value {
    json!({
        "bos_token_id": 248044,
        "do_sample": true,
        "eos_token_id": cfg.eos_token_ids,
        "pad_token_id": 248044,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.57.0"
    })
}

/// Pretty JSON with a final newline (config files of the checkpoints we write).
pub(crate) fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v).expect("JSON serialises");
    text.push('\n');
    std::fs::write(path, text).map_err(|e| anyhow!("{}: cannot write: {e}", path.display()))
}

/// The output directory and its hidden temporary sibling.
struct Target {
    dir: PathBuf,
    tmp: PathBuf,
    old: PathBuf,
}

impl Target {
    /// Checks that `out_dir` may be (re)placed and creates a fresh temporary directory next to it.
    fn prepare(out_dir: &Path) -> Result<Self> {
        if out_dir.as_os_str().is_empty() {
            bail!("empty output directory path");
        }
        let dir = std::path::absolute(out_dir).map_err(|e| anyhow!("{}: invalid path: {e}", out_dir.display()))?;
        // Normalise `.`/`..` so the directory has a real file name to put the sibling next to.
        let dir = if dir.exists() { dir.canonicalize().map_err(|e| anyhow!("{}: {e}", dir.display()))? } else { dir };
        if dir.exists() {
            if !dir.is_dir() {
                bail!("{}: exists and is not a directory", dir.display());
            }
            let mut entries = std::fs::read_dir(&dir).map_err(|e| anyhow!("{}: cannot read: {e}", dir.display()))?;
            let empty = entries.next().is_none();
            if !empty && !dir.join(MARKER).is_file() {
                bail!(
                    "{}: directory is not empty and is not a previous `lily synth` output (no {MARKER}); refusing to overwrite it",
                    dir.display()
                );
            }
        }
        let name = dir.file_name().with_context(|| format!("{}: output path has no directory name", dir.display()))?;
        let parent = dir.parent().with_context(|| format!("{}: output path has no parent directory", dir.display()))?;
        std::fs::create_dir_all(parent).map_err(|e| anyhow!("{}: cannot create directory: {e}", parent.display()))?;
        let sibling = |what: &str| parent.join(format!(".{}.lily-synth-{what}", name.to_string_lossy()));
        let (tmp, old) = (sibling("partial"), sibling("old"));
        for stale in [&tmp, &old] {
            if stale.exists() {
                std::fs::remove_dir_all(stale).map_err(|e| anyhow!("{}: cannot remove stale directory: {e}", stale.display()))?;
            }
        }
        std::fs::create_dir(&tmp).map_err(|e| anyhow!("{}: cannot create directory: {e}", tmp.display()))?;
        Ok(Target { dir, tmp, old })
    }

    /// Moves the finished temporary directory into place (replacing a previous output).
    fn commit(&self) -> Result<()> {
        let fail = |what: &str, p: &Path, e: std::io::Error| anyhow!("{}: cannot {what}: {e}", p.display());
        if self.dir.exists() {
            std::fs::rename(&self.dir, &self.old).map_err(|e| fail("move aside the previous output", &self.dir, e))?;
        }
        if let Err(e) = std::fs::rename(&self.tmp, &self.dir) {
            let _ = std::fs::rename(&self.old, &self.dir);
            return Err(fail("move the new checkpoint into place", &self.dir, e));
        }
        if self.old.exists() {
            std::fs::remove_dir_all(&self.old).map_err(|e| fail("remove the previous output", &self.old, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_parsing() {
        assert_eq!("tiny".parse::<Preset>().unwrap(), Preset::Tiny);
        assert_eq!("35b-a3b".parse::<Preset>().unwrap(), Preset::Qwen35bA3b);
        assert_eq!(Preset::Qwen35bA3b.config(), ModelConfig::qwen36_35b_a3b());
        let e = "huge".parse::<Preset>().unwrap_err().to_string();
        assert!(e.contains("tiny") && e.contains("35b-a3b"), "{e}");
        for p in Preset::ALL {
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
    }
}
