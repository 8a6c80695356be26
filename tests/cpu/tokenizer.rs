//! Tokenizer goldens: the tokenizer.json written by `write_tokenizer_files` (loaded through HF
//! `tokenizers`) must reproduce tiktoken's ids for the vendored Qwen3.6 ranks on a multilingual /
//! code / emoji / whitespace corpus (goldens from scripts/tokenizer_goldens.py).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lily::tokenizer::{write_tokenizer_files, StreamDecoder, Tokenizer};
use serde_json::Value;

struct Fixture {
    _dir: tempfile::TempDir,
    path: PathBuf,
    tok: Tokenizer,
}

/// Written and loaded once per test binary (building the 248k-entry vocab takes a moment).
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        write_tokenizer_files(dir.path()).expect("write_tokenizer_files");
        let tok = Tokenizer::load(dir.path()).expect("load tokenizer");
        Fixture {
            path: dir.path().to_path_buf(),
            _dir: dir,
            tok,
        }
    })
}

fn tok() -> &'static Tokenizer {
    &fixture().tok
}

fn goldens_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

fn read_json(name: &str) -> Value {
    let path = goldens_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

struct Case {
    name: String,
    text: String,
    nfc: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let expected = read_json("tokenizer_expected.json");
    let cases: Vec<Case> = expected["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            text: c["text"].as_str().unwrap().to_string(),
            nfc: c["nfc"].as_str().unwrap().to_string(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect();
    // The goldens must have been generated from the committed corpus (same names, same text).
    let corpus = read_json("tokenizer_corpus.json");
    let corpus: Vec<(&str, &str)> = corpus
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["text"].as_str().unwrap()))
        .collect();
    let got: Vec<(&str, &str)> = cases
        .iter()
        .map(|c| (c.name.as_str(), c.text.as_str()))
        .collect();
    assert_eq!(
        got, corpus,
        "tokenizer_expected.json is stale: rerun scripts/tokenizer_goldens.py"
    );
    assert!(cases.len() >= 40);
    cases
}

#[test]
fn corpus_matches_tiktoken_goldens() {
    let mut failures = Vec::new();
    for c in cases() {
        let ids = tok().encode(&c.text).unwrap();
        if ids != c.ids {
            failures.push(format!("{}:\n  got  {:?}\n  want {:?}", c.name, ids, c.ids));
        }
    }
    assert!(
        failures.is_empty(),
        "{} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_round_trips_the_corpus() {
    for c in cases() {
        let ids = tok().encode(&c.text).unwrap();
        // The normaliser is NFC, so the round trip gives the NFC form (== text for NFC input).
        assert_eq!(tok().decode(&ids, false).unwrap(), c.nfc, "{}", c.name);
        let concat: Vec<u8> = ids
            .iter()
            .flat_map(|&i| tok().token_bytes(i).to_vec())
            .collect();
        assert_eq!(concat, c.nfc.as_bytes(), "{}: token_bytes concat", c.name);
    }
}

#[test]
fn special_tokens_in_text_map_to_their_ids() {
    let t = tok();
    for (s, id) in [
        ("<|endoftext|>", 248044),
        ("<|im_start|>", 248045),
        ("<|im_end|>", 248046),
        ("<|vision_start|>", 248053),
        ("<|image_pad|>", 248056),
        ("<tool_call>", 248058),
        ("</tool_call>", 248059),
        ("<tool_response>", 248066),
        ("</tool_response>", 248067),
        ("<think>", 248068),
        ("</think>", 248069),
        ("<|audio_pad|>", 248076),
    ] {
        assert_eq!(t.encode(s).unwrap(), vec![id], "{s}");
        assert_eq!(t.token_id(s), Some(id), "{s}");
        assert_eq!(t.token_bytes(id), s.as_bytes(), "{s}");
        assert_eq!(
            t.encode(&format!("a{s}b")).unwrap(),
            vec![64, id, 65],
            "{s} inside text"
        );
    }
    // All 33 added tokens, in order, with the right special flags.
    for (i, (s, special)) in lily::tokenizer::SPECIAL_TOKENS.iter().enumerate() {
        let id = 248044 + i as u32;
        assert_eq!(t.token_id(s), Some(id));
        assert_eq!(t.is_special(id), *special, "{s}");
        assert!(t.is_added(id));
    }
    assert_eq!(t.vocab_size(), 248077);
    assert!(!t.is_special(198) && !t.is_added(198));
}

#[test]
fn chat_example_from_model_md() {
    // model.md §6.2: thinking on ends `…assistant\n<think>\n`.
    let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let ids = tok().encode(prompt).unwrap();
    assert_eq!(&ids[..3], &[248045, 846, 198]);
    assert!(
        ids.ends_with(&[248046, 198, 248045, 74455, 198, 248068, 198]),
        "{ids:?}"
    );
    // Rendering the template then encoding gives the same ids.
    let tmpl = lily::tokenizer::ChatTemplate::load(&fixture().path).unwrap();
    let text = tmpl
        .render(
            &serde_json::json!([{"role": "user", "content": "Hi"}]),
            None,
            true,
            &serde_json::Map::new(),
        )
        .unwrap();
    assert_eq!(text, prompt);
}

#[test]
fn decode_skip_special_keeps_protocol_tags() {
    let t = tok();
    let ids = t
        .encode("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>")
        .unwrap();
    assert_eq!(
        t.decode(&ids, true).unwrap(),
        "assistant\n<think>\nhmm\n</think>\n\nok"
    );
    assert_eq!(t.decode(&[248100, 65], false).unwrap(), "b"); // ids beyond the vocab are dropped
    assert!(t.token_bytes(248100).is_empty() && t.token_bytes(u32::MAX).is_empty());
}

#[test]
fn token_lookup() {
    let t = tok();
    assert_eq!(t.token_id("\n"), Some(198));
    assert_eq!(t.token_id("user"), Some(846));
    assert_eq!(t.token_id("assistant"), Some(74455));
    assert_eq!(t.token_bytes(198), b"\n");
    assert_eq!(t.token_id("definitely not one token"), None);
}

#[test]
fn write_is_deterministic_and_loads_with_config() {
    let a = tempfile::tempdir().unwrap();
    write_tokenizer_files(a.path()).unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let x = std::fs::read(a.path().join(name)).unwrap();
        let y = std::fs::read(fixture().path.join(name)).unwrap();
        assert!(x == y, "{name} differs between two writes");
    }
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(a.path().join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["tokenizer_class"], "Qwen3_5Tokenizer");
    assert_eq!(cfg["eos_token"], "<|im_end|>");
    assert_eq!(cfg["pad_token"], "<|endoftext|>");
    assert_eq!(cfg["model_max_length"], 262144);
    assert!(cfg["bos_token"].is_null());
    assert_eq!(cfg["added_tokens_decoder"]["248068"]["content"], "<think>");
    assert_eq!(cfg["added_tokens_decoder"]["248068"]["special"], false);
    assert_eq!(cfg["added_tokens_decoder"]["248046"]["special"], true);
    assert_eq!(
        std::fs::read_to_string(a.path().join("chat_template.jinja")).unwrap(),
        lily::tokenizer::QWEN36_CHAT_TEMPLATE
    );
}

#[test]
fn qwen3_5_class_imposes_the_marks_regex() {
    // A tokenizer.json carrying Qwen2's regex (no \p{M}), as some Qwen3.5-family releases do.
    let dir = tempfile::tempdir().unwrap();
    let json = std::fs::read_to_string(fixture().path.join("tokenizer.json")).unwrap();
    let qwen2 = json
        .replace(
            r"[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+",
            r"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+",
        )
        .replace(r" ?[^\\s\\p{L}\\p{M}\\p{N}]+", r" ?[^\\s\\p{L}\\p{N}]+");
    assert_ne!(qwen2, json, "regex rewrite did not apply");
    std::fs::write(dir.path().join("tokenizer.json"), qwen2).unwrap();
    let hindi = cases().into_iter().find(|c| c.name == "hindi").unwrap();

    // Without a config (or with another class) the file's pipeline is used as is: ids differ.
    let plain = Tokenizer::load(dir.path()).unwrap();
    assert_ne!(plain.encode(&hindi.text).unwrap(), hindi.ids);

    // Qwen3_5Tokenizer (what our config says) gets transformers' pipeline back: goldens match.
    std::fs::copy(
        fixture().path.join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let fixed = Tokenizer::load(dir.path()).unwrap();
    for c in cases() {
        assert_eq!(fixed.encode(&c.text).unwrap(), c.ids, "{}", c.name);
    }
}

#[test]
fn load_error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && !err.contains('\n'),
        "{err}"
    );
    std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
    let err = Tokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}

