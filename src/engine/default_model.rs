//! The embedded default model: when no `--model` is given, Lily runs the tiny synthetic
//! checkpoint, written once into the user's cache directory.

use crate::synth::{synthesize, Preset};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Seed of the embedded default (the goldens are pinned to it too).
pub const DEFAULT_SEED: u64 = 0;

/// Where the embedded default lives: `$LILY_CACHE_DIR`, else the platform cache dir
/// (`~/.cache/lily` on Linux), else `./.lily-cache`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LILY_CACHE_DIR") {
        return PathBuf::from(d);
    }
    dirs::cache_dir().map(|d| d.join("lily")).unwrap_or_else(|| PathBuf::from(".lily-cache"))
}

/// Returns `model` if given, else the tiny synthetic checkpoint (generating it on first use),
/// printing a notice that its weights are random.
pub fn resolve_model(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(m) = model {
        return Ok(m.to_path_buf());
    }
    let dir = cache_dir().join(format!("tiny-synthetic-seed{DEFAULT_SEED}-v1"));
    if !dir.join("config.json").exists() {
        eprintln!("lily: no --model given; writing the embedded tiny synthetic checkpoint to {} (once)", dir.display());
        std::fs::create_dir_all(dir.parent().unwrap_or(Path::new("."))).with_context(|| format!("cannot create {}", dir.display()))?;
        synthesize(&Preset::Tiny.config(), &dir, DEFAULT_SEED, false)?;
    }
    eprintln!(
        "lily: using the embedded tiny synthetic checkpoint at {} — its weights are RANDOM, so the text is gibberish; pass --model DIR for a real Qwen3.6-35B-A3B MLX 4-bit checkpoint",
        dir.display()
    );
    Ok(dir)
}
