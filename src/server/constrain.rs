//! Structured output by constrained decoding: what a request's output must match (a JSON schema,
//! a regex, a Lark grammar, one of several strings, or the tool calls `tool_choice` demands),
//! compiled by llguidance over the model's vocabulary, and the per-request matcher that masks each
//! step's logits before the sampler draws.
//!
//! The constraint applies to the answer: in a chat that starts inside a reasoning block it waits
//! until the reasoning ends (`</think>`), then every token goes through the matcher. Once the
//! grammar is complete only the end-of-sequence token is allowed, so the request ends there.

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Map, Value};
use std::sync::{Arc, OnceLock};

/// An output format a request asks for (`response_format`, `structured_outputs`, `guided_*`).
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// `json_object` is the schema `{"type": "object"}`.
    JsonSchema(Value),
    Regex(String),
    /// llguidance's Lark variant.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// Tool calls a request demands (`tool_choice` required or named).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCalls {
    /// Parameter schemas by function name: the functions a call may name.
    pub functions: Map<String, Value>,
    /// More than one call allowed (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// What a request's output is constrained to.
#[derive(Debug, Clone, PartialEq)]
pub enum Structure {
    Format(OutputFormat),
    Tools(ToolCalls),
}

/// A JSON string literal, which llguidance's Lark reads as a string literal too.
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `schema` with llguidance's JSON layout options: `", "` and `": "` between items and keys and no
/// other whitespace, so a model cannot pad the output with blanks forever (a schema that sets
/// its own `x-guidance` keeps it).
fn fixed_layout(schema: &Value) -> Value {
    let mut s = match schema {
        Value::Bool(true) => Value::Object(Map::new()),
        other => other.clone(),
    };
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}));
    }
    s
}

impl Structure {
    /// The llguidance grammar of this structure.
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            Structure::Format(OutputFormat::JsonSchema(s)) => TopLevelGrammar::from_json_schema(fixed_layout(s)),
            Structure::Format(OutputFormat::Regex(r)) => TopLevelGrammar::from_regex(r),
            Structure::Format(OutputFormat::Lark(g)) => TopLevelGrammar::from_lark(g.clone()),
            Structure::Format(OutputFormat::Choice(c)) => TopLevelGrammar::from_lark(format!("start: {}", c.iter().map(|s| lit(s)).collect::<Vec<_>>().join(" | "))),
            Structure::Tools(t) => TopLevelGrammar::from_lark(tool_calls_lark(t)),
        }
    }
}

/// Qwen's XML tool calls as a Lark grammar: one call (or several when parallel, a newline apart)
/// naming one of the functions, its parameters in the schema's order (the required ones
/// present), each value raw text when the schema says string (one of its `enum` strings, its
/// `pattern`, at most `maxLength` characters, else anything up to `</parameter>`), otherwise JSON
/// matching the parameter's schema.
pub fn tool_calls_lark(t: &ToolCalls) -> String {
    let mut g = String::new();
    let calls = if t.parallel { "call (NL call)*" } else { "call" };
    g.push_str(&format!("start: [NL] {calls}\nNL: /\\n{{1,2}}/\n"));
    let fns: Vec<String> = (0..t.functions.len()).map(|i| format!("fn{i}")).collect();
    g.push_str(&format!("call: \"<tool_call>\\n\" ({}) \"</tool_call>\"\n", fns.join(" | ")));
    for (i, (name, schema)) in t.functions.iter().enumerate() {
        let props = schema.get("properties").and_then(Value::as_object).cloned().unwrap_or_default();
        let required: Vec<&str> = schema.get("required").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let mut params = String::new();
        for (j, (key, ps)) in props.iter().enumerate() {
            let rule = format!("p{i}_{j}");
            params.push_str(&if required.contains(&key.as_str()) { format!(" {rule}") } else { format!(" [{rule}]") });
            let open = lit(&format!("<parameter={key}>\n"));
            let close = "\"\\n</parameter>\\n\"";
            let is_string = ps.get("type").and_then(Value::as_str) == Some("string");
            let strings: Option<Vec<&str>> = ps.get("enum").and_then(Value::as_array).and_then(|a| a.iter().map(Value::as_str).collect());
            let pattern = ps.get("pattern").and_then(Value::as_str);
            let max_len = ps.get("maxLength").and_then(Value::as_u64);
            match (is_string, strings) {
                (_, Some(options)) if !options.is_empty() => {
                    g.push_str(&format!("{rule}: {open} ({}) {close}\n", options.iter().map(|s| lit(s)).collect::<Vec<_>>().join(" | ")));
                }
                (true, _) if pattern.is_some() || max_len.is_some() => {
                    let rx = match (pattern, max_len) {
                        (Some(p), _) => llguidance::regex_to_lark(p.trim_start_matches('^').trim_end_matches('$'), "dw"),
                        (None, Some(n)) => format!("(?s:.{{0,{n}}})"),
                        (None, None) => unreachable!("matched above"),
                    };
                    g.push_str(&format!("{rule}: {open} /{rx}/ {close}\n"));
                }
                (true, _) => {
                    // A lazy lexeme: the value ends where `</parameter>` first appears.
                    g.push_str(&format!("{rule}: {open} v{i}_{j}\nv{i}_{j}[stop={}]: /(?s:.*)/\n", lit("\n</parameter>\n")));
                }
                (false, _) => g.push_str(&format!("{rule}: {open} %json {} {close}\n", fixed_layout(ps))),
            }
        }
        g.push_str(&format!("fn{i}: {}{params} \"</function>\\n\"\n", lit(&format!("<function={name}>\n"))));
    }
    g
}

