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
        let parent = dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        // Written beside it and renamed into place, so processes starting together never read a
        // half-written checkpoint: the first rename wins, the others drop their copies.
        let tmp = tempfile::Builder::new().prefix(".tiny-synthetic-").tempdir_in(parent).with_context(|| format!("cannot write into {}", parent.display()))?;
        synthesize(&Preset::Tiny.config(), tmp.path(), DEFAULT_SEED, false)?;
        if let Err(e) = std::fs::rename(tmp.path(), &dir) {
            if !dir.join("config.json").exists() {
                return Err(e).with_context(|| format!("cannot move the checkpoint into {}", dir.display()));
            }
        }
    }
    eprintln!(
        "lily: using the embedded tiny synthetic checkpoint at {} — its weights are RANDOM, so the text is gibberish; pass --model DIR for a real Qwen3.6-35B-A3B MLX 4-bit checkpoint",
        dir.display()
    );
    Ok(dir)
}
