//! Incremental, UTF-8-safe detokenization for streaming.
//!
//! Qwen's decoder is ByteLevel, so the decoded text of a sequence is exactly the concatenation of
//! its tokens' bytes, read lossily as UTF-8. A token can end in the middle of a character (emoji
//! and CJK are often split across byte-level tokens), so the stream keeps the incomplete tail and
//! emits only whole characters. Bytes that can never become valid turn into U+FFFD as soon as
//! that is certain, using the same maximal-subpart rule as `String::from_utf8_lossy`; the
//! concatenated output therefore equals `Tokenizer::decode` of the whole sequence.

use super::Tokenizer;

/// Per-stream state: at most 3 pending bytes of an incomplete character.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder that emits special tokens' text (like `decode(ids, false)`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Builder: drop `special: true` tokens (like `decode(ids, true)`).
    pub fn skip_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Feeds one token id; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if self.skip_special && tok.is_special(id) {
            return String::new();
        }
        self.push_bytes(tok.token_bytes(id))
    }

    /// Feeds raw bytes; returns the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Invalid no matter what follows.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start = valid + n;
                        }
                        // A valid prefix of a character: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// True when bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: flushes held-back bytes lossily (U+FFFD) and resets.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&[u8]]) -> (Vec<String>, String) {
        let mut d = StreamDecoder::new();
        let parts: Vec<String> = chunks.iter().map(|c| d.push_bytes(c)).collect();
        let tail = d.finish();
        (parts, tail)
    }

    #[test]
    fn holds_back_split_characters() {
        let crab = "🦀".as_bytes(); // F0 9F A6 80
        let (parts, tail) = feed(&[b"a", &crab[..1], &crab[1..3], &crab[3..], "中".as_bytes()]);
        assert_eq!(parts, ["a", "", "", "🦀", "中"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn invalid_bytes_become_replacement_once_certain() {
        // E4 B8 is a valid prefix of 中; 'A' proves it will never complete.
        let (parts, tail) = feed(&[&[0xE4, 0xB8], b"A", &[0xFF], b"b"]);
        assert_eq!(parts, ["", "\u{FFFD}A", "\u{FFFD}", "b"]);
        assert_eq!(tail, "");
        // Matches from_utf8_lossy over the whole stream.
        let all = [0xE4, 0xB8, b'A', 0xFF, b'b'];
        assert_eq!(parts.concat(), String::from_utf8_lossy(&all));
    }

    #[test]
    fn finish_flushes_incomplete_tail_lossily() {
        let (parts, tail) = feed(&[b"x", &[0xF0, 0x9F]]);
        assert_eq!(parts, ["x", ""]);
        assert_eq!(tail, "\u{FFFD}");
        let mut d = StreamDecoder::new();
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn matches_lossy_decode_for_every_split() {
        // Every way of cutting a mixed valid/invalid byte string into two or three chunks.
        let data: Vec<u8> = [
            "é🦀".as_bytes(),
            &[0xC3],
            b"x",
            &[0xF0, 0x9F, 0x98],
            "ü".as_bytes(),
            &[0xED, 0xA0, 0x80],
        ]
        .concat();
        let want = String::from_utf8_lossy(&data).into_owned();
        for i in 0..=data.len() {
            for j in i..=data.len() {
                let mut d = StreamDecoder::new();
                let mut got = d.push_bytes(&data[..i]);
                got += &d.push_bytes(&data[i..j]);
                got += &d.push_bytes(&data[j..]);
                got += &d.finish();
                assert_eq!(got, want, "split at {i},{j}");
            }
        }
    }
}
