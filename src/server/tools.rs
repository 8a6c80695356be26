//! Streams Qwen's XML tool calls out of the content text as OpenAI tool-call deltas:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! becomes `{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}`. A parameter value
//! keeps its JSON type when it parses as JSON and the tool's schema does not declare it a
//! string; otherwise it is a string. The JSON form `<tool_call>{"name":..,"arguments":..}`
//! (Qwen3) is understood too. The name is emitted before any argument text, and arguments
//! stream one parameter at a time. XML never reaches the content.

use super::stop::partial_suffix;
use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    Content(String),
    /// First delta of a call: id, type and name.
    Start { index: usize, id: String, name: String },
    /// A fragment of the JSON arguments string.
    Args { index: usize, fragment: String },
}

#[derive(Debug, Clone)]
enum State {
    Outside,
    /// After `<tool_call>`; `name` once `<function=...>` was read; `params` = parameters emitted.
    Inside { name: Option<String>, params: usize, closed_fn: bool },
}

#[derive(Debug, Clone)]
pub struct ToolParser {
    schemas: Map<String, Value>,
    buf: String,
    state: State,
    calls: usize,
    /// The last call was cut (end of generation before `</function>`): its arguments stay
    /// partial and it does not count as a complete call.
    cut: bool,
}

pub fn new_call_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    let s: String = (0..24).map(|_| CHARS[rng.random_range(0..CHARS.len())] as char).collect();
    format!("call_{s}")
}

/// Converts a parameter's text to a JSON value, guided by the tool schema.
pub fn convert_value(schemas: &Map<String, Value>, func: &str, key: &str, raw: &str) -> Value {
    let declared = schemas.get(func).and_then(|s| s.get("properties")).and_then(|p| p.get(key)).and_then(|p| p.get("type"));
    let is_string = match declared {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().all(|t| t == "string" || t == "null") && ts.iter().any(|t| t == "string"),
        _ => false,
    };
    if is_string {
        return Value::String(raw.to_string());
    }
    // A number the schema types as one, written with leading zeros ("007", which JSON rejects).
    let numeric = |t: &str| matches!(declared, Some(Value::String(d)) if d == t) || matches!(declared, Some(Value::Array(ts)) if ts.iter().any(|d| d == t));
    let trimmed = raw.trim();
    if numeric("integer") {
        if let Ok(i) = trimmed.parse::<i64>() {
            return Value::from(i);
        }
    }
    if numeric("number") {
        if let Some(n) = trimmed.parse::<f64>().ok().filter(|f| f.is_finite()).and_then(serde_json::Number::from_f64) {
            if serde_json::from_str::<Value>(trimmed).is_err() {
                return Value::Number(n);
            }
        }
    }
    match serde_json::from_str::<Value>(trimmed) {
        Ok(v) => v,
        Err(_) => {
            // Python-style literals the model sometimes writes.
            match raw.trim() {
                "True" => Value::Bool(true),
                "False" => Value::Bool(false),
                "None" => Value::Null,
                _ => Value::String(raw.to_string()),
            }
        }
    }
}

fn strip_one_newline(s: &str) -> &str {
    let s = s.strip_prefix('\n').unwrap_or(s);
    s.strip_suffix('\n').unwrap_or(s)
}

impl ToolParser {
    pub fn new(schemas: Map<String, Value>) -> Self {
        ToolParser { schemas, buf: String::new(), state: State::Outside, calls: 0, cut: false }
    }

    /// Calls started (each has had its `Start` event), the cut one included.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Calls that were completed (`</function>` read).
    pub fn complete_calls(&self) -> usize {
        self.calls - self.cut as usize
    }

    /// Whether generation ended inside a call's function (see [`ToolParser::finish`]).
    pub fn cut(&self) -> bool {
        self.cut
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drive(&mut out);
        out
    }