// ---- StreamDecoder -------------------------------------------------------------------------

/// Feeds ids one at a time; checks every chunk is whole text and the total is `want`.
fn stream_all(ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut d = StreamDecoder::new().skip_special(skip_special);
    let chunks: Vec<String> = ids.iter().map(|&id| d.push(tok(), id)).collect();
    let tail = d.finish();
    (chunks, tail)
}

#[test]
fn stream_multibyte_split_across_tokens() {
    let t = tok();
    for text in [
        "👨‍👩‍👧‍👦 family 🏳️‍🌈 🇯🇵🇩🇪",
        "你好，世界！生僻字：龘靐齉䨻𪚥",
        "🦀🚀 emoji then ascii",
        "हिन्दी 𑀅𑀲𑁄𑀓 ᚠᛇᚻ ཀྵ་བོད་",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 🀄",
    ] {
        let ids = t.encode(text).unwrap();
        // The point of the test: some token must end inside a character.
        let splits = ids
            .iter()
            .filter(|&&i| std::str::from_utf8(t.token_bytes(i)).is_err())
            .count();
        assert!(
            splits > 0,
            "{text}: no token splits a character, test proves nothing"
        );
        let (chunks, tail) = stream_all(&ids, false);
        for c in &chunks {
            assert!(
                !c.contains('\u{FFFD}'),
                "{text}: replacement char in chunk {c:?}"
            );
        }
        assert!(
            chunks.iter().any(|c| c.is_empty()),
            "{text}: nothing was held back"
        );
        assert_eq!(tail, "");
        assert_eq!(chunks.concat(), text);
    }
}

