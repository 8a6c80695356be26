//! Parsing and validation of `/v1/chat/completions` and `/v1/completions` bodies.
//!
//! Bodies are parsed as untyped JSON and read field by field, so unknown fields are ignored
//! and every unsupported value gets a 400 that names its parameter. Nothing here touches the
//! model: the result is a [`ParsedRequest`] the handler renders, tokenizes and queues.

use super::error::ApiError;
use super::constrain::{OutputFormat, Structure, ToolCalls};
use crate::engine::SamplingParams;
use serde_json::{Map, Value};

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// The prompt before rendering.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Normalized chat messages (content flattened to strings, tool-call arguments as maps),
    /// ready for the chat template. `continue_final`: the last message is the assistant's and the
    /// reply continues it (assistant prefill) instead of opening a new turn.
    Chat { messages: Value, tools: Option<Value>, kwargs: Map<String, Value>, continue_final: bool },
    /// `/v1/completions` text.
    Text(String),
    /// `/v1/completions` token ids.
    Tokens(Vec<u32>),
}

/// How the request wants tools used.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Chat: `logprobs: true`; completions: `logprobs: N` (then `top_logprobs` = N).
    pub logprobs: bool,
    pub top_logprobs: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub tool_choice: ToolChoice,
    /// Tool JSON schemas by function name (for argument type coercion).
    pub tool_schemas: Map<String, Value>,
    pub prompt_cache_key: Option<String>,
    /// Completions: echo the prompt before the completion.
    pub echo: bool,
    /// `ignore_eos` (vLLM's extension, for benchmarks): the model's end-of-sequence tokens do not
    /// end the generation; only `max_tokens` and stop strings do.
    pub ignore_eos: bool,
    /// What the output must match (a format, or the tool calls `tool_choice` demands).
    pub structure: Option<Structure>,
    /// Choices per prompt.
    pub n: usize,
    /// Completions with several prompts: the second and later (each gets `n` choices after the
    /// first prompt's).
    pub extra_prompts: Vec<PromptInput>,
}

impl ParsedRequest {
    pub fn has_tools(&self) -> bool {
        matches!(&self.prompt, PromptInput::Chat { tools: Some(_), .. }) && self.tool_choice != ToolChoice::None
    }
}

/// Most choices per prompt (`n`).
pub const MAX_N: usize = 16;
/// Most prompts per completions request.
pub const MAX_PROMPTS: usize = 64;

/// Largest `top_logprobs` accepted (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop sequences accepted.
pub const MAX_STOP: usize = 16;

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Reads an optional field; JSON `null` counts as absent.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn get_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::param(name, format!("'{name}' must be a boolean, got {}", type_name(v)))),
    }
}

fn get_f32(obj: &Map<String, Value>, name: &str) -> Result<Option<f32>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !x.is_finite() {
                return Err(ApiError::param(name, format!("'{name}' must be a finite number")));
            }
            Ok(Some(x as f32))
        }
        Some(v) => Err(ApiError::param(name, format!("'{name}' must be a number, got {}", type_name(v)))),
    }
}

/// A non-negative integer (floats with no fractional part are accepted, as Python clients send them).
fn get_uint(obj: &Map<String, Value>, name: &str) -> Result<Option<u64>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(u) = n.as_u64() {
                return Ok(Some(u));
            }
            if let Some(f) = n.as_f64() {
                if f >= 0.0 && f.fract() == 0.0 && f < 1e15 {
                    return Ok(Some(f as u64));
                }
            }
            Err(ApiError::param(name, format!("'{name}' must be a non-negative integer, got {n}")))
        }
        Some(v) => Err(ApiError::param(name, format!("'{name}' must be an integer, got {}", type_name(v)))),
    }
}

fn get_str<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::param(name, format!("'{name}' must be a string, got {}", type_name(v)))),
    }
}

/// Parses a request body (bytes as received); sampling fields it leaves unset take `defaults`.
pub fn parse(endpoint: Endpoint, body: &[u8], defaults: &SamplingParams) -> Result<ParsedRequest, ApiError> {
    parse_value(endpoint, &json_body(body)?, defaults)
}

/// A request body as JSON (UTF-8, not empty, valid JSON).
pub fn json_body(body: &[u8]) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| ApiError::invalid(format!("request body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::invalid("request body is empty; expected a JSON object"));
    }
    match serde_json::from_str(text) {
        Ok(v) => Ok(v),
        // JSON's grammar allows escapes of unpaired surrogates (`"\ud800"`, what a client sends
        // for a string cut inside an emoji; Python's json and OpenAI take them); serde_json
        // rejects them, so they become U+FFFD and the body is read again.
        Err(e) => match replace_lone_surrogates(text) {
            Some(fixed) => serde_json::from_str(&fixed).map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}"))),
            None => Err(ApiError::invalid(format!("request body is not valid JSON: {e}"))),
        },
    }
}

