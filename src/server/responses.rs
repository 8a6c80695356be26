//! OpenAI response bodies: chat.completion, chat.completion.chunk, text_completion, usage and
//! logprobs, built from worker events.

use super::output::Delta;
use super::tools::ToolEvent;
use super::worker::{TokenLogprob, Usage};
use serde_json::{json, Map, Value};

/// Which reasoning field names the server emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningField {
    /// `reasoning_content` (DeepSeek, llama.cpp) and `reasoning` (vLLM) both.
    Both,
    ReasoningContent,
    Reasoning,
}

impl ReasoningField {
    fn names(self) -> &'static [&'static str] {
        match self {
            ReasoningField::Both => &["reasoning_content", "reasoning"],
            ReasoningField::ReasoningContent => &["reasoning_content"],
            ReasoningField::Reasoning => &["reasoning"],
        }
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

fn bytes_json(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|&x| Value::from(x)).collect())
}

/// Chat-format logprob entries: `[{token, logprob, bytes, top_logprobs: [...]}]`.
pub fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    Value::Array(
        lps.iter()
            .map(|l| {
                json!({
                    "token": l.token, "logprob": l.logprob, "bytes": bytes_json(&l.bytes),
                    "top_logprobs": l.top.iter().map(|(t, b, lp)| json!({"token": t, "logprob": lp, "bytes": bytes_json(b)})).collect::<Vec<_>>()
                })
            })
            .collect(),
    )
}

/// Completions-format logprobs: `{tokens, token_logprobs, top_logprobs, text_offset}`.
/// `text_offset` counts characters (as OpenAI and vLLM do), from `offset0`.
/// Completions logprobs of an echoed prompt's tokens (offsets from 0) followed by the generated
/// tokens' (offsets after the prompt's `prompt_chars` characters).
pub fn echoed_logprobs(prompt: &[TokenLogprob], generated: &[TokenLogprob], prompt_chars: usize) -> Value {
    let (mut a, b) = (completion_logprobs(prompt, 0), completion_logprobs(generated, prompt_chars));
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[k].as_array_mut(), b[k].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

pub fn completion_logprobs(lps: &[TokenLogprob], offset0: usize) -> Value {
    let mut off = offset0;
    let mut offsets = Vec::new();
    for l in lps {
        offsets.push(off);
        off += l.token.chars().count();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        // The first prompt token (NaN: nothing before it) has null for both.
        "top_logprobs": lps.iter().map(|l| {
            if l.logprob.is_nan() { return Value::Null; }
            let mut m = Map::new();
            for (t, _, lp) in &l.top { m.insert(t.clone(), json!(lp)); }
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn tool_call_deltas(events: &[ToolEvent]) -> Vec<Value> {
    events
        .iter()
        .map(|e| match e {
            ToolEvent::Start { index, id, name } => json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}),
            ToolEvent::Args { index, fragment } => json!({"index": index, "function": {"arguments": fragment}}),
            ToolEvent::Content(_) => Value::Null,
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Builds the chunks of one streamed response (same id and created on every chunk), for its
/// choices by index.
pub struct ChunkBuilder {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    reasoning: ReasoningField,
    /// Completions: characters of each choice's text so far (logprobs' `text_offset`).
    text_offset: Vec<usize>,
}

impl ChunkBuilder {
    pub fn new(id: String, created: u64, model: String, chat: bool, include_usage: bool, reasoning: ReasoningField, choices: usize) -> Self {
        ChunkBuilder { id, created, model, chat, include_usage, reasoning, text_offset: vec![0; choices] }
    }

    fn base(&self, choices: Vec<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "lily",
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// A chat choice's first chunk: the assistant role.
    pub fn role(&self, index: usize) -> Value {
        self.base(vec![json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})])
    }

    /// A completions choice's echoed prompt (with its logprobs, or null).
    pub fn echo(&mut self, index: usize, text: &str, logprobs: Value) -> Value {
        self.text_offset[index] = text.chars().count();
        self.base(vec![json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null})])
    }

    pub fn delta(&mut self, index: usize, d: &Delta, lps: &[TokenLogprob], want_logprobs: bool) -> Option<Value> {
        if self.chat {
            let mut delta = Map::new();
            if !d.reasoning.is_empty() {
                for n in self.reasoning.names() {
                    delta.insert((*n).into(), Value::String(d.reasoning.clone()));
                }
            }
            if !d.content.is_empty() {
                delta.insert("content".into(), Value::String(d.content.clone()));
            }
            let tc = tool_call_deltas(&d.tool_calls);
            if !tc.is_empty() {
                delta.insert("tool_calls".into(), Value::Array(tc));
            }
            if delta.is_empty() && (lps.is_empty() || !want_logprobs) {
                return None;
            }
            let logprobs = if want_logprobs && !lps.is_empty() { json!({"content": chat_logprobs(lps)}) } else { Value::Null };
            Some(self.base(vec![json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null})]))
        } else {
            if d.content.is_empty() && (lps.is_empty() || !want_logprobs) {
                return None;
            }
            let logprobs = if want_logprobs { completion_logprobs(lps, self.text_offset[index]) } else { Value::Null };
            self.text_offset[index] += d.content.chars().count();
            Some(self.base(vec![json!({"index": index, "text": d.content, "logprobs": logprobs, "finish_reason": null})]))
        }
    }

    pub fn finish(&self, index: usize, reason: &str) -> Value {
        if self.chat {
            self.base(vec![json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason})])
        } else {
            self.base(vec![json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})])
        }
    }

    pub fn usage(&self, u: &Usage) -> Value {
        let mut v = self.base(vec![]);
        v["usage"] = usage_json(u);
        v
    }
}

