//! Python `json.dumps` for minijinja values, for the chat template's `tojson` filter.
//!
//! transformers replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`: no HTML escaping (minijinja's built-in escapes `<>&'`),
//! raw non-ASCII, insertion-ordered keys, `", "`/`": "` separators, and Python's float repr
//! (`1e+16`, `1.0`). Tool schemas and tool-call arguments go through this, and the model saw
//! exactly those bytes in training, so every detail matters.

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// `json.dumps` options that transformers' `tojson` exposes.
#[derive(Debug, Clone)]
pub struct DumpOpts {
    pub ensure_ascii: bool,
    /// `None` = single line; `Some(s)` = newline + `s` per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for DumpOpts {
    fn default() -> Self {
        DumpOpts {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// The `tojson` filter: `x|tojson(ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, positional arguments in that order as in transformers.
pub fn tojson_filter(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(err("tojson() takes at most 4 arguments"));
    }
    let mut params: [Option<Value>; 4] = Default::default();
    for (i, a) in args.iter().enumerate() {
        params[i] = Some(a.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if params[i].is_some() {
                return Err(err(format!(
                    "tojson() got multiple values for argument '{name}'"
                )));
            }
            params[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;

    let [ensure_ascii, indent, separators, sort_keys] = params;
    let mut opts = DumpOpts {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..DumpOpts::default()
    };
    opts.indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => match v.as_i64() {
            // Python: ' ' * n, empty for n <= 0 (still multi-line).
            Some(n) => Some(" ".repeat(n.clamp(0, 1024) as usize)),
            None => return Err(err("tojson(): indent must be an int or a string")),
        },
    };
    if opts.indent.is_some() {
        opts.item_sep = ",".into(); // Python's default when indent is given
    }
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = seps
            .try_iter()
            .map_err(|_| err("tojson(): separators must be a pair of strings"))?
            .collect();
        match parts.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_sep = a.as_str().unwrap_or_default().to_string();
                opts.key_sep = b.as_str().unwrap_or_default().to_string();
            }
            _ => return Err(err("tojson(): separators must be a pair of strings")),
        }
    }
    Ok(Value::from_safe_string(dumps(value, &opts)?))
}

/// Serializes `v` like Python `json.dumps(v, ...)`.
pub fn dumps(v: &Value, opts: &DumpOpts) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, v, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &DumpOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, opts: &DumpOpts, level: usize) -> Result<(), Error> {
    // Python's json module has no recursion guard beyond the interpreter's; values from JSON
    // input cannot be cyclic, but bound the depth anyway so no input can overflow the stack.
    if level > 512 {
        return Err(err("tojson(): value nested too deeply"));
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v)?,
        ValueKind::String => write_str(out, v.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let item = v.get_item(&k)?;
                entries.push((key_string(&k)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        other => {
            return Err(err(format!(
                "Object of type {other} is not JSON serializable"
            )));
        }
    }
    Ok(())
}

/// Python coerces non-string dict keys: numbers via repr, bools/None as JSON literals.
fn key_string(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, k)?;
            s
        }
        other => {
            return Err(err(format!(
                "keys must be str, int, float, bool or None, not {other}"
            )))
        }
    })
}

fn write_number(out: &mut String, v: &Value) -> Result<(), Error> {
    if v.is_integer() {
        // minijinja's Display prints integers (including i128/u128) in plain decimal.
        out.push_str(&v.to_string());
    } else {
        let f = f64::try_from(v.clone())?;
        out.push_str(&py_float_repr(f));
    }
    Ok(())
}

/// Python's `float.__repr__` as used by `json.dumps` (`NaN`/`Infinity` per `allow_nan=True`):
/// shortest round-trip digits, positional for 1e-4 <= |x| < 1e16, otherwise `d.ddde+XX`.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the same shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&digits);
        } else if point as usize >= digits.len() {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point as usize - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    }
    out
}

/// JSON string literal as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other
/// controls as `\u00XX`; with `ensure_ascii`, everything outside ' '..='~' as `\uXXXX`
/// (surrogate pairs above the BMP).
fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // Values checked against CPython 3.11 repr().
        for (f, want) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (123.456, "123.456"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-3e-7, "-3e-07"),
            (1.5e-5, "1.5e-05"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e22, "1e+22"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v = Value::from(minijinja::value::Serde(serde_json::json!({
            "b": [1, 2.0, true, null, "<&'>"], "a": {"é": "\u{1F980}\n\u{1}"}, "e": [], "f": {}
        })));
        let d = dumps(&v, &DumpOpts::default()).unwrap();
        assert_eq!(
            d,
            r#"{"b": [1, 2.0, true, null, "<&'>"], "a": {"é": "🦀\n\u0001"}, "e": [], "f": {}}"#
        );
        let opts = DumpOpts {
            ensure_ascii: true,
            sort_keys: true,
            ..DumpOpts::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            r#"{"a": {"\u00e9": "\ud83e\udd80\n\u0001"}, "b": [1, 2.0, true, null, "<&'>"], "e": [], "f": {}}"#
        );
        let opts = DumpOpts {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ..DumpOpts::default()
        };
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [1, {"b": null}], "c": []}),
        ));
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": []\n}"
        );
        assert!(dumps(&Value::UNDEFINED, &DumpOpts::default()).is_err());
    }
}