/// `text` with every `\u` escape of an unpaired UTF-16 surrogate replaced by `\ufffd`; `None`
/// when there is none. Backslashes only occur in JSON strings, so escapes are found without
/// tracking strings; `\\` is consumed whole, so `\\ud800` (a backslash, then text) is left.
fn replace_lone_surrogates(text: &str) -> Option<String> {
    let unit = |s: &str, i: usize| -> Option<u32> {
        let hex = s.get(i + 2..i + 6)?;
        (s.as_bytes()[i] == b'\\' && s.as_bytes()[i + 1] == b'u').then(|| u32::from_str_radix(hex, 16).ok()).flatten()
    };
    let (b, mut out, mut i, mut changed) = (text.as_bytes(), String::with_capacity(text.len()), 0, false);
    let mut copied = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            i += 1;
            continue;
        }
        match unit(text, i) {
            Some(0xd800..=0xdbff) if matches!(unit(text, i + 6), Some(0xdc00..=0xdfff)) => i += 12,
            Some(0xd800..=0xdfff) => {
                out.push_str(&text[copied..i]);
                out.push_str("\\ufffd");
                i += 6;
                copied = i;
                changed = true;
            }
            Some(_) => i += 6,
            None => i += 2,
        }
    }
    out.push_str(&text[copied..]);
    changed.then_some(out)
}