/// Compiles structures over the model's vocabulary; the token trie is built on first use.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    eos: u32,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Grammars {
    /// `eos`: the token that ends a constrained output (a stop token of the server).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: u32) -> Self {
        Grammars { tokenizer, vocab, eos, factory: OnceLock::new() }
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| {
                // Special tokens carry llguidance's marker byte, so text never matches them.
                let words: Vec<Vec<u8>> = (0..self.vocab as u32)
                    .map(|id| {
                        let b = self.tokenizer.token_bytes(id);
                        if self.tokenizer.is_special(id) && !b.is_empty() {
                            [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat()
                        } else {
                            b.to_vec()
                        }
                    })
                    .collect();
                let trie = TokTrie::from(&TokRxInfo::new(self.vocab as u32, self.eos), &words);
                let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
                let mut f = ParserFactory::new_simple(&env).map_err(|e| format!("{e:#}"))?;
                f.quiet();
                Ok(f)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A matcher for `structure` at its start; a structure that does not compile is the client's
    /// error (the message says why).
    pub fn matcher(&self, structure: &Structure) -> Result<Matcher, String> {
        let factory = self.factory().map_err(|e| format!("structured output is unavailable: {e}"))?;
        let m = Matcher::new(factory.create_parser(structure.grammar()));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }
}

/// A request's constraint as its tokens come: waiting while the model reasons, then every token
/// through the matcher.
pub struct Constraint {
    matcher: Matcher,
    active: bool,
}

impl Clone for Constraint {
    /// An independent copy (its own parser and lexer state).
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone(), active: self.active }
    }
}

impl Constraint {
    pub fn new(matcher: Matcher, active: bool) -> Self {
        Constraint { matcher, active }
    }

    pub fn is_active(&self) -> bool {
        self.active
    }

    /// The answer begins: tokens from now on are constrained.
    pub fn activate(&mut self) {
        self.active = true;
    }

    /// The tokens the grammar allows next (only the end of sequence once it is complete) into
    /// `words` (bit `t % 32` of word `t / 32`, as `backend::StepHooks::mask`); false while the
    /// constraint waits (every token allowed, `words` untouched).
    pub fn allowed(&mut self, words: &mut [u32]) -> anyhow::Result<bool> {
        if !self.active {
            return Ok(false);
        }
        let vob = self.matcher.compute_mask_or_eos()?;
        let src = vob.as_slice();
        for (i, w) in words.iter_mut().enumerate() {
            *w = src.get(i).copied().unwrap_or(0);
        }
        Ok(true)
    }

    /// Sets the logits of tokens the grammar does not allow next to -inf.
    pub fn mask(&mut self, logits: &mut [f32]) -> anyhow::Result<()> {
        let mut words = vec![0u32; crate::backend::mask_words(logits.len())];
        if self.allowed(&mut words)? {
            crate::backend::apply_mask(logits, &words);
        }
        Ok(())
    }

    /// Advances the matcher past a generated token (a no-op while waiting).
    pub fn consume(&mut self, token: u32) -> anyhow::Result<()> {
        if self.active && !self.matcher.is_stopped() {
            self.matcher.consume_token(token)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_call_grammar_lists_functions_and_typed_parameters() {
        let t = ToolCalls { functions: json!({"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}).as_object().unwrap().clone(), parallel: false };
        let g = tool_calls_lark(&t);
        assert!(g.contains("start: [NL] call\n"), "{g}");
        assert!(g.contains(r#"fn0: "<function=get_weather>\n" p0_0 [p0_1] [p0_2] "</function>\n""#), "{g}");
        assert!(g.contains(r#"%json {"type":"integer","#), "{g}");
        assert!(g.contains(r#"("c" | "f")"#), "{g}");
        assert!(tool_calls_lark(&ToolCalls { parallel: true, ..t }).contains("call (NL call)*"));
    }
}
