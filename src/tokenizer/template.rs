//! Chat templates, rendered with minijinja configured to match transformers'
//! `apply_chat_template` byte for byte (ecosystem.md §3.1): `trim_blocks` + `lstrip_blocks`,
//! no trailing newline kept, Python string methods (pycompat), loop controls, insertion-ordered
//! maps, `raise_exception`, `strftime_now`, and transformers' `tojson` (see `pyjson`).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior};
use serde_json::Map;

use super::pyjson;

const TEMPLATE_NAME: &str = "chat_template";

/// The Qwen3.6 chat template (copy of the checkpoint's chat_template.jinja).
pub const QWEN36_CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// Context names that `render` sets itself; transformers raises if kwargs repeat them.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Special tokens from tokenizer_config.json (`eos_token`, ...), which transformers also
    /// passes to the template; kwargs override them.
    special_tokens: Map<String, serde_json::Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`, else the `chat_template` entry of
    /// `dir/tokenizer_config.json` (a string, or a list of `{name, template}` where `default` wins).
    pub fn load(dir: &Path) -> Result<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("cannot parse {}", config_path.display()))?,
            ),
            Err(_) => None,
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(src) => src,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => config
                .as_ref()
                .and_then(template_from_config)
                .ok_or_else(|| {
                    anyhow!(
                        "no chat template in {}: neither chat_template.jinja nor a chat_template \
                         entry in tokenizer_config.json",
                        dir.display()
                    )
                })?,
            Err(e) => return Err(anyhow!("cannot read {}: {e}", jinja_path.display())),
        };
        let mut t = Self::from_source(&source)
            .with_context(|| format!("chat template of {}", dir.display()))?;
        if let Some(cfg) = &config {
            t.special_tokens = special_tokens_from_config(cfg);
        }
        Ok(t)
    }

    /// Compiles template source text.
    pub fn from_source(src: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .map_err(|e| anyhow!("chat template syntax config: {e}"))?,
        );
        env.set_undefined_behavior(UndefinedBehavior::Lenient); // Jinja2's default Undefined
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_filter("trim", py_trim_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, src.to_string())
            .map_err(|e| anyhow!("chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate {
            env,
            special_tokens: Map::new(),
        })
    }

    /// Renders a conversation, as `apply_chat_template(messages, tools=tools, tokenize=False,
    /// add_generation_prompt=..., **kwargs)` does. `kwargs` carries template switches such as
    /// `enable_thinking` and `preserve_thinking`. Tool-call `arguments` must already be JSON
    /// objects (the template iterates them), not the OpenAI wire format's JSON strings.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &Map<String, serde_json::Value>,
    ) -> Result<String> {
        if let Some(key) = RESERVED.iter().find(|k| kwargs.contains_key(**k)) {
            bail!("chat template kwargs must not set '{key}'");
        }
        let mut ctx = self.special_tokens.clone();
        ctx.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());

        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {e}"))?;
        tmpl.render(Value::from(Serde(&ctx))).map_err(render_error)
    }
}

/// One-line error: the template's own message for `raise_exception('...')`, else minijinja's
/// description with the template location.
fn render_error(e: Error) -> anyhow::Error {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) if is_raised(&e) => {
            anyhow!("chat template error: {detail}")
        }
        _ => anyhow!("chat template render failed: {e}"),
    }
}

/// `raise_exception` errors carry `RaisedByTemplate` as their source.
fn is_raised(e: &Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<RaisedByTemplate>())
}

#[derive(Debug)]
struct RaisedByTemplate;

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message).with_source(RaisedByTemplate))
}

/// transformers' `strftime_now(format)` = `datetime.now().strftime(format)`.
fn strftime_now(format: String) -> Result<Value, Error> {
    use std::fmt::Write as _;
    let mut out = String::new();
    // chrono reports an unknown specifier as a fmt::Error (to_string() would panic).
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("invalid strftime format {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// Python's `str.isspace()`: Unicode White_Space plus the ASCII separators U+001C..U+001F,
/// which Rust's `char::is_whitespace` lacks.
fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `str.strip/lstrip/rstrip(chars=None)` with Python's whitespace set.
fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_is_space(c),
    };
    let s = if left { s.trim_start_matches(strip) } else { s };
    if right {
        s.trim_end_matches(strip)
    } else {
        s
    }
}