pub fn parse_value(endpoint: Endpoint, value: &Value, defaults: &SamplingParams) -> Result<ParsedRequest, ApiError> {
    let obj = value.as_object().ok_or_else(|| ApiError::invalid(format!("request body must be a JSON object, got {}", type_name(value))))?;

    let model = get_str(obj, "model")?.map(str::to_string);

    // n: choices per prompt (they share the prompt's prefill); best_of only as n.
    let n = match get_uint(obj, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N as u64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::param("n", format!("'n' must be between 1 and {MAX_N}, got {n}"))),
    };
    if endpoint == Endpoint::Completion {
        if let Some(b) = get_uint(obj, "best_of")? {
            if b as usize != n {
                return Err(ApiError::param("best_of", "best_of must equal n (choices are not ranked)"));
            }
        }
        if let Some(s) = field(obj, "suffix") {
            if s.as_str().map(|s| !s.is_empty()).unwrap_or(true) {
                return Err(ApiError::param("suffix", "'suffix' (fill-in-the-middle) is not supported"));
            }
        }
    }

    // Lengths: max_completion_tokens wins over the legacy max_tokens. Completions with `echo`
    // may ask for none (the prompt's logprobs alone, what evaluation harnesses send).
    let mct = get_uint(obj, "max_completion_tokens")?;
    let mt = get_uint(obj, "max_tokens")?;
    let echo = endpoint == Endpoint::Completion && get_bool(obj, "echo")?.unwrap_or(false);
    let ignore_eos = get_bool(obj, "ignore_eos")?.unwrap_or(false);
    let max_tokens = match mct.or(mt) {
        Some(0) if echo => Some(0),
        Some(0) => {
            let p = if mct.is_some() { "max_completion_tokens" } else { "max_tokens" };
            return Err(ApiError::param(p, format!("'{p}' must be at least 1")));
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };

    // Sampling: what the request leaves unset comes from the server's defaults (the checkpoint's
    // generation_config.json, or OpenAI's temperature 1 over the whole vocabulary).
    let mut sampling = SamplingParams { seed: None, ..defaults.clone() };
    if let Some(t) = get_f32(obj, "temperature")? {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::param("temperature", format!("'temperature' must be between 0 and 2, got {t}")));
        }
        sampling.temperature = t;
    }
    if let Some(x) = get_f32(obj, "top_p")? {
        sampling.top_p = x;
    }
    if let Some(k) = field(obj, "top_k") {
        // -1 is the vLLM spelling of "off"; integral floats (2.0) count as integers, as for
        // max_tokens.
        let whole = k.as_i64().or_else(|| k.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15).map(|f| f as i64));
        match whole {
            Some(-1) | Some(0) => sampling.top_k = 0,
            Some(k) if k > 0 => sampling.top_k = k as usize,
            _ => return Err(ApiError::param("top_k", format!("'top_k' must be a positive integer, 0 or -1 (off), got {k}"))),
        }
    }
    if let Some(x) = get_f32(obj, "min_p")? {
        sampling.min_p = x;
    }
    if let Some(x) = get_f32(obj, "presence_penalty")? {
        sampling.presence_penalty = x;
    }
    if let Some(x) = get_f32(obj, "frequency_penalty")? {
        sampling.frequency_penalty = x;
    }
    if let Some(x) = get_f32(obj, "repetition_penalty")? {
        sampling.repetition_penalty = x;
    }
    if let Some(s) = field(obj, "seed") {
        sampling.seed = Some(match (s.as_u64(), s.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(ApiError::param("seed", format!("'seed' must be an integer, got {s}"))),
        });
    }
    if let Err(msg) = sampling.validate() {
        let p = msg.split_whitespace().next().unwrap_or("").to_string();
        return Err(ApiError::param(&p, msg));
    }

    // Stop strings.
    let stop = match field(obj, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut v = Vec::new();
            for s in a {
                match s {
                    Value::String(s) => v.push(s.clone()),
                    other => return Err(ApiError::param("stop", format!("'stop' entries must be strings, got {}", type_name(other)))),
                }
            }
            v
        }
        Some(v) => return Err(ApiError::param("stop", format!("'stop' must be a string or an array of strings, got {}", type_name(v)))),
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::param("stop", format!("at most {MAX_STOP} stop sequences are supported, got {}", stop.len())));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::param("stop", "stop sequences must not be empty"));
    }

    // Logprobs.
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Chat => {
            let lp = get_bool(obj, "logprobs")?.unwrap_or(false);
            let top = get_uint(obj, "top_logprobs")?.unwrap_or(0) as usize;
            if top > MAX_TOP_LOGPROBS {
                return Err(ApiError::param("top_logprobs", format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")));
            }
            if top > 0 && !lp {
                return Err(ApiError::param("top_logprobs", "'top_logprobs' requires 'logprobs': true"));
            }
            (lp, top)
        }
        Endpoint::Completion => match field(obj, "logprobs") {
            None => (false, 0),
            Some(Value::Bool(false)) => (false, 0),
            Some(v) => match v.as_u64() {
                Some(n) if n as usize <= MAX_TOP_LOGPROBS => (true, n as usize),
                _ => return Err(ApiError::param("logprobs", format!("'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}"))),
            },
        },
    };

    let stream = get_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => get_bool(o, "include_usage")?.unwrap_or(false),
        Some(v) => return Err(ApiError::param("stream_options", format!("'stream_options' must be an object, got {}", type_name(v)))),
    };

    let format = output_format(obj)?;
    let parallel_tool_calls = get_bool(obj, "parallel_tool_calls")?.unwrap_or(true);

    let prompt_cache_key = get_str(obj, "prompt_cache_key")?.map(str::to_string);

    let mut tool_choice = ToolChoice::Auto;
    let mut tool_schemas = Map::new();
    let mut extra_prompts = Vec::new();
    let prompt = match endpoint {
        Endpoint::Chat => {
            if field(obj, "prompt").is_some() && field(obj, "messages").is_none() {
                return Err(ApiError::param("messages", "'messages' is required (this is /v1/chat/completions; raw prompts go to /v1/completions)"));
            }
            let messages = normalize_messages(field(obj, "messages"))?;
            let tools = match field(obj, "tools") {
                None => None,
                Some(Value::Array(a)) if a.is_empty() => None,
                Some(Value::Array(a)) => {
                    for (i, t) in a.iter().enumerate() {
                        let f = t.get("function").filter(|f| f.is_object());
                        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                        match (t.get("type").and_then(Value::as_str), name) {
                            (Some("function") | None, Some(name)) if !name.is_empty() => {
                                let params = f.and_then(|f| f.get("parameters")).cloned().unwrap_or(Value::Null);
                                tool_schemas.insert(name.to_string(), params);
                            }
                            _ => return Err(ApiError::param(&format!("tools[{i}]"), "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}")),
                        }
                    }
                    Some(Value::Array(a.clone()))
                }
                Some(v) => return Err(ApiError::param("tools", format!("'tools' must be an array, got {}", type_name(v)))),
            };
            tool_choice = match field(obj, "tool_choice") {
                None => ToolChoice::Auto,
                Some(Value::String(s)) => match s.as_str() {
                    "auto" => ToolChoice::Auto,
                    "none" => ToolChoice::None,
                    "required" => ToolChoice::Required,
                    other => return Err(ApiError::param("tool_choice", format!("tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {other:?}"))),
                },
                Some(Value::Object(o)) => {
                    let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                    match name {
                        Some(n) if tool_schemas.contains_key(n) => ToolChoice::Named(n.to_string()),
                        Some(n) => return Err(ApiError::param("tool_choice", format!("tool_choice names function {n:?}, which is not in 'tools'"))),
                        None => return Err(ApiError::param("tool_choice", "tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")),
                    }
                }
                Some(v) => return Err(ApiError::param("tool_choice", format!("'tool_choice' must be a string or an object, got {}", type_name(v)))),
            };
            if tools.is_none() && matches!(tool_choice, ToolChoice::Required) {
                return Err(ApiError::param("tool_choice", "tool_choice \"required\" needs a non-empty 'tools' list"));
            }
            // tool_choice "none": the template gets no tools and no tool call is parsed.
            let tools = match (&tool_choice, tools) {
                (ToolChoice::None, _) => None,
                (ToolChoice::Named(n), Some(Value::Array(a))) => {
                    Some(Value::Array(a.into_iter().filter(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) == Some(n)).collect()))
                }
                (_, t) => t,
            };
            let mut kwargs = match field(obj, "chat_template_kwargs") {
                None => Map::new(),
                Some(Value::Object(o)) => o.clone(),
                Some(v) => return Err(ApiError::param("chat_template_kwargs", format!("'chat_template_kwargs' must be an object, got {}", type_name(v)))),
            };
            // Reserved names the server itself sets.
            for reserved in ["messages", "tools", "documents", "add_generation_prompt"] {
                kwargs.remove(reserved);
            }
            // OpenAI's reasoning_effort onto the template's thinking switch ("none" / "minimal":
            // off, "low" / "medium" / "high": on); an explicit enable_thinking wins.
            if let Some(effort) = field(obj, "reasoning_effort") {
                let on = match effort.as_str() {
                    Some("none" | "minimal") => false,
                    Some("low" | "medium" | "high") => true,
                    _ => return Err(ApiError::param("reasoning_effort", format!("'reasoning_effort' must be one of none, minimal, low, medium, high, got {effort}"))),
                };
                kwargs.entry("enable_thinking").or_insert(Value::Bool(on));
            }
            // Assistant prefill: a final assistant message is continued (vLLM's
            // continue_final_message, on by default when the conversation ends with one).
            // A final message of tool calls is history, not text to continue.
            let last = messages.as_array().and_then(|m| m.last());
            let last_is_assistant = last.and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant");
            let continuable = last_is_assistant && last.is_some_and(|m| m.get("tool_calls").is_none());
            let continue_final = match field(obj, "continue_final_message") {
                None => continuable,
                Some(Value::Bool(true)) if continuable => true,
                Some(Value::Bool(true)) => return Err(ApiError::param("continue_final_message", "'continue_final_message' needs the last message to be the assistant's text (without tool calls)")),
                Some(Value::Bool(false)) => false,
                Some(v) => return Err(ApiError::param("continue_final_message", format!("'continue_final_message' must be a boolean, got {}", type_name(v)))),
            };
            if continue_final && field(obj, "add_generation_prompt") == Some(&Value::Bool(true)) {
                return Err(ApiError::param("add_generation_prompt", "'add_generation_prompt' and 'continue_final_message' cannot both be true"));
            }
            PromptInput::Chat { messages, tools, kwargs, continue_final }
        }
        Endpoint::Completion => {
            let mut all = completion_prompts(field(obj, "prompt"))?;
            let first = all.remove(0);
            extra_prompts = all;
            first
        }
    };
    for p in std::iter::once(&prompt).chain(&extra_prompts) {
        if matches!(p, PromptInput::Text(t) if t.is_empty()) {
            return Err(ApiError::param("prompt", "'prompt' must not be empty"));
        }
    }

    // Tool calls that tool_choice demands are enforced by a grammar, as a format is.
    let demanded = match &tool_choice {
        ToolChoice::Required => Some(tool_schemas.clone()),
        ToolChoice::Named(n) => Some(tool_schemas.iter().filter(|(k, _)| *k == n).map(|(k, v)| (k.clone(), v.clone())).collect()),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    let structure = match (format, demanded) {
        (Some(_), Some(_)) => return Err(ApiError::param("response_format", "a response format cannot be combined with tool_choice \"required\" or a named function (the output is the tool call)")),
        (Some(f), None) => Some(Structure::Format(f)),
        (None, Some(functions)) => Some(Structure::Tools(ToolCalls { functions, parallel: parallel_tool_calls })),
        (None, None) => None,
    };

    Ok(ParsedRequest { endpoint, model, prompt, max_tokens, sampling, stop, logprobs, top_logprobs, stream, include_usage, tool_choice, tool_schemas, prompt_cache_key, echo, ignore_eos, structure, n, extra_prompts })
}