/// A whole (non-streamed) response with its choices.
pub fn response(chat: bool, id: &str, created: u64, model: &str, choices: Vec<Value>, usage: &Usage) -> Value {
    json!({
        "id": id, "object": if chat { "chat.completion" } else { "text_completion" }, "created": created, "model": model, "system_fingerprint": "lily",
        "choices": choices,
        "usage": usage_json(usage),
    })
}

/// Accumulates a whole (non-streamed) response.
#[derive(Default)]
pub struct Collected {
    pub reasoning: String,
    pub content: String,
    /// (id, name, arguments)
    pub calls: Vec<(String, String, String)>,
    pub logprobs: Vec<TokenLogprob>,
    /// The echoed prompt's entries (completions with echo and logprobs).
    pub prompt_logprobs: Vec<TokenLogprob>,
}

impl Collected {
    pub fn add(&mut self, d: Delta, lps: Vec<TokenLogprob>) {
        self.reasoning.push_str(&d.reasoning);
        self.content.push_str(&d.content);
        for e in d.tool_calls {
            match e {
                ToolEvent::Start { id, name, .. } => self.calls.push((id, name, String::new())),
                ToolEvent::Args { index, fragment } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.2.push_str(&fragment);
                    }
                }
                ToolEvent::Content(c) => self.content.push_str(&c),
            }
        }
        self.logprobs.extend(lps);
    }

    /// The calls in the chat message shape: `[{id, type: "function", function: {name, arguments}}]`.
    pub fn tool_calls(&self) -> Value {
        self.calls.iter().map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})).collect()
    }

    /// This choice of a chat.completion.
    pub fn chat_choice(&self, index: usize, finish: &str, want_logprobs: bool, rf: ReasoningField) -> Value {
        let mut msg = Map::new();
        msg.insert("role".into(), json!("assistant"));
        let content = if self.content.is_empty() && !self.calls.is_empty() { Value::Null } else { Value::String(self.content.clone()) };
        msg.insert("content".into(), content);
        msg.insert("refusal".into(), Value::Null);
        if !self.reasoning.is_empty() {
            for n in rf.names() {
                msg.insert((*n).into(), Value::String(self.reasoning.clone()));
            }
        }
        if !self.calls.is_empty() {
            msg.insert("tool_calls".into(), self.tool_calls());
        }
        let logprobs = if want_logprobs { json!({"content": chat_logprobs(&self.logprobs)}) } else { Value::Null };
        json!({"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish})
    }

    /// This choice of a text_completion (`echo`: the prompt text, echoed before the completion).
    pub fn completion_choice(&self, index: usize, finish: &str, want_logprobs: bool, echo: Option<&str>) -> Value {
        let text = format!("{}{}", echo.unwrap_or(""), self.content);
        let offset = echo.map(|e| e.chars().count()).unwrap_or(0);
        let logprobs = if want_logprobs { echoed_logprobs(&self.prompt_logprobs, &self.logprobs, offset) } else { Value::Null };
        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_offsets_count_characters_not_bytes() {
        let lp = |t: &str| TokenLogprob { token: t.into(), bytes: t.as_bytes().to_vec(), logprob: -1.0, top: vec![] };
        let v = completion_logprobs(&[lp("é"), lp("你好"), lp("a")], 3);
        assert_eq!(v["text_offset"], json!([3, 4, 6]));
    }
}
