//! GPT-2 byte-level alphabet (`bytes_to_unicode`): every byte is written as one printable
//! Unicode character so that byte-level BPE vocab entries are valid JSON strings.
//!
//! Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, 0x7F-0xA0,
//! 0xAD) map to U+0100.. in byte order. Both directions are total over their domain, so the
//! vocab in tokenizer.json round-trips to exact token bytes.

const fn is_printable(b: u8) -> bool {
    matches!(b, 33..=126 | 161..=172 | 174..=255)
}

/// byte -> char code point.
const BYTE_TO_CP: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        t[b] = if is_printable(b as u8) {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        b += 1;
    }
    t
};

/// (code point - 256) -> byte, for the 68 remapped bytes.
const REMAPPED: [u8; 68] = {
    let mut t = [0u8; 68];
    let mut n = 0usize;
    let mut b = 0usize;
    while b < 256 {
        if !is_printable(b as u8) {
            t[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    t
};

/// The byte-level character for one byte.
pub fn byte_char(b: u8) -> char {
    // All table entries are < 0x200, so they are valid scalar values.
    char::from_u32(BYTE_TO_CP[b as usize]).unwrap_or('\u{FFFD}')
}

/// Encode raw bytes as a byte-level string (the form used in tokenizer.json vocab/merges).
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_char(b)).collect()
}

/// Inverse of [`byte_char`]; `None` for characters outside the alphabet.
pub fn char_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp < 256 && is_printable(cp as u8) {
        Some(cp as u8)
    } else if (256..256 + 68).contains(&cp) {
        Some(REMAPPED[(cp - 256) as usize])
    } else {
        None
    }
}

/// Decode a byte-level string; `None` if any character is outside the alphabet.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    s.chars().map(char_byte).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_characters() {
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'\t'), 'ĉ');
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(0xAD), '\u{143}'); // the last remapped byte
    }

    #[test]
    fn round_trip_all_bytes() {
        let all: Vec<u8> = (0..=255).collect();
        let s = encode(&all);
        assert_eq!(s.chars().count(), 256);
        assert_eq!(decode(&s).as_deref(), Some(&all[..]));
        assert_eq!(decode("a€"), None);
    }
}