/// Jinja2's `trim` filter: `str(value).strip(chars)`.
fn py_trim_filter(value: &Value, chars: Option<String>) -> Value {
    let s = match value.as_str() {
        Some(s) => s.to_string(),
        None if value.is_undefined() => String::new(),
        None if value.is_none() => "None".to_string(),
        None => value.to_string(),
    };
    Value::from(py_strip(&s, chars.as_deref(), true, true))
}

/// pycompat's Python methods, with `strip`/`lstrip`/`rstrip` using Python's whitespace set.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [c] if c.is_none() => None,
            [c] => Some(c.as_str().ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{method} arg must be None or str"),
                )
            })?),
            _ => return Err(Error::new(ErrorKind::TooManyArguments, method.to_string())),
        };
        let left = method != "rstrip";
        let right = method != "lstrip";
        return Ok(Value::from(py_strip(s, chars, left, right)));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn template_from_config(cfg: &serde_json::Value) -> Option<String> {
    match cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |want: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(want))
            };
            named("default")
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
        }
        _ => None,
    }
}

/// `bos_token`, `eos_token`, ... as strings (they may be stored as `{"content": ...}`).
fn special_tokens_from_config(cfg: &serde_json::Value) -> Map<String, serde_json::Value> {
    let mut out = Map::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        let text = match cfg.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Object(o)) => o
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_string),
            _ => None,
        };
        if let Some(t) = text {
            out.insert(key.to_string(), t.into());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: serde_json::Value) -> Result<String> {
        let t = ChatTemplate::from_source(src)?;
        let kwargs = ctx.as_object().cloned().unwrap_or_default();
        t.render(&json!([]), None, false, &kwargs)
    }

    #[test]
    fn python_strip_semantics() {
        assert_eq!(py_strip("\u{1f} x \u{3000}", None, true, true), "x");
        assert_eq!(py_strip("\n\nx\n", Some("\n"), true, false), "x\n");
        let out = render(
            "{{ s|trim }}|{{ s.strip() }}|{{ s.rstrip('\\x1f') }}",
            json!({"s": "\u{1f} a\u{1f}"}),
        )
        .unwrap();
        assert_eq!(out, "a|a|\u{1f} a");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let e = render("{{ raise_exception('boom') }}", json!({})).unwrap_err();
        assert_eq!(e.to_string(), "chat template error: boom");
        let e = render("{{ 'a' + nope.x }}", json!({})).unwrap_err();
        assert!(
            e.to_string().starts_with("chat template render failed"),
            "{e}"
        );
    }

    #[test]
    fn compile_errors_and_reserved_kwargs() {
        assert!(ChatTemplate::from_source("{% if %}").is_err());
        let t = ChatTemplate::from_source("x").unwrap();
        let mut kw = Map::new();
        kw.insert("messages".into(), json!([]));
        assert!(t.render(&json!([]), None, false, &kw).is_err());
    }

    #[test]
    fn strftime_now_never_panics() {
        assert!(
            render("{{ strftime_now('%Y-%m-%d') }}", json!({}))
                .unwrap()
                .len()
                == 10
        );
        assert!(render("{{ strftime_now('%Q %') }}", json!({})).is_err());
    }

    #[test]
    fn tojson_no_html_escaping() {
        let out = render(
            "{{ v|tojson }} {{ v|tojson(indent=1) }}",
            json!({"v": {"a": "<&'>é", "b": [1.0]}}),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"a\": \"<&'>é\", \"b\": [1.0]} {\n \"a\": \"<&'>é\",\n \"b\": [\n  1.0\n ]\n}"
        );
    }
}
