//! Entry points shared by the cargo-fuzz target (fuzz/) and the in-tree smoke test that runs
//! them on generated inputs: request parsing, chat-template rendering of whatever parses, and
//! the output pipeline (stop strings, reasoning, tool calls) on arbitrary text split at
//! arbitrary points. None of them may panic.

use super::output::OutputPipeline;
use super::request::{self, Endpoint, PromptInput};
use crate::tokenizer::{ChatTemplate, QWEN36_CHAT_TEMPLATE};
use std::sync::OnceLock;

fn template() -> Option<&'static ChatTemplate> {
    static T: OnceLock<Option<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| ChatTemplate::from_source(QWEN36_CHAT_TEMPLATE).ok()).as_ref()
}

/// Parses `data` as both request kinds and renders every chat request that parses.
pub fn request_and_template(data: &[u8]) {
    for ep in [Endpoint::Chat, Endpoint::Completion] {
        if let Ok(req) = request::parse(ep, data, &crate::engine::sampling::SamplingParams::openai()) {
            if let PromptInput::Chat { messages, tools, kwargs, .. } = &req.prompt {
                if let Some(t) = template() {
                    let _ = t.render(messages, tools.as_ref(), true, kwargs);
                }
            }
        }
    }
}

/// Runs the output pipeline over `data` (first byte: options; the rest: text cut into pieces
/// at the positions given by the bytes of the text itself).
pub fn output_pipeline(data: &[u8]) {
    let Some((&opts, rest)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(rest);
    let stops = match opts % 4 {
        0 => vec![],
        1 => vec!["</think>".to_string()],
        2 => vec!["\n\n".to_string(), "<tool".to_string()],
        _ => vec!["a".to_string(), "é".to_string()],
    };
    let reasoning = match (opts >> 2) % 3 {
        0 => None,
        1 => Some(true),
        _ => Some(false),
    };
    let tools = if opts & 0x20 != 0 { Some(serde_json::Map::new()) } else { None };
    let mut p = OutputPipeline::new(stops, reasoning, tools);
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < text.len() {
        let step = 1 + (bytes[i] as usize % 7);
        let mut j = (i + step).min(text.len());
        while !text.is_char_boundary(j) {
            j += 1;
        }
        let (_, hit) = p.push(&text[i..j]);
        if hit {
            return;
        }
        i = j;
    }
    let _ = p.finish("");
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const SEEDS: &[&str] = &[
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
        r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"}]},{"role":"assistant","content":null,"reasoning_content":"r","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":[1,{\"b\":null}]}"}}]},{"role":"tool","tool_call_id":"c","content":"ok"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"array"}}}}}],"chat_template_kwargs":{"enable_thinking":false,"preserve_thinking":true}}"#,
        r#"{"prompt":[1,2,3],"logprobs":2,"stop":["x"],"stream":true,"stream_options":{"include_usage":true}}"#,
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>reasoning</think>\n\ncontent",
    ];

    #[test]
    fn fuzz_entry_points_survive_mutations() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..3000 {
            let mut d = SEEDS[rng.random_range(0..SEEDS.len())].as_bytes().to_vec();
            for _ in 0..rng.random_range(0..6) {
                let n = d.len().max(1);
                match rng.random_range(0..4) {
                    0 if !d.is_empty() => {
                        let i = rng.random_range(0..d.len());
                        d[i] = rng.random();
                    }
                    1 if !d.is_empty() => {
                        let i = rng.random_range(0..d.len());
                        d.remove(i);
                    }
                    2 => {
                        let i = rng.random_range(0..n);
                        let tok: &[u8] = [&b"{"[..], b"}", b"[", b"]", b"\"", b"null", b"<think>", b"</think>", b"<tool_call>", b"\xff", b"1e999", b"-1"][rng.random_range(0..12)];
                        d.splice(i.min(d.len())..i.min(d.len()), tok.iter().copied());
                    }
                    _ => {
                        let i = rng.random_range(0..n).min(d.len());
                        d.truncate(i);
                    }
                }
            }
            request_and_template(&d);
            output_pipeline(&d);
        }
    }
}
