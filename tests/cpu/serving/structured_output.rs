//! Structured output on the tiny model (random weights, so only the constraint can make the output
//! well formed): JSON schemas, json_object, regex, choice, Lark, and tool calls that tool_choice
//! demands; the grammars themselves against the real vocabulary; and the errors a bad format gets.

use lily::server::constrain::{Grammars, OutputFormat, Structure, ToolCalls};
use serde_json::{json, Value};
use crate::server_support::*;
use std::sync::{Arc, OnceLock};

fn tokenizer() -> Arc<lily::tokenizer::Tokenizer> {
    tiny_tokenizer()
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let t = tokenizer();
        let vocab = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap().config.vocab_size;
        let end = t.token_id("<|im_end|>").unwrap();
        Grammars::new(t, vocab, end)
    })
}

/// Whether the structure's matcher takes every token of `text` and can end there.
fn accepts(s: &Structure, text: &str) -> bool {
    let mut m = grammars().matcher(s).unwrap();
    let ids = tokenizer().encode(text).unwrap();
    ids.iter().all(|&t| m.consume_token(t).is_ok()) && m.is_accepting().unwrap()
}

fn weather_tools(parallel: bool) -> Structure {
    let functions = json!({
        "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
        "get_time": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}}, "required": ["zone"]}
    });
    Structure::Tools(ToolCalls { functions: functions.as_object().unwrap().clone(), parallel })
}

const CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

#[test]
fn tool_call_grammar_takes_qwen_calls_and_nothing_else() {
    assert!(accepts(&weather_tools(false), CALL));
    assert!(accepts(&weather_tools(false), &format!("\n\n{CALL}")));
    assert!(accepts(&weather_tools(false), "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n</tool_call>"));
    // Two calls only when parallel calls are allowed.
    let two = format!("{CALL}\n{CALL}");
    assert!(accepts(&weather_tools(true), &two));
    assert!(!accepts(&weather_tools(false), &two));
    // An undeclared function, a missing required parameter, a mistyped value, an enum miss, text.
    assert!(!accepts(&weather_tools(true), &CALL.replace("get_weather", "delete_files")));
    assert!(!accepts(&weather_tools(true), "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"));
    assert!(!accepts(&weather_tools(true), &CALL.replace("\n3\n", "\nthree\n")));
    assert!(!accepts(&weather_tools(true), "<tool_call>\n<function=get_time>\n<parameter=zone>\nmars\n</parameter>\n</function>\n</tool_call>"));
    assert!(!accepts(&weather_tools(true), "Sure, let me check."));
}