/// A completions `prompt`: a string, token ids, or a list of either (several prompts, each its own
/// choices).
fn completion_prompts(v: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let one = |v: &Value| -> Result<PromptInput, ApiError> {
        match v {
            Value::String(s) => Ok(PromptInput::Text(s.clone())),
            Value::Array(_) => Ok(PromptInput::Tokens(token_ids(v)?)),
            other => Err(ApiError::param("prompt", format!("each prompt must be a string or an array of token ids, got {}", type_name(other)))),
        }
    };
    let all = match v {
        None => return Err(ApiError::param("prompt", "'prompt' is required")),
        Some(Value::String(s)) => vec![PromptInput::Text(s.clone())],
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => vec![PromptInput::Tokens(token_ids(&Value::Array(a.clone()))?)],
        Some(Value::Array(a)) if !a.is_empty() => a.iter().map(one).collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => return Err(ApiError::param("prompt", "'prompt' must not be empty")),
        Some(v) => return Err(ApiError::param("prompt", format!("'prompt' must be a string or an array of token ids, got {}", type_name(v)))),
    };
    if all.len() > MAX_PROMPTS {
        return Err(ApiError::param("prompt", format!("at most {MAX_PROMPTS} prompts per request, got {}", all.len())));
    }
    Ok(all)
}