#[test]
fn stream_equals_decode_on_corpus() {
    for c in cases() {
        let ids = tok().encode(&c.text).unwrap();
        for skip in [false, true] {
            let (chunks, tail) = stream_all(&ids, skip);
            assert_eq!(
                chunks.concat() + &tail,
                tok().decode(&ids, skip).unwrap(),
                "{} skip={skip}",
                c.name
            );
        }
    }
}

#[test]
fn stream_matches_decode_on_arbitrary_id_sequences() {
    // Deterministic pseudo-random ids, including mid-character byte tokens and specials: the
    // stream (with its U+FFFD decisions) must equal HF's lossy whole-sequence decode.
    let t = tok();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut byte_tokens = vec![u32::MAX; 256];
    for id in 0..248044u32 {
        if let [b] = t.token_bytes(id) {
            byte_tokens[*b as usize] = id;
        }
    }
    assert!(!byte_tokens.contains(&u32::MAX), "every byte has a token");
    for _ in 0..300 {
        let len = (next() % 12) as usize + 1;
        let ids: Vec<u32> = (0..len)
            .map(|_| match next() % 4 {
                0 => byte_tokens[(next() % 256) as usize],
                1 => 248044 + (next() % 33) as u32,
                _ => (next() % 248044) as u32,
            })
            .collect();
        for skip in [false, true] {
            let (chunks, tail) = stream_all(&ids, skip);
            assert_eq!(
                chunks.concat() + &tail,
                t.decode(&ids, skip).unwrap(),
                "{ids:?} skip={skip}"
            );
        }
    }
}

/// A long text encoded in pieces cut at `safe_cuts` points (in parallel) gives exactly the ids
/// of encoding it whole, on texts mixing words, digits, contractions, accents and combining
/// marks, CJK, emoji, punctuation, runs of spaces and newlines, and added tokens.
#[test]
fn encoding_in_pieces_matches_encoding_whole() {
    let t = tok();
    assert!(t.encodes_in_parallel());
    let words = [
        "river", "Stone", "it's", "we'll", "café", "e\u{301}t\u{e9}", "naïve", "日本語", "中文", "🙂", "👍🏽", "x=1;", "fn(a, b)", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
        "123", "4567", "  ", "   ", "\n", "\n\n", " \n", "\t", "--", "...", "HTTP/1.1", "ÀB", "σίγμα", "क्षि",
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as usize % n
    };
    for case in 0..40 {
        let mut text = String::new();
        while text.len() < 3000 {
            text.push_str(words[next(words.len())]);
            if next(3) > 0 {
                text.push(' ');
            }
        }
        let whole = t.inner().encode(text.as_str(), false).unwrap().get_ids().to_vec();
        for piece in [7, 33, 200] {
            assert!(lily::tokenizer::safe_cuts(&text, piece).len() > 1, "case {case}: no cut in {text:?}");
            assert_eq!(t.encode_in_pieces(&text, piece).unwrap(), whole, "case {case}, pieces of {piece}: {text:?}");
        }
    }
    // The document of the serving benchmarks: one line of words and numbers.
    let doc: String = (0..20_000).map(|i| format!("{}{} ", ["river", "stone", "prism"][i % 3], 100 + i % 900)).collect();
    assert_eq!(t.encode(&doc).unwrap(), t.inner().encode(doc.as_str(), false).unwrap().get_ids().to_vec());
}