#[test]
fn formats_take_what_they_describe() {
    let schema = Structure::Format(OutputFormat::JsonSchema(json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false})));
    assert!(accepts(&schema, r#"{"n": 42}"#));
    assert!(!accepts(&schema, r#"{"n": "42"}"#));
    assert!(!accepts(&schema, r#"{"m": 1}"#));
    let regex = Structure::Format(OutputFormat::Regex(r"\d{3}-[a-z]+".into()));
    assert!(accepts(&regex, "123-abc"));
    assert!(!accepts(&regex, "12-abc"));
    let choice = Structure::Format(OutputFormat::Choice(vec!["yes".into(), "no".into()]));
    assert!(accepts(&choice, "no"));
    assert!(!accepts(&choice, "maybe"));
    let lark = Structure::Format(OutputFormat::Lark("start: \"(\" start \")\" | \"x\"".into()));
    assert!(accepts(&lark, "((x))"));
    assert!(!accepts(&lark, "((x)"));
    // A grammar that does not compile is an error with a reason, not a panic.
    let bad = Structure::Format(OutputFormat::Lark("start: undefined_rule".into()));
    let err = grammars().matcher(&bad).err().expect("the grammar does not compile");
    assert!(err.contains("undefined_rule"), "{err}");
}

/// The tiny model's server with thinking off by default (its random reasoning would never end).
fn server() -> &'static lily::server::ServerHandle {
    static S: OnceLock<lily::server::ServerHandle> = OnceLock::new();
    S.get_or_init(|| {
        let mut a = args();
        a.enable_thinking = Some(false);
        spawn(a).unwrap()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_weights_answer_in_the_requested_format() {
    let url = format!("{}/v1/chat/completions", server().url());
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}, "required": ["name", "age", "tags"], "additionalProperties": false});
    for (seed, stream) in [(1, false), (2, true)] {
        let body = json!({"messages": user("Describe a person."), "max_tokens": 200, "seed": seed, "stream": stream, "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}}});
        let content = if stream {
            let r = client().post(&url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let events = sse_events(r).await;
            events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"].as_str().unwrap_or("").to_string()).collect::<String>()
        } else {
            let (st, v) = post(&url, body).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        };
        let person: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("not JSON ({e}): {content:?}"));
        assert!(person["name"].as_str().is_some_and(|n| n.chars().count() <= 12), "{person}");
        assert!(person["age"].as_u64().is_some_and(|a| a <= 150), "{person}");
        assert!(person["tags"].as_array().is_some_and(|t| t.len() <= 3), "{person}");
        assert_eq!(person.as_object().unwrap().len(), 3, "{person}");
    }
    let (st, v) = post(&url, json!({"messages": user("JSON please"), "max_tokens": 60, "response_format": {"type": "json_object"}, "seed": 3})).await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(content).unwrap().is_object(), "{content}");
    } else {
        assert!(content.trim_start().starts_with('{'), "{content}");
    }
    let (st, v) = post(&url, json!({"messages": user("Pick"), "max_tokens": 10, "guided_choice": ["red", "green", "blue"]})).await;
    assert_eq!(st, 200, "{v}");
    assert!(["red", "green", "blue"].contains(&v["choices"][0]["message"]["content"].as_str().unwrap()), "{v}");
    let (st, v) = post(&format!("{}/v1/completions", server().url()), json!({"prompt": "Code:", "max_tokens": 12, "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})).await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text.len() == 8 && text.as_bytes()[3] == b'-', "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_required_and_named_are_enforced() {
    let url = format!("{}/v1/chat/completions", server().url());
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}}, "required": ["zone"]}}}
    ]);
    for (choice, parallel, seed) in [(json!("required"), false, 1), (json!({"type": "function", "function": {"name": "get_time"}}), true, 2), (json!("required"), true, 3)] {
        let body = json!({"messages": user("What's the weather?"), "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 300, "seed": seed});
        let (st, v) = post(&url, body).await;
        assert_eq!(st, 200, "{v}");
        let ch = &v["choices"][0];
        assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
        let calls = ch["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{v}");
        for c in calls {
            let name = c["function"]["name"].as_str().unwrap();
            let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            match name {
                "get_weather" => {
                    assert!(args["city"].is_string(), "{args}");
                    assert!(args["days"].as_u64().is_some_and(|d| (1..=7).contains(&d)), "{args}");
                }
                "get_time" => assert!(["utc", "local"].contains(&args["zone"].as_str().unwrap()), "{args}"),
                other => panic!("undeclared function {other}"),
            }
            if choice.is_object() {
                assert_eq!(name, "get_time");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_formats_get_400_naming_the_field() {
    let url = format!("{}/v1/chat/completions", server().url());
    let cases = [
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}), "response_format"),
        (json!({"guided_grammar": "start: nothing_here"}), "response_format"),
        (json!({"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (json!({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"}), "response_format"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"messages": user("hi"), "max_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, v) = post(&url, body).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_thinking_on_the_constraint_starts_after_the_reasoning() {
    // The tiny model's reasoning never ends by itself: this wrapper makes its fourth generated
    // token `</think>`. Before it the output is free reasoning; after it, the schema's JSON.
    let think_end = tokenizer().token_id("</think>").unwrap() as usize;
    let mut steps = 0;
    let s = steered_server(move |wanted, logits: &mut [f32], _| {
        match wanted {
            lily::backend::LogitsWanted::None => steps = 0,
            _ => steps += 1,
        }
        if steps == 4 {
            logits[think_end] = 1e9;
        }
    });
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    let body = json!({"messages": user("Think, then answer."), "max_tokens": 60, "seed": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}});
    let (st, v) = post(&format!("{}/v1/chat/completions", s.url()), body).await;
    assert_eq!(st, 200, "{v}");
    let msg = &v["choices"][0]["message"];
    assert!(!msg["reasoning_content"].as_str().unwrap_or("").is_empty(), "free reasoning first: {v}");
    let answer: Value = serde_json::from_str(msg["content"].as_str().unwrap().trim()).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(answer["ok"].is_boolean(), "{v}");
}