/// The output format a request asks for: OpenAI's `response_format` (`text`, `json_object`,
/// `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `grammar`, `choice`) or its
/// older `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice`; at most one.
fn output_format(obj: &Map<String, Value>) -> Result<Option<OutputFormat>, ApiError> {
    let mut found: Vec<(&str, OutputFormat)> = Vec::new();
    if let Some(rf) = field(obj, "response_format") {
        let Some(rf) = rf.as_object() else { return Err(ApiError::param("response_format", format!("'response_format' must be an object, got {}", type_name(rf)))) };
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", OutputFormat::JsonSchema(serde_json::json!({"type": "object"})))),
            Some("json_schema") => {
                let schema = rf.get("json_schema").and_then(|j| j.get("schema")).filter(|s| s.is_object() || s.is_boolean());
                match schema {
                    Some(s) => found.push(("response_format", OutputFormat::JsonSchema(s.clone()))),
                    None => return Err(ApiError::param("response_format", "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")),
                }
            }
            other => return Err(ApiError::param("response_format", format!("response_format type must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"))),
        }
    }
    let guided = |o: &Map<String, Value>, key: &str, name: &str| -> Result<Option<OutputFormat>, ApiError> {
        let Some(v) = field(o, key) else { return Ok(None) };
        let bad = |what: &str| ApiError::param(name, format!("'{name}' must be {what}, got {}", type_name(v)));
        Ok(Some(match key.trim_start_matches("guided_") {
            "json" => match v {
                Value::Object(_) | Value::Bool(_) => OutputFormat::JsonSchema(v.clone()),
                Value::String(s) => OutputFormat::JsonSchema(serde_json::from_str(s).map_err(|e| ApiError::param(name, format!("'{name}' is not JSON: {e}")))?),
                _ => return Err(bad("a JSON schema")),
            },
            "regex" => OutputFormat::Regex(v.as_str().ok_or_else(|| bad("a string"))?.to_string()),
            "grammar" => OutputFormat::Lark(v.as_str().ok_or_else(|| bad("a string (Lark)"))?.to_string()),
            _ => match v.as_array().map(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()) {
                Some(Some(c)) if !c.is_empty() => OutputFormat::Choice(c),
                _ => return Err(bad("a non-empty array of strings")),
            },
        }))
    };
    if let Some(so) = field(obj, "structured_outputs") {
        let Some(so) = so.as_object() else { return Err(ApiError::param("structured_outputs", format!("'structured_outputs' must be an object, got {}", type_name(so)))) };
        for key in ["json", "regex", "grammar", "choice"] {
            if let Some(f) = guided(so, key, &format!("structured_outputs.{key}"))? {
                found.push(("structured_outputs", f));
            }
        }
    }
    for key in ["guided_json", "guided_regex", "guided_grammar", "guided_choice"] {
        if let Some(f) = guided(obj, key, key)? {
            found.push((key, f));
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|(_, f)| f)),
        _ => Err(ApiError::param(found[1].0, format!("only one output format per request ({} and {} were given)", found[0].0, found[1].0))),
    }
}