    fn emit_content(&self, out: &mut Vec<ToolEvent>, s: &str) {
        if s.is_empty() {
            return;
        }
        if let Some(ToolEvent::Content(c)) = out.last_mut() {
            c.push_str(s);
        } else {
            out.push(ToolEvent::Content(s.to_string()));
        }
    }

    fn drive(&mut self, out: &mut Vec<ToolEvent>) {
        loop {
            match &mut self.state {
                State::Outside => {
                    if let Some(i) = self.buf.find(OPEN) {
                        let before = self.buf[..i].to_string();
                        if !(self.calls > 0 && before.trim().is_empty()) {
                            self.emit_content(out, &before);
                        }
                        self.buf.drain(..i + OPEN.len());
                        self.state = State::Inside { name: None, params: 0, closed_fn: false };
                        continue;
                    }
                    let hold = partial_suffix(&self.buf, OPEN);
                    let cut = self.buf.len() - hold;
                    // After a tool call, whitespace waits: it is dropped unless text follows.
                    if self.calls > 0 && self.buf[..cut].trim().is_empty() {
                        return;
                    }
                    let s = self.buf[..cut].to_string();
                    self.emit_content(out, &s);
                    self.buf.drain(..cut);
                    return;
                }
                State::Inside { name, params, closed_fn } => {
                    let t = self.buf.trim_start();
                    let skipped = self.buf.len() - t.len();
                    if name.is_none() {
                        if t.starts_with('{') {
                            // JSON form: wait for the closing tag.
                            let Some(end) = t.find(CLOSE) else { return };
                            let body = t[..end].trim().to_string();
                            let consumed = skipped + end + CLOSE.len();
                            match serde_json::from_str::<Value>(&body) {
                                Ok(Value::Object(o)) if o.get("name").and_then(Value::as_str).is_some() => {
                                    let fname = o["name"].as_str().unwrap_or_default().to_string();
                                    let args = match o.get("arguments").or_else(|| o.get("parameters")) {
                                        Some(Value::String(s)) => s.clone(),
                                        Some(v) => v.to_string(),
                                        None => "{}".into(),
                                    };
                                    let index = self.calls;
                                    out.push(ToolEvent::Start { index, id: new_call_id(), name: fname });
                                    out.push(ToolEvent::Args { index, fragment: args });
                                    self.calls += 1;
                                }
                                _ => {
                                    let raw = format!("{OPEN}{}", &self.buf[..consumed]);
                                    self.emit_content(out, &raw);
                                }
                            }
                            self.buf.drain(..consumed);
                            self.state = State::Outside;
                            continue;
                        }
                        if let Some(rest) = t.strip_prefix("<function=") {
                            let Some(gt) = rest.find('>') else {
                                if rest.contains('\n') || rest.len() > 256 {
                                    self.fail_call(out);
                                    continue;
                                }
                                return;
                            };
                            let fname = rest[..gt].trim().to_string();
                            let consumed = skipped + "<function=".len() + gt + 1;
                            self.buf.drain(..consumed);
                            let index = self.calls;
                            out.push(ToolEvent::Start { index, id: new_call_id(), name: fname.clone() });
                            *name = Some(fname);
                            continue;
                        }
                        if t.is_empty() || "<function=".starts_with(t) {
                            return;
                        }
                        // Not a tool call after all.
                        self.fail_call(out);
                        continue;
                    }
                    let fname = name.clone().unwrap_or_default();
                    let index = self.calls;
                    if let Some(rest) = t.strip_prefix("<parameter=") {
                        let Some(gt) = rest.find('>') else { return };
                        let key = rest[..gt].trim().to_string();
                        let body = &rest[gt + 1..];
                        let Some(end) = body.find("</parameter>") else {
                            // A missing </parameter> before the next tag also ends the value.
                            if let Some(end) = body.find("<parameter=").or_else(|| body.find("</function>")) {
                                let raw = strip_one_newline(&body[..end]).to_string();
                                let consumed = skipped + "<parameter=".len() + gt + 1 + end;
                                self.emit_param(out, index, &fname, &key, &raw);
                                if let State::Inside { params, .. } = &mut self.state {
                                    *params += 1;
                                }
                                self.buf.drain(..consumed);
                                continue;
                            }
                            return;
                        };
                        let raw = strip_one_newline(&body[..end]).to_string();
                        let consumed = skipped + "<parameter=".len() + gt + 1 + end + "</parameter>".len();
                        let first = *params == 0;
                        *params += 1;
                        self.buf.drain(..consumed);
                        let _ = first;
                        self.emit_param_n(out, index, &fname, &key, &raw, first);
                        continue;
                    }
                    if let Some(_rest) = t.strip_prefix("</function>") {
                        if !*closed_fn {
                            let frag = if *params == 0 { "{}" } else { "}" };
                            out.push(ToolEvent::Args { index, fragment: frag.into() });
                            *closed_fn = true;
                        }
                        self.buf.drain(..skipped + "</function>".len());
                        continue;
                    }
                    if t.starts_with(CLOSE) {
                        if !*closed_fn {
                            let frag = if *params == 0 { "{}" } else { "}" };
                            out.push(ToolEvent::Args { index, fragment: frag.into() });
                        }
                        self.buf.drain(..skipped + CLOSE.len());
                        self.calls += 1;
                        self.state = State::Outside;
                        continue;
                    }
                    if t.is_empty() || "<parameter=".starts_with(t) || "</function>".starts_with(t) || CLOSE.starts_with(t) {
                        return;
                    }
                    // Stray text inside a call: skip to the next tag.
                    match t[1..].find('<') {
                        Some(j) => {
                            self.buf.drain(..skipped + 1 + j);
                        }
                        None => {
                            self.buf.clear();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn emit_param(&mut self, out: &mut Vec<ToolEvent>, index: usize, fname: &str, key: &str, raw: &str) {
        // Called before `params` is incremented by the caller.
        let first = matches!(self.state, State::Inside { params: 0, .. });
        self.emit_param_n(out, index, fname, key, raw, first);
    }

    fn emit_param_n(&self, out: &mut Vec<ToolEvent>, index: usize, fname: &str, key: &str, raw: &str, first: bool) {
        let v = convert_value(&self.schemas, fname, key, raw);
        let k = Value::String(key.to_string()).to_string();
        let fragment = format!("{}{}: {}", if first { "{" } else { ", " }, k, v);
        out.push(ToolEvent::Args { index, fragment });
    }

    /// The text after `<tool_call>` was not a call: give it back as content.
    fn fail_call(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = format!("{OPEN}{}", self.buf);
        self.buf.clear();
        self.state = State::Outside;
        self.emit_content(out, &raw);
    }

    /// End of generation: releases held text. A call whose function was closed is complete; one
    /// cut before `</function>` (end of sequence, max_tokens, a stop string) keeps the arguments
    /// streamed so far, unclosed, and is marked cut rather than passed off as a complete call.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        match std::mem::replace(&mut self.state, State::Outside) {
            State::Outside => {
                let rest = std::mem::take(&mut self.buf);
                if !(self.calls > 0 && rest.trim().is_empty()) {
                    self.emit_content(&mut out, &rest);
                }
            }
            State::Inside { name: None, .. } => {
                let raw = format!("{OPEN}{}", std::mem::take(&mut self.buf));
                self.emit_content(&mut out, &raw);
            }
            State::Inside { name: Some(_), closed_fn, .. } => {
                self.buf.clear();
                self.cut = !closed_fn;
                self.calls += 1;
            }
        }
        out
    }
}

/// Collected result of a whole text (non-streaming use and tests).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParsedOutput {
    pub content: String,
    /// (name, arguments JSON string)
    pub calls: Vec<(String, String)>,
}

pub fn collect(events: impl IntoIterator<Item = ToolEvent>, into: &mut ParsedOutput) {
    for e in events {
        match e {
            ToolEvent::Content(c) => into.content.push_str(&c),
            ToolEvent::Start { name, .. } => into.calls.push((name, String::new())),
            ToolEvent::Args { index, fragment } => {
                if let Some(c) = into.calls.get_mut(index) {
                    c.1.push_str(&fragment);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_pieces(schemas: Value, pieces: &[&str]) -> ParsedOutput {
        let mut p = ToolParser::new(schemas.as_object().cloned().unwrap_or_default());
        let mut out = ParsedOutput::default();
        for s in pieces {
            collect(p.push(s), &mut out);
        }
        collect(p.finish(), &mut out);
        out
    }

    fn char_pieces(s: &str) -> Vec<String> {
        s.chars().map(|c| c.to_string()).collect()
    }

    const CALL: &str = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn xml_call_any_split() {
        let schemas = json!({"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}});
        let whole = parse_pieces(schemas.clone(), &[CALL]);
        let pieces = char_pieces(CALL);
        let by_char = parse_pieces(schemas, &pieces.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(whole, by_char);
        assert_eq!(whole.content, "Let me check.\n\n");
        assert_eq!(whole.calls.len(), 1);
        assert_eq!(whole.calls[0].0, "get_weather");
        let args: Value = serde_json::from_str(&whole.calls[0].1).unwrap();
        assert_eq!(args, json!({"city": "Paris", "days": 3, "opts": {"metric": true}}));
    }

    #[test]
    fn schema_numbers_with_leading_zeros_are_numbers() {
        let schemas = json!({"f": {"properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "s": {"type": "string"}}}});
        let m = schemas.as_object().unwrap();
        assert_eq!(convert_value(m, "f", "n", "007"), json!(7));
        assert_eq!(convert_value(m, "f", "n", " -12 "), json!(-12));
        assert_eq!(convert_value(m, "f", "x", "0.50"), json!(0.5));
        assert_eq!(convert_value(m, "f", "x", "007.5"), json!(7.5));
        assert_eq!(convert_value(m, "f", "s", "007"), json!("007"));
        assert_eq!(convert_value(m, "f", "n", "seven"), json!("seven"));
    }

    #[test]
    fn string_schema_keeps_numbers_as_strings_and_two_calls() {
        let schemas = json!({"f": {"properties": {"zip": {"type": "string"}}}});
        let text = "<tool_call>\n<function=f>\n<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>\n";
        let out = parse_pieces(schemas, &[text]);
        assert_eq!(out.content, "");
        assert_eq!(out.calls, vec![("f".into(), "{\"zip\": \"01234\"}".into()), ("g".into(), "{}".into())]);
    }

    #[test]
    fn json_form_and_false_alarm_and_truncation() {
        let out = parse_pieces(json!({}), &["<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"]);
        assert_eq!(out.calls, vec![("f".into(), "{\"a\":1}".into())]);
        let out = parse_pieces(json!({}), &["use <tool_call> tags like <tool_call>hello"]);
        assert_eq!(out.content, "use <tool_call> tags like <tool_call>hello");
        assert!(out.calls.is_empty());
        // Cut before </function>: the arguments so far, unclosed, and the call marked cut.
        let mut p = ToolParser::new(Map::new());
        let mut out = ParsedOutput::default();
        collect(p.push("<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n"), &mut out);
        collect(p.finish(), &mut out);
        assert_eq!(out.calls, vec![("f".into(), "{\"a\": \"x\"".into())]);
        assert!(p.cut() && p.calls() == 1 && p.complete_calls() == 0);
        let out = parse_pieces(json!({}), &["<tool_call>\n<function=f>\n"]);
        assert_eq!(out.calls, vec![("f".into(), String::new())]);
        // Closed function, missing </tool_call>: complete.
        let mut p = ToolParser::new(Map::new());
        collect(p.push("<tool_call>\n<function=f>\n</function>\n"), &mut ParsedOutput::default());
        p.finish();
        assert!(!p.cut() && p.complete_calls() == 1);
        let out = parse_pieces(json!({}), &["plain <tool_ca"]);
        assert_eq!(out.content, "plain <tool_ca");
    }
}