fn token_ids(v: &Value) -> Result<Vec<u32>, ApiError> {
    let a = v.as_array().ok_or_else(|| ApiError::param("prompt", "token prompt must be an array of integers"))?;
    if a.is_empty() {
        return Err(ApiError::param("prompt", "'prompt' must not be empty"));
    }
    a.iter()
        .map(|x| x.as_u64().and_then(|u| u32::try_from(u).ok()).ok_or_else(|| ApiError::param("prompt", format!("token ids must be non-negative integers, got {x}"))))
        .collect()
}

/// Flattens message content: a string, or an array of `{"type": "text", "text": ...}` parts.
fn content_text(i: usize, content: Option<&Value>) -> Result<Option<String>, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                let t = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (t, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text" | "output_text", Some(text)) => out.push_str(text),
                    (t, _) => {
                        return Err(ApiError::param(&format!("messages[{i}].content"), format!("content part of type {t:?} is not supported; this model takes text only ({{\"type\": \"text\", \"text\": ...}})")))
                    }
                }
            }
            Ok(Some(out))
        }
        Some(v) => Err(ApiError::param(&format!("messages[{i}].content"), format!("content must be a string or an array of text parts, got {}", type_name(v)))),
    }
}

/// Validates messages and rewrites them into what the chat template expects.
pub fn normalize_messages(messages: Option<&Value>) -> Result<Value, ApiError> {
    let msgs = match messages {
        None => return Err(ApiError::param("messages", "'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::param("messages", format!("'messages' must be an array, got {}", type_name(v)))),
    };
    if msgs.is_empty() {
        return Err(ApiError::param("messages", "'messages' must contain at least one message"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let m = m.as_object().ok_or_else(|| ApiError::param(&format!("messages[{i}]"), "each message must be an object"))?;
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::param(&format!("messages[{i}].role"), "each message needs a string 'role'"))?;
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" | "function" => "tool",
            other => return Err(ApiError::param(&format!("messages[{i}].role"), format!("unknown role {other:?} (expected system, developer, user, assistant or tool)"))),
        };
        let content = content_text(i, m.get("content"))?;
        let mut nm = Map::new();
        nm.insert("role".into(), Value::String(role.into()));
        match role {
            "assistant" => {
                nm.insert("content".into(), Value::String(content.unwrap_or_default()));
                // Reasoning on input: both spellings map to the template's reasoning_content.
                let reasoning = m.get("reasoning_content").or_else(|| m.get("reasoning")).filter(|v| !v.is_null());
                if let Some(r) = reasoning {
                    let r = r.as_str().ok_or_else(|| ApiError::param(&format!("messages[{i}].reasoning_content"), "reasoning_content must be a string"))?;
                    nm.insert("reasoning_content".into(), Value::String(r.into()));
                }
                if let Some(tcs) = m.get("tool_calls").filter(|v| !v.is_null()) {
                    let tcs = tcs.as_array().ok_or_else(|| ApiError::param(&format!("messages[{i}].tool_calls"), "tool_calls must be an array"))?;
                    let mut calls = Vec::new();
                    for (j, tc) in tcs.iter().enumerate() {
                        let p = format!("messages[{i}].tool_calls[{j}]");
                        let f = tc.get("function").ok_or_else(|| ApiError::param(&p, "tool call needs a 'function' object"))?;
                        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| ApiError::param(&p, "tool call function needs a 'name'"))?;
                        // OpenAI sends arguments as a JSON string; the template iterates a map.
                        let args = match f.get("arguments") {
                            None | Some(Value::Null) => Value::Object(Map::new()),
                            Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
                            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                                Ok(v @ Value::Object(_)) => v,
                                _ => return Err(ApiError::param(&p, "tool call arguments must be a JSON object encoded as a string")),
                            },
                            Some(v @ Value::Object(_)) => v.clone(),
                            Some(_) => return Err(ApiError::param(&p, "tool call arguments must be a JSON object encoded as a string")),
                        };
                        let mut call = Map::new();
                        if let Some(id) = tc.get("id") {
                            call.insert("id".into(), id.clone());
                        }
                        call.insert("type".into(), Value::String("function".into()));
                        let mut func = Map::new();
                        func.insert("name".into(), Value::String(name.into()));
                        func.insert("arguments".into(), args);
                        call.insert("function".into(), Value::Object(func));
                        calls.push(Value::Object(call));
                    }
                    if !calls.is_empty() {
                        nm.insert("tool_calls".into(), Value::Array(calls));
                    }
                }
            }
            "tool" => {
                nm.insert("content".into(), Value::String(content.unwrap_or_default()));
                if let Some(id) = m.get("tool_call_id") {
                    nm.insert("tool_call_id".into(), id.clone());
                }
                if let Some(n) = m.get("name") {
                    nm.insert("name".into(), n.clone());
                }
            }
            _ => {
                let c = content.ok_or_else(|| ApiError::param(&format!("messages[{i}].content"), format!("a {role} message needs 'content'")))?;
                nm.insert("content".into(), Value::String(c));
            }
        }
        out.push(Value::Object(nm));
    }
    let last_role = out.last().and_then(|m| m.get("role")).and_then(Value::as_str).unwrap_or("");
    if !matches!(last_role, "user" | "tool" | "assistant") {
        return Err(ApiError::param("messages", format!("the last message must be from the user, a tool, or the assistant (continued), not {last_role}")));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<ParsedRequest, ApiError> {
        parse_value(Endpoint::Chat, &v, &SamplingParams::openai())
    }

    #[test]
    fn minimal_and_unknown_fields() {
        let r = chat(json!({"model": "x", "messages": [{"role": "user", "content": "hi"}], "whatever": {"a": 1}, "user": "u"})).unwrap();
        assert_eq!(r.max_tokens, None);
        assert!(!r.stream);
        assert_eq!(r.sampling.temperature, 1.0);
    }

    #[test]
    fn reasoning_effort_switches_thinking_unless_the_kwargs_say() {
        let kw = |body: Value| match chat(body).unwrap().prompt {
            PromptInput::Chat { kwargs, .. } => kwargs.get("enable_thinking").cloned(),
            _ => panic!("not a chat"),
        };
        let msgs = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(kw(json!({"messages": msgs, "reasoning_effort": "none"})), Some(json!(false)));
        assert_eq!(kw(json!({"messages": msgs, "reasoning_effort": "minimal"})), Some(json!(false)));
        assert_eq!(kw(json!({"messages": msgs, "reasoning_effort": "high"})), Some(json!(true)));
        assert_eq!(kw(json!({"messages": msgs})), None);
        let explicit = json!({"messages": msgs, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}});
        assert_eq!(kw(explicit), Some(json!(true)));
        let e = chat(json!({"messages": msgs, "reasoning_effort": "max"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("reasoning_effort"));
    }

    #[test]
    fn errors_name_params() {
        let base = || json!({"messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base();
            b[k] = v;
            chat(b).unwrap_err()
        };
        assert_eq!(with("n", json!(0)).param.as_deref(), Some("n"));
        assert_eq!(with("n", json!(17)).param.as_deref(), Some("n"));
        assert_eq!(with("temperature", json!(-1)).param.as_deref(), Some("temperature"));
        assert_eq!(with("top_p", json!(0)).param.as_deref(), Some("top_p"));
        assert_eq!(with("max_tokens", json!(0)).param.as_deref(), Some("max_tokens"));
        assert_eq!(with("max_tokens", json!(-5)).param.as_deref(), Some("max_tokens"));
        assert_eq!(with("top_logprobs", json!(3)).param.as_deref(), Some("top_logprobs"));
        assert_eq!(with("stop", json!(5)).param.as_deref(), Some("stop"));
        assert_eq!(with("response_format", json!({"type": "yaml"})).param.as_deref(), Some("response_format"));
        assert_eq!(with("response_format", json!({"type": "json_schema"})).param.as_deref(), Some("response_format"));
        assert_eq!(with("guided_choice", json!([])).param.as_deref(), Some("guided_choice"));
        assert_eq!(with("structured_outputs", json!({"json": "{not json"})).param.as_deref(), Some("structured_outputs.json"));
        assert_eq!(with("messages", json!([])).param.as_deref(), Some("messages"));
        assert_eq!(with("messages", json!([{"role": "system", "content": "x"}])).param.as_deref(), Some("messages"));
        assert_eq!(with("messages", json!([{"role": "wizard", "content": "x"}])).param.as_deref(), Some("messages[0].role"));
        assert_eq!(with("messages", json!([{"role": "user", "content": [{"type": "image_url"}]}])).param.as_deref(), Some("messages[0].content"));
        assert_eq!(with("temperature", json!(2.5)).param.as_deref(), Some("temperature"));
        assert_eq!(with("top_k", json!(2.5)).param.as_deref(), Some("top_k"));
        let oa = SamplingParams::openai();
        assert!(parse(Endpoint::Chat, b"{not json", &oa).unwrap_err().message.contains("JSON"));
        assert!(parse(Endpoint::Chat, &[0xff, 0xfe], &oa).unwrap_err().message.contains("UTF-8"));
        assert!(parse(Endpoint::Chat, b"[1]", &oa).unwrap_err().message.contains("object"));
    }

    #[test]
    fn a_final_assistant_message_is_continued() {
        let prefill = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]);
        let cont = |v: Value| match chat(v).map(|r| r.prompt) {
            Ok(PromptInput::Chat { continue_final, .. }) => Ok(continue_final),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.param),
        };
        assert_eq!(cont(json!({"messages": prefill})), Ok(true));
        assert_eq!(cont(json!({"messages": prefill, "continue_final_message": false})), Ok(false));
        assert_eq!(cont(json!({"messages": [{"role": "user", "content": "hi"}]})), Ok(false));
        let user_last = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(cont(json!({"messages": user_last, "continue_final_message": true})), Err(Some("continue_final_message".into())));
        assert_eq!(cont(json!({"messages": prefill, "add_generation_prompt": true})), Err(Some("add_generation_prompt".into())));
    }

    #[test]
    fn unpaired_surrogate_escapes_become_replacement_characters() {
        let v = json_body(br#"{"a": "x\ud800y", "b": "\udc00", "c": "\ud83d\ude00", "d": "\\ud800", "e": "\ud800\ud800"}"#).unwrap();
        assert_eq!(v["a"], "x\u{fffd}y");
        assert_eq!(v["b"], "\u{fffd}");
        assert_eq!(v["c"], "\u{1f600}", "a proper pair stays");
        assert_eq!(v["d"], "\\ud800", "an escaped backslash is not an escape");
        assert_eq!(v["e"], "\u{fffd}\u{fffd}");
        assert!(json_body(br#"{"a": "\ud800"#).is_err(), "still invalid JSON");
        let r = chat(json!({"messages": [{"role": "user", "content": "cut \u{fffd}"}]})).unwrap();
        assert!(matches!(r.prompt, PromptInput::Chat { .. }));
    }

    #[test]
    fn unset_sampling_fields_take_the_server_defaults() {
        let model = SamplingParams { temperature: 0.6, top_p: 0.95, top_k: 20, ..SamplingParams::openai() };
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let p = |v: Value| parse_value(Endpoint::Chat, &v, &model).unwrap().sampling;
        assert_eq!(p(json!({"messages": msgs})), model);
        // Whatever the request sets wins, field by field.
        let s = p(json!({"messages": msgs, "temperature": 0.2, "top_k": 2.0, "seed": 5}));
        assert_eq!((s.temperature, s.top_k, s.top_p, s.seed), (0.2, 2, 0.95, Some(5)));
        assert_eq!(p(json!({"messages": msgs, "top_k": -1, "top_p": 1})).top_k, 0);
        assert_eq!(p(json!({"messages": msgs, "temperature": 0})).temperature, 0.0);
    }

    #[test]
    fn messages_are_normalized() {
        let r = chat(json!({"messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "reasoning": "hmm", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ], "max_completion_tokens": 7, "max_tokens": 99, "stop": "END", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}))
        .unwrap();
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.stop, vec!["END"]);
        let PromptInput::Chat { messages, tools, .. } = &r.prompt else { panic!() };
        assert_eq!(messages[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(messages[2]["reasoning_content"], json!("hmm"));
        assert_eq!(messages[2]["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert!(tools.is_some());
        assert!(r.has_tools());
    }

    #[test]
    fn completions_prompts() {
        let p = |v: Value| parse_value(Endpoint::Completion, &v, &SamplingParams::openai());
        assert_eq!(p(json!({"prompt": "abc", "logprobs": 2})).unwrap().top_logprobs, 2);
        assert_eq!(p(json!({"prompt": [1, 2, 3]})).unwrap().prompt, PromptInput::Tokens(vec![1, 2, 3]));
        assert_eq!(p(json!({"prompt": [[4, 5]]})).unwrap().prompt, PromptInput::Tokens(vec![4, 5]));
        let two = p(json!({"prompt": ["a", [7, 8]], "n": 2})).unwrap();
        assert_eq!((two.prompt, two.extra_prompts, two.n), (PromptInput::Text("a".into()), vec![PromptInput::Tokens(vec![7, 8])], 2));
        assert!(p(json!({"prompt": ["a", ""]})).is_err());
        assert!(p(json!({"prompt": ["a", 5]})).is_err());
        assert!(p(json!({"prompt": vec!["a"; MAX_PROMPTS + 1]})).is_err());
        assert!(p(json!({"prompt": "a", "n": 2, "best_of": 3})).is_err());
        assert!(p(json!({"prompt": ""})).is_err());
        assert!(p(json!({})).is_err());
        assert!(p(json!({"prompt": "x", "suffix": "y"})).is_err());
    }
}
