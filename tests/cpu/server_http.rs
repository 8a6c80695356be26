//! The OpenAI-compatible server over real HTTP on loopback: the tiny random-weight model on the
//! CPU backend for generation paths, and the test-only scripted backend where the model's text
//! must be known (tool calls, reasoning, stop strings).

use serde_json::{json, Value};
use crate::server_support::*;
use std::time::{Duration, Instant};

fn assert_error_object(v: &Value) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "error object: {v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_metrics_and_404() {
    let s = tiny_server();
    let c = client();
    let h: Value = c.get(format!("{}/health", s.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(h["status"], "ok");
    let m: Value = c.get(format!("{}/v1/models", s.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "Qwen3.6-35B-A3B");
    assert_eq!(m["data"][0]["object"], "model");
    let r = c.get(format!("{}/nope", s.url())).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_error_object(&r.json().await.unwrap());
    let r = c.get(format!("{}/v1/chat/completions", s.url())).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let text = c.get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
    for name in ["lily_requests_total", "lily_time_to_first_token_seconds_bucket", "lily_inter_token_latency_seconds_count", "lily_request_queue_time_seconds_bucket", "lily_request_prefill_time_seconds_count", "lily_queue_depth", "lily_prefix_cache_hit_ratio", "lily_prompt_tokens_total"] {
        assert!(text.contains(name), "metrics lack {name}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming_tiny_model() {
    let s = tiny_server();
    let (st, v) = post(&format!("{}/v1/chat/completions", s.url()), json!({"model": "anything", "messages": user("Hello non-stream"), "max_tokens": 6, "temperature": 0, "unknown_field": [1]})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let fr = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(["stop", "length"].contains(&fr), "{fr}");
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 5);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 6);
    assert_eq!(u["total_tokens"].as_u64().unwrap(), u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    // The request's time to first token is split into its queue and prefill parts.
    let text = reqwest::get(format!("{}/metrics", s.url())).await.unwrap().text().await.unwrap();
    for name in ["lily_request_queue_time_seconds_count", "lily_request_prefill_time_seconds_count"] {
        let n: u64 = text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        assert!(n >= 1, "{name} is {n}:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_matches_non_streaming_and_has_openai_shape() {
    let s = tiny_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let body = json!({"messages": user("stream shape test"), "max_tokens": 8, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
    let (_, full) = post(&url, body.clone()).await;
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = client().post(&url).json(&sb).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let evs = sse_events(r).await;
    assert_eq!(evs.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = evs[..evs.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let id = chunks[0]["id"].clone();
    let created = chunks[0]["created"].clone();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["created"], created);
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) {
            if let Some(t) = ch["delta"]["content"].as_str() {
                content.push_str(t);
            }
            if !ch["finish_reason"].is_null() {
                finish = Some(ch["finish_reason"].clone());
            } else {
                assert!(finish.is_none(), "chunk after finish_reason");
            }
        }
    }
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage_chunk["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["usage"].is_null()));
    assert_eq!(finish.unwrap(), full["choices"][0]["finish_reason"]);
    assert_eq!(content, full["choices"][0]["message"]["content"].as_str().unwrap_or(""), "stream and non-stream greedy outputs differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_hit_gives_identical_greedy_output() {
    let s = tiny_server();
    let url = format!("{}/v1/completions", s.url());
    // Token ids, so the prompt is exactly what the cache sees.
    let ids: Vec<u32> = (0..40).map(|i| 1000 + i * 37).collect();
    let body = json!({"prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 1});
    let (st, a) = post(&url, body.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, b) = post(&url, body.clone()).await;
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 39, "exact repeat resumes at prompt-1");
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["choices"][0]["logprobs"]["tokens"], b["choices"][0]["logprobs"]["tokens"]);
    let la: Vec<f64> = serde_json::from_value(a["choices"][0]["logprobs"]["token_logprobs"].clone()).unwrap();
    let lb: Vec<f64> = serde_json::from_value(b["choices"][0]["logprobs"]["token_logprobs"].clone()).unwrap();
    for (x, y) in la.iter().zip(&lb) {
        assert!((x - y).abs() < 1e-3, "logprobs differ: {la:?} vs {lb:?}");
    }
    // An extension of the prompt also hits (the longest cached prefix).
    let mut longer = ids.clone();
    longer.extend([5, 6, 7]);
    let (_, c) = post(&url, json!({"prompt": longer, "max_tokens": 3, "temperature": 0})).await;
    assert!(c["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 39);
    // ...and gives the same output as the same request on a fresh server with no cache.
    let fresh = {
        let mut a = args();
        a.prefix_cache_mb = Some(0);
        spawn(a).unwrap()
    };
    let (_, d) = post(&format!("{}/v1/completions", fresh.url()), json!({"prompt": longer, "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(c["choices"][0]["text"], d["choices"][0]["text"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_seed_same_output() {
    let s = tiny_server();
    let url = format!("{}/v1/completions", s.url());
    let body = |seed: u64| json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed});
    let (_, a) = post(&url, body(7)).await;
    let (_, b) = post(&url, body(7)).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let mut differs = false;
    for seed in 8..12 {
        let (_, c) = post(&url, body(seed)).await;
        differs |= c["choices"][0]["text"] != a["choices"][0]["text"];
    }
    assert!(differs, "different seeds never changed the sample");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_with_error_objects() {
    let s = tiny_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let c = client();
    let raw = |body: Vec<u8>| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let r = c.post(&url).header("content-type", "application/json").body(body).send().await.unwrap();
            let st = r.status().as_u16();
            (st, r.json::<Value>().await.unwrap())
        }
    };
    let (st, v) = raw(b"{\"messages\": [".to_vec()).await;
    assert_eq!(st, 400);
    assert_error_object(&v);
    let (st, v) = raw(vec![0x7b, 0xff, 0xfe, 0x7d]).await;
    assert_eq!(st, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("UTF-8"));
    let (st, _) = raw(vec![]).await;
    assert_eq!(st, 400);
    // Over the body limit.
    {
        let mut a = args();
        a.max_body_bytes = 1024;
        let small = spawn(a).unwrap();
        let body = format!("{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}", "a".repeat(4000));
        let r = c.post(format!("{}/v1/chat/completions", small.url())).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 413);
        assert_error_object(&r.json().await.unwrap());
    }
    let cases = [
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "system", "content": "hi"}]}), "messages"),
        (json!({"messages": user("x"), "n": 17}), "n"),
        (json!({"messages": user("x"), "temperature": 7000}), "temperature"),
        (json!({"messages": user("x"), "top_p": 1.5}), "top_p"),
        (json!({"messages": user("x"), "max_tokens": 0}), "max_tokens"),
        (json!({"messages": user("x"), "max_tokens": 100000}), "max_tokens"),
        (json!({"messages": user("x"), "top_logprobs": 50, "logprobs": true}), "top_logprobs"),
        (json!({"messages": user("x"), "stop": [1, 2]}), "stop"),
        (json!({"messages": user("x"), "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": "hello"}), "messages"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), "messages[0].content"),
    ];
    for (body, param) in cases {
        let (st, v) = post(&url, body.clone()).await;
        assert_eq!(st, 400, "{body} -> {v}");
        assert_error_object(&v);
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
    let long = "word ".repeat(1500);
    let (st, v) = post(&url, json!({"messages": user(&long), "max_tokens": 5})).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // The server is still fine.
    let (st, _) = post(&url, json!({"messages": user("still alive?"), "max_tokens": 2})).await;
    assert_eq!(st, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_enforced() {
    let mut a = args();
    a.api_key = Some("sk-test-123".into());
    let s = spawn(a).unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", s.url());
    let body = json!({"messages": user("hi"), "max_tokens": 2});
    let r = c.post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_error_object(&r.json().await.unwrap());
    let r = c.post(&url).bearer_auth("sk-wrong").json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c.get(format!("{}/v1/models", s.url())).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c.post(&url).bearer_auth("sk-test-123").json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(c.get(format!("{}/health", s.url())).send().await.unwrap().status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_answers_429_with_retry_after() {
    let mut a = args();
    a.max_queue = 1;
    let s = spawn(a).unwrap();
    let url = format!("{}/v1/completions", s.url());
    // Occupy the model with a long streaming request, and wait until it is running, so the
    // queue (one slot) is empty when the burst arrives: deterministic on a loaded machine.
    let mut running = client().post(&url).json(&json!({"prompt": "occupy", "max_tokens": 900, "temperature": 0, "stream": true})).send().await.unwrap();
    assert!(running.chunk().await.unwrap().is_some());
    let mut tasks = Vec::new();
    for i in 0..7 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let r = client().post(&url).json(&json!({"prompt": format!("queue test {i}"), "max_tokens": 8, "temperature": 0})).send().await.unwrap();
            let st = r.status().as_u16();
            let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
            let v: Value = r.json().await.unwrap();
            (st, retry, v)
        }));
    }
    // Give the burst time to arrive, then hang up: the queued request runs next.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    drop(running);
    let mut n429 = 0;
    let mut n200 = 0;
    for t in tasks {
        let (st, retry, v) = t.await.unwrap();
        match st {
            200 => n200 += 1,
            429 => {
                n429 += 1;
                assert!(retry.is_some());
                assert_eq!(v["error"]["type"], "rate_limit_error");
            }
            other => panic!("unexpected status {other}: {v}"),
        }
    }
    // One burst request fits the queue slot; the rest are refused while the model is busy
    // (a straggler arriving after the slot frees may also be accepted).
    assert!(n200 >= 1 && n429 >= 4 && n200 + n429 == 7, "200: {n200}, 429: {n429}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_plain_request_counts_as_499() {
    // A non-streamed request whose client gives up: its handler goes with the connection, so the
    // worker, which notices, counts it.
    let s = spawn(args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let r = client().post(&url).timeout(Duration::from_millis(300)).json(&json!({"prompt": "a long story", "max_tokens": 900, "temperature": 0})).send().await;
    assert!(r.is_err(), "the client gave up");
    let t0 = Instant::now();
    loop {
        let m = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
        if m.contains("lily_requests_total{endpoint=\"completions\",status=\"499\"} 1") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no 499 counted:\n{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_generation() {
    let s = spawn(args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let mut r = client().post(&url).json(&json!({"prompt": "a long story", "max_tokens": 900, "temperature": 0, "stream": true})).send().await.unwrap();
    // Wait for the first token, then hang up.
    let first = r.chunk().await.unwrap();
    assert!(first.is_some());
    drop(r);
    let t0 = Instant::now();
    loop {
        if s.metrics.cancelled.load(std::sync::atomic::Ordering::Relaxed) >= 1 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "generation was not cancelled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let generated = s.metrics.completion_tokens.load(std::sync::atomic::Ordering::Relaxed);
    assert!(generated < 900, "it generated {generated} tokens after the client left");
    // The slot is free: a new request is served at once.
    let (st, _) = post(&url, json!({"prompt": "next", "max_tokens": 2})).await;
    assert_eq!(st, 200);
}

// ---- scripted backend: known model output ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_non_streaming_and_streaming() {
    let s = scripted_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather <by city> & 'days'", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]);
    let body = json!({"messages": user("What's the weather in Paris?"), "tools": tools, "max_tokens": 200});
    let (st, v) = post(&url, body.clone()).await;
    assert_eq!(st, 200, "{v}");
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls");
    let msg = &ch["message"];
    assert_eq!(msg["content"], "Let me check.\n\n");
    assert_eq!(msg["reasoning_content"], "The user wants weather.");
    assert_eq!(msg["reasoning"], "The user wants weather.");
    let tc = &msg["tool_calls"][0];
    assert_eq!(tc["type"], "function");
    assert!(tc["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(tc["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(tc["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let evs = sse_events(client().post(&url).json(&sb).send().await.unwrap()).await;
    let mut name = None;
    let mut arg_text = String::new();
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut finish = None;
    for e in &evs[..evs.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let ch = &c["choices"][0];
        content += ch["delta"]["content"].as_str().unwrap_or("");
        reasoning += ch["delta"]["reasoning_content"].as_str().unwrap_or("");
        if let Some(tcs) = ch["delta"]["tool_calls"].as_array() {
            for t in tcs {
                assert_eq!(t["index"], 0);
                if let Some(n) = t["function"]["name"].as_str() {
                    assert!(name.is_none());
                    assert!(arg_text.is_empty(), "arguments before the name");
                    name = Some(n.to_string());
                    assert!(t["id"].is_string());
                }
                arg_text += t["function"]["arguments"].as_str().unwrap_or("");
            }
        }
        if !ch["finish_reason"].is_null() {
            finish = Some(ch["finish_reason"].clone());
        }
    }
    assert!(!content.contains("<tool_call>") && !content.contains("<function"), "XML leaked: {content:?}");
    assert_eq!(content, "Let me check.\n\n");
    assert_eq!(reasoning, "The user wants weather.");
    assert_eq!(name.as_deref(), Some("get_weather"));
    assert_eq!(serde_json::from_str::<Value>(&arg_text).unwrap(), json!({"city": "Paris", "days": 3}));
    assert_eq!(finish, Some(json!("tool_calls")));

    // Two calls; a JSON-valued parameter keeps its type.
    let (_, v) = post(&url, json!({"messages": user("make two calls"), "chat_template_kwargs": {"enable_thinking": false}, "tools": [{"type": "function", "function": {"name": "a", "parameters": {}}}, {"type": "function", "function": {"name": "b", "parameters": {}}}]})).await;
    let tcs = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(tcs.len(), 2);
    assert_eq!(serde_json::from_str::<Value>(tcs[1]["function"]["arguments"].as_str().unwrap()).unwrap(), json!({"y": {"k": [1, 2]}}));
    assert!(v["choices"][0]["message"]["content"].is_null());

    // Without tools in the request the text is plain content.
    let (_, v) = post(&url, json!({"messages": user("make two calls"), "chat_template_kwargs": {"enable_thinking": false}})).await;
    let m = &v["choices"][0]["message"];
    assert!(m["content"].as_str().unwrap_or("").contains("<tool_call>") || m["reasoning_content"].as_str().unwrap_or("").contains("<tool_call>"), "{v}");
    assert!(m.get("tool_calls").is_none(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_split_and_multi_turn_with_tool_results() {
    let s = scripted_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let (_, v) = post(&url, json!({"messages": user("what is 2+2?")})).await;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Two plus two is four.");
    assert_eq!(m["content"], "The answer is 4.");
    assert!(v["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap() > 0);
    // A conversation with an assistant tool call and a tool result renders and answers.
    let msgs = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "reasoning_content": "need tool", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    ]);
    let (st, v) = post(&url, json!({"messages": msgs, "max_tokens": 300})).await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_never_leak() {
    let s = scripted_server();
    let url = format!("{}/v1/chat/completions", s.url());
    for stop in [json!("STOP"), json!(["zzz", ", STO"]), json!("two, S")] {
        let body = json!({"messages": user("stop test"), "stop": stop, "chat_template_kwargs": {"enable_thinking": false}});
        let (_, v) = post(&url, body.clone()).await;
        let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert!(content.starts_with("Counting: one"), "{content:?}");
        assert!(!content.contains("STO") && !content.contains("three"), "{content:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let mut sb = body;
        sb["stream"] = json!(true);
        let evs = sse_events(client().post(&url).json(&sb).send().await.unwrap()).await;
        let mut streamed = String::new();
        for e in &evs[..evs.len() - 1] {
            let c: Value = serde_json::from_str(e).unwrap();
            streamed += c["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        }
        assert_eq!(streamed, content);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unicode_streams_whole_characters_and_logprobs_format() {
    let s = scripted_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let body = json!({"messages": user("unicode please"), "stream": true, "logprobs": true, "top_logprobs": 3, "chat_template_kwargs": {"enable_thinking": false}});
    let evs = sse_events(client().post(&url).json(&body).send().await.unwrap()).await;
    let mut text = String::new();
    let mut n_lp = 0;
    for e in &evs[..evs.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let ch = &c["choices"][0];
        let piece = ch["delta"]["content"].as_str().unwrap_or("");
        assert!(!piece.contains('\u{FFFD}'), "split character in {piece:?}");
        text += piece;
        if let Some(lps) = ch["logprobs"]["content"].as_array() {
            for lp in lps {
                n_lp += 1;
                assert!(lp["token"].is_string() && lp["logprob"].as_f64().unwrap() <= 0.0 && lp["bytes"].is_array());
                assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 3);
            }
        }
    }
    assert_eq!(text, "Héllo wörld 你好 🎉 done");
    assert!(n_lp >= 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_request_does_not_stop_the_server() {
    let poison = 4242;
    let s = around_server(move |b: &mut dyn lily::backend::Backend, seq: &mut lily::backend::Sequence, tokens: &[u32], w| {
        if tokens.contains(&poison) {
            panic!("poisoned token");
        }
        if tokens.contains(&(poison + 1)) {
            anyhow::bail!("backend error");
        }
        b.forward(seq, tokens, w)
    });
    let url = format!("{}/v1/completions", s.url());
    let (st, v) = post(&url, json!({"prompt": [1, 4242, 3], "max_tokens": 2})).await;
    assert_eq!(st, 500, "{v}");
    assert_eq!(v["error"]["type"], "server_error");
    let (st, _) = post(&url, json!({"prompt": [1, 4243, 3], "max_tokens": 2})).await;
    assert_eq!(st, 500);
    // Streaming: the error arrives as an error event.
    let evs = sse_events(client().post(&url).json(&json!({"prompt": [1, 4242], "stream": true, "max_tokens": 2})).send().await.unwrap()).await;
    assert!(evs.iter().any(|e| e.contains("\"error\"")), "{evs:?}");
    let (st, v) = post(&url, json!({"prompt": [1, 2, 3], "max_tokens": 2})).await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_warms_its_backend_up_for_its_batch_once_and_serves_if_that_fails() {
    use lily::backend::{Backend, LogitsWanted, Sequence};
    use std::sync::{Arc, Mutex};
    struct Warming {
        inner: lily::backend::cpu::CpuBackend,
        calls: Arc<Mutex<Vec<usize>>>,
        fail: bool,
    }
    impl Backend for Warming {
        fn name(&self) -> &'static str {
            "warming"
        }
        fn config(&self) -> &lily::checkpoint::ModelConfig {
            self.inner.config()
        }
        fn new_sequence(&self, max_seq: usize) -> anyhow::Result<Sequence> {
            self.inner.new_sequence(max_seq)
        }
        fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], w: LogitsWanted) -> anyhow::Result<Vec<f32>> {
            self.inner.forward(seq, tokens, w)
        }
        fn batch_capacity(&self) -> usize {
            6
        }
        fn warm_up(&mut self, max_batch: usize) -> anyhow::Result<Option<String>> {
            self.calls.lock().unwrap().push(max_batch);
            if self.fail {
                anyhow::bail!("warm-up failed (simulated)");
            }
            Ok(Some("warmed up (test)".into()))
        }
    }
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    // (--no-warmup, the warm-up fails, --max-batch, the warm-ups the backend saw)
    let cases: [(bool, bool, Option<usize>, &[usize]); 4] = [(false, false, None, &[6]), (false, false, Some(3), &[3]), (true, false, None, &[]), (false, true, None, &[6])];
    for (no_warmup, fail, max_batch, want) in cases {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let backend = Warming { inner: lily::backend::cpu::CpuBackend::new(&ck).unwrap(), calls: calls.clone(), fail };
        let mut a = args();
        a.no_warmup = no_warmup;
        a.max_batch = max_batch;
        let s = spawn_with_backend(a, Box::new(backend)).unwrap();
        let (st, v) = post(&format!("{}/v1/completions", s.url()), json!({"prompt": [1, 2, 3], "max_tokens": 2})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(calls.lock().unwrap().as_slice(), want, "no_warmup {no_warmup}, failing {fail}, max_batch {max_batch:?}");
    }
}

/// A test backend's forward: feeds `tokens` and answers logits that always pick token 7.
fn always_seven(vocab: usize, seq: &mut lily::backend::Sequence, tokens: &[u32], w: lily::backend::LogitsWanted) -> anyhow::Result<Vec<f32>> {
    use lily::backend::LogitsWanted;
    seq.check_room(tokens.len())?;
    seq.advance(tokens.len());
    let mut row = vec![0.0f32; vocab];
    row[7] = 10.0;
    Ok(match w {
        LogitsWanted::None => vec![],
        LogitsWanted::Last => row,
        LogitsWanted::All => row.repeat(tokens.len()),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_that_cannot_be_copied_is_served_uncached() {
    // The prefix cache copies the sequence after the prompt (a device allocation on the GPU).
    // When that copy fails the request must still be answered, from an uncached prefill.
    use lily::backend::{Backend, LogitsWanted, Sequence, SequenceState};
    use std::any::Any;
    struct NoCopy;
    impl SequenceState for NoCopy {
        fn try_clone_state(&self, _len: usize) -> anyhow::Result<Box<dyn SequenceState>> {
            anyhow::bail!("out of device memory (simulated)")
        }
        fn memory_bytes(&self) -> usize {
            64
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }
    struct Fixed {
        cfg: lily::checkpoint::ModelConfig,
    }
    impl Backend for Fixed {
        fn name(&self) -> &'static str {
            "fixed"
        }
        fn config(&self) -> &lily::checkpoint::ModelConfig {
            &self.cfg
        }
        fn new_sequence(&self, max_seq: usize) -> anyhow::Result<Sequence> {
            Ok(Sequence::new(max_seq, Box::new(NoCopy)))
        }
        fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], w: LogitsWanted) -> anyhow::Result<Vec<f32>> {
            always_seven(self.cfg.vocab_size, seq, tokens, w)
        }
    }
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    let s = spawn_with_backend(args(), Box::new(Fixed { cfg: ck.config.clone() })).unwrap();
    let url = format!("{}/v1/completions", s.url());
    for _ in 0..2 {
        let (st, v) = post(&url, json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");
    }
    let metrics = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("lily_prefix_cache_hits_total 0"), "{metrics}");
}

/// A test backend whose sequences draw on a small budget: one unit per reserved token plus ten
/// per sequence, `BUDGET` in all.
mod budgeted {
    use super::always_seven;
    use lily::backend::{Backend, LogitsWanted, MemoryFull, Sequence, SequenceState};
    use std::any::Any;
    use std::sync::{Arc, Mutex};
    pub const BUDGET: usize = 100;
    struct Held {
        units: usize,
        used: Arc<Mutex<usize>>,
    }
    impl Held {
        fn take(used: &Arc<Mutex<usize>>, units: usize) -> anyhow::Result<Held> {
            let mut u = used.lock().unwrap();
            if *u + units > BUDGET {
                return Err(MemoryFull { needed_bytes: units, available_bytes: BUDGET - *u }.into());
            }
            *u += units;
            Ok(Held { units, used: used.clone() })
        }
    }
    impl Drop for Held {
        fn drop(&mut self) {
            *self.used.lock().unwrap() -= self.units;
        }
    }
    impl SequenceState for Held {
        fn try_clone_state(&self, _len: usize) -> anyhow::Result<Box<dyn SequenceState>> {
            Ok(Box::new(Held::take(&self.used, self.units)?))
        }
        fn memory_bytes(&self) -> usize {
            self.units
        }
        fn reserve(&mut self, tokens: usize) -> anyhow::Result<()> {
            if 10 + tokens > self.units {
                let more = Held::take(&self.used, 10 + tokens - self.units)?;
                self.units += more.units;
                std::mem::forget(more);
            }
            Ok(())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }
    pub struct Budgeted {
        pub cfg: lily::checkpoint::ModelConfig,
        pub used: Arc<Mutex<usize>>,
        /// Time each forward takes (so requests overlap).
        pub delay: std::time::Duration,
    }
    impl Backend for Budgeted {
        fn name(&self) -> &'static str {
            "budgeted"
        }
        fn sequence_memory(&self) -> Option<lily::backend::SequenceMemoryReport> {
            let used = *self.used.lock().unwrap() as u64;
            Some(lily::backend::SequenceMemoryReport { budget_bytes: BUDGET as u64, in_use_bytes: used, reserved_bytes: 0, cached_bytes: 0, page_bytes: 1 })
        }
        fn config(&self) -> &lily::checkpoint::ModelConfig {
            &self.cfg
        }
        fn new_sequence(&self, max_seq: usize) -> anyhow::Result<Sequence> {
            Ok(Sequence::new(max_seq, Box::new(Held::take(&self.used, 10)?)))
        }
        fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], w: LogitsWanted) -> anyhow::Result<Vec<f32>> {
            std::thread::sleep(self.delay);
            always_seven(self.cfg.vocab_size, seq, tokens, w)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_sequence_memory_evicts_cached_snapshots_then_refuses_with_503() {
    // A request that fits only once cached snapshots are dropped is served; one that cannot fit
    // at all gets 503 with the reason, and the server goes on serving.
    use budgeted::Budgeted;
    use std::sync::{Arc, Mutex};
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    let used = Arc::new(Mutex::new(0));
    let s = spawn_with_backend(args(), Box::new(Budgeted { cfg: ck.config.clone(), used: used.clone(), delay: Duration::ZERO })).unwrap();
    let url = format!("{}/v1/completions", s.url());
    // 6 + 4 tokens: the request holds 20 units, and leaves a snapshot of 20 in the cache (the
    // sequence it consumed; the prompt went in with its first token, so no exact-repeat one).
    let (st, v) = post(&url, json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    let cached = *used.lock().unwrap();
    assert_eq!(cached, 20, "one cached snapshot");
    // 71 tokens + 10 fit only once the snapshot is gone.
    let (st, v) = post(&url, json!({"prompt": [9, 9, 9, 9, 9, 9, 9, 9, 9, 9], "max_tokens": 61, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 61, "{v}");
    // More than the whole budget: 503, with the reason.
    let (st, v) = post(&url, json!({"prompt": [3, 3, 3], "max_tokens": 200, "temperature": 0})).await;
    assert_eq!(st, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("not enough GPU memory"), "{v}");
    let (st, v) = post(&url, json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    // The worker caches the snapshots after the answer is sent: wait until it is idle.
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
        if metrics.contains("lily_requests_running 0") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(metrics.contains("lily_requests_running 0"), "{metrics}");
    assert!(metrics.contains("lily_sequence_memory_budget_bytes 100"), "{metrics}");
    let held = *used.lock().unwrap();
    assert!(metrics.contains(&format!("lily_sequence_memory_used_bytes {held}")), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_memory_that_running_requests_hold() {
    // Each request needs 10 + 6 + 40 = 56 of the 100 units: the second cannot start while the
    // first runs, so it waits at the head of the queue (no 503) and starts when the first ends.
    use budgeted::{Budgeted, BUDGET};
    use std::sync::{Arc, Mutex};
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    let used = Arc::new(Mutex::new(0));
    let s = spawn_with_backend(args(), Box::new(Budgeted { cfg: ck.config.clone(), used: used.clone(), delay: Duration::from_millis(5) })).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let ask = |p: u32| post(&url, json!({"prompt": [p, p, p, p, p, p], "max_tokens": 40, "temperature": 0}));
    let ((s1, v1), (s2, v2)) = tokio::join!(ask(1), async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        ask(2).await
    });
    assert_eq!((s1, s2), (200, 200), "{v1} {v2}");
    assert_eq!(v2["usage"]["completion_tokens"], 40, "{v2}");
    assert!(*used.lock().unwrap() <= BUDGET);
    let metrics = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
    assert!(!metrics.contains("status=\"503\""), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_generates_through_end_of_sequence_tokens() {
    // A model that always says end-of-sequence: one (counted, unshown) token, unless the request
    // asks to ignore it (vLLM's benchmark extension); then max_tokens of them.
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    let eos = ck.config.eos_token_ids[0] as usize;
    let s = steered_server(move |_, logits: &mut [f32], vocab| logits.chunks_mut(vocab).for_each(|row| row[eos] = 1e9));
    let url = format!("{}/v1/completions", s.url());
    let (st, v) = post(&url, json!({"prompt": "hi", "max_tokens": 5, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!((v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()), (Some(1), Some("stop")), "{v}");
    let (st, v) = post(&url, json!({"prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!((v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()), (Some(5), Some("length")), "{v}");
    let (st, _) = post(&url, json!({"prompt": "hi", "ignore_eos": "yes"})).await;
    assert_eq!(st, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight_lists_the_requested_headers() {
    // `access-control-allow-headers: *` never covers Authorization (Fetch spec), so a browser
    // client with an API key needs the header named.
    let mut a = args();
    a.cors_origins = vec!["*".into()];
    let s = spawn(a).expect("start server");
    let r = client()
        .request(reqwest::Method::OPTIONS, format!("{}/v1/chat/completions", s.url()))
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization, content-type")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let allowed = r.headers().get("access-control-allow-headers").map(|v| v.to_str().unwrap().to_ascii_lowercase()).unwrap_or_default();
    assert!(allowed.contains("authorization") && allowed.contains("content-type"), "allow-headers: {allowed:?}");
    assert_ne!(allowed, "*");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize() {
    let s = tiny_server();
    let url = |p: &str| format!("{}/{p}", s.url());
    // Text: the ids the tokenizer gives, spelled back, and their text again.
    let text = "Hello, Lily: ünïcode ✓";
    let (st, v) = post(&url("tokenize"), json!({"prompt": text, "return_token_strs": true})).await;
    assert_eq!(st, 200, "{v}");
    let ids: Vec<u64> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(v["count"].as_u64().unwrap() as usize, ids.len());
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    assert_eq!(v["token_strs"].as_array().unwrap().len(), ids.len());
    assert_eq!(v["token_strs"][0], "Hello");
    let (st, d) = post(&url("detokenize"), json!({"tokens": ids})).await;
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["prompt"], text);
    // A conversation: exactly the prompt a chat request is charged for; without the generation
    // prompt it is shorter.
    let (_, chat) = post(&url("v1/chat/completions"), json!({"messages": user("Count me"), "max_tokens": 1, "temperature": 0})).await;
    let (st, t) = post(&url("tokenize"), json!({"messages": user("Count me")})).await;
    assert_eq!(st, 200, "{t}");
    assert_eq!(t["count"], chat["usage"]["prompt_tokens"]);
    assert!(t.get("token_strs").is_none());
    let (_, bare) = post(&url("tokenize"), json!({"messages": user("Count me"), "add_generation_prompt": false})).await;
    assert!(bare["count"].as_u64().unwrap() < t["count"].as_u64().unwrap());
    // Bad input: 400 with an error object.
    for body in [json!({}), json!({"prompt": "a", "messages": user("b")}), json!({"prompt": [1, 2]}), json!({"prompt": "a", "return_token_strs": "yes"})] {
        let (st, e) = post(&url("tokenize"), body.clone()).await;
        assert_eq!(st, 400, "{body} -> {e}");
        assert_error_object(&e);
    }
    for body in [json!({"tokens": [1, 999_999_999]}), json!({"tokens": "12"}), json!({"tokens": [-1]})] {
        let (st, e) = post(&url("detokenize"), body.clone()).await;
        assert_eq!(st, 400, "{body} -> {e}");
        assert_error_object(&e);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_tool_calls_are_not_reported_as_complete() {
    let s = scripted_server();
    let url = format!("{}/v1/chat/completions", s.url());
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    // The model ends its sequence inside the call: "stop", the arguments as far as they went.
    let (st, v) = post(&url, json!({"messages": user("cut call"), "tools": tools, "chat_template_kwargs": {"enable_thinking": false}})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let tc = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(tc["function"]["name"], "get_weather");
    assert_eq!(tc["function"]["arguments"], "{\"city\": \"Paris\"");
    // max_tokens anywhere inside the weather call: "length", and arguments that parse are the
    // whole call's (the function was closed); some cuts leave them partial.
    let whole = json!({"city": "Paris", "days": 3});
    let mut partial = 0;
    for max in 1..=60 {
        let (st, v) = post(&url, json!({"messages": user("weather please"), "tools": tools, "max_tokens": max})).await;
        assert_eq!(st, 200, "{v}");
        let ch = &v["choices"][0];
        if ch["finish_reason"] != "length" {
            assert_eq!(ch["finish_reason"], "tool_calls", "max_tokens {max}: {v}");
            break;
        }
        if let Some(args) = ch["message"]["tool_calls"][0]["function"]["arguments"].as_str() {
            match serde_json::from_str::<Value>(args) {
                Ok(a) => assert_eq!(a, whole, "max_tokens {max}"),
                Err(_) => partial += 1,
            }
        }
    }
    assert!(partial > 0, "no cut fell inside the arguments");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_that_cannot_fit_are_refused_before_tokenizing() {
    // 2 MiB of text is at least 2 Mi / (longest token) tokens: more than the max-seq of 1,024
    // whatever it says, so it is refused at once instead of after seconds of tokenizing.
    let s = tiny_server();
    let big = "a".repeat(2 << 20);
    for (path, body) in [
        ("v1/chat/completions", json!({"messages": user(&big), "max_tokens": 1})),
        ("v1/completions", json!({"prompt": big, "max_tokens": 1})),
        ("tokenize", json!({"prompt": big})),
    ] {
        let t0 = Instant::now();
        let (st, v) = post(&format!("{}/{path}", s.url()), body).await;
        let secs = t0.elapsed().as_secs_f64();
        let short: String = v.to_string().chars().take(300).collect();
        assert_eq!(st, 400, "{path}: {short}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{path}: {short}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("has at least") && msg.contains("bytes)"), "{path}: the bound, not the tokenizer, refused it: {msg}");
        assert!(secs < 3.0, "{path}: refused after {secs:.1} s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_assistant_message_is_continued_not_answered() {
    // Assistant prefill: the prompt ends with the assistant's text itself (no end of turn, no new
    // assistant turn), and the reply continues it.
    let s = tiny_server();
    let url = |p: &str| format!("{}/{p}", s.url());
    let msgs = json!([{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]);
    let rendered = |t: Value| async move {
        let (st, d) = post(&url("detokenize"), json!({"tokens": t["tokens"]})).await;
        assert_eq!(st, 200, "{d}");
        d["prompt"].as_str().unwrap().to_string()
    };
    let (st, t) = post(&url("tokenize"), json!({"messages": msgs})).await;
    assert_eq!(st, 200, "{t}");
    let text = rendered(t.clone()).await;
    assert!(text.ends_with("<|im_start|>assistant\nOne, two,") || text.ends_with("</think>\n\nOne, two,"), "{text:?}");
    let (st, v) = post(&url("v1/chat/completions"), json!({"messages": msgs, "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], t["count"], "{v}");
    // Asked for a new turn instead, the prompt ends with the generation prompt.
    let (_, fresh) = post(&url("tokenize"), json!({"messages": msgs, "continue_final_message": false})).await;
    let text = rendered(fresh).await;
    assert!(text.contains("One, two,<|im_end|>\n<|im_start|>assistant\n"), "{text:?}");
    let (st, e) = post(&url("v1/chat/completions"), json!({"messages": user("hi"), "continue_final_message": true})).await;
    assert_eq!(st, 400, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_the_prompt() {
    // What evaluation harnesses send: the prompt echoed with every token's log-probability, and
    // no completion. Each prompt position's distribution is the one generation would sample
    // from there.
    let s = tiny_server();
    let url = format!("{}/v1/completions", s.url());
    let ids = json!([785, 9625, 374, 6303, 13]);
    let (st, v) = post(&url, json!({"prompt": ids, "echo": true, "max_tokens": 0, "logprobs": 3, "temperature": 0})).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let lp = &c["logprobs"];
    let (toks, lps, tops, offs) = (lp["tokens"].as_array().unwrap(), lp["token_logprobs"].as_array().unwrap(), lp["top_logprobs"].as_array().unwrap(), lp["text_offset"].as_array().unwrap());
    assert_eq!(toks.len(), 5, "{v}");
    assert!(lps[0].is_null() && tops[0].is_null(), "nothing comes before the first token");
    assert!(lps[1..].iter().all(|x| x.as_f64().is_some_and(|l| l <= 0.0)), "{v}");
    assert_eq!(offs[0], 0);
    assert_eq!(toks.iter().map(|t| t.as_str().unwrap()).collect::<String>(), c["text"].as_str().unwrap());
    // Position 4's alternatives are the first generated token's after the first four tokens.
    let (st, g) = post(&url, json!({"prompt": [785, 9625, 374, 6303], "max_tokens": 1, "logprobs": 3, "temperature": 0})).await;
    assert_eq!(st, 200, "{g}");
    let (want, got) = (g["choices"][0]["logprobs"]["top_logprobs"][0].as_object().unwrap(), tops[4].as_object().unwrap());
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{want:?} vs {got:?}");
    for (k, w) in want {
        assert!((w.as_f64().unwrap() - got[k].as_f64().unwrap()).abs() < 1e-3, "{k}: {w} vs {}", got[k]);
    }
    // Streamed: the echo chunk carries the prompt's logprobs.
    let evs = sse_events(client().post(&url).json(&json!({"prompt": ids, "echo": true, "max_tokens": 2, "logprobs": 1, "temperature": 0, "stream": true})).send().await.unwrap()).await;
    let first: Value = serde_json::from_str(&evs[0]).unwrap();
    assert_eq!(first["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), 5, "{first}");
    assert!(first["choices"][0]["logprobs"]["token_logprobs"][0].is_null());
    // Without echo there is nothing to score.
    let (st, _) = post(&url, json!({"prompt": ids, "max_tokens": 0})).await;
    assert_eq!(st, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_connections_are_closed_and_capped() {
    // A connection that sends half a request's headers, and one that sends nothing, are closed
    // after the header timeout; with the connection cap taken by such clients, /health waits
    // for a slot instead of failing, and is answered once the timeout frees one.
    use std::io::{Read, Write};
    let mut a = args();
    a.header_timeout_secs = 1;
    a.max_connections = 2;
    let s = spawn(a).unwrap();
    let addr = s.url().trim_start_matches("http://").to_string();
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty").unwrap();
    let silent = std::net::TcpStream::connect(&addr).unwrap();
    let t0 = Instant::now();
    let health = tokio::spawn({
        let url = format!("{}/health", s.url());
        async move { client().get(url).send().await.map(|r| r.status().as_u16()) }
    });
    let closed = tokio::task::spawn_blocking(move || {
        for mut conn in [slow, silent] {
            conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 512];
            match conn.read(&mut buf) {
                // Closed: end of stream, or hyper's 408 before closing.
                Ok(n) => assert!(n == 0 || String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 408"), "{:?}", String::from_utf8_lossy(&buf[..n])),
                Err(e) => assert!(!matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "still open after 10 s"),
            }
        }
    });
    closed.await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(800), "closed before the timeout");
    assert_eq!(health.await.unwrap().unwrap(), 200);
}

#[test]
fn zero_sizes_are_refused_at_start_with_the_flag_named() {
    for (flag, set) in [("--max-queue", (|a: &mut lily::server::ServeArgs| a.max_queue = 0) as fn(&mut lily::server::ServeArgs)), ("--max-batch", |a| a.max_batch = Some(0)), ("--prefill-chunk", |a| a.prefill_chunk = 0)] {
        let mut a = args();
        set(&mut a);
        let e = spawn(a).err().expect("refused").to_string();
        assert!(e.contains(flag), "{flag}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_decoding_alone_takes_its_first_token_from_its_prefill() {
    // A prompt with no other request beside it goes in whole with its first token: one forward
    // with the last row's logits, no decode step of its own for the last prompt token. A chat
    // prompt goes in up to its last message start (a prefix-cache snapshot) the old way, and its
    // rest with the first token, so an exact repeat resumes there. A prompt seen before goes the
    // old way, which snapshots all but its last token for the repeats after it. A request that
    // wants logits on the host (logprobs) keeps the old path: all but the last token, then a step
    // on it.
    use lily::backend::LogitsWanted;
    use std::sync::{Arc, Mutex};
    let calls = Arc::new(Mutex::new(Vec::<(usize, LogitsWanted)>::new()));
    let log = calls.clone();
    let s = around_server(move |b: &mut dyn lily::backend::Backend, seq: &mut lily::backend::Sequence, tokens: &[u32], w| {
        log.lock().unwrap().push((tokens.len(), w));
        b.forward(seq, tokens, w)
    });
    let url = format!("{}/v1/completions", s.url());
    let run = |body: Value| {
        let calls = calls.clone();
        let url = url.clone();
        async move {
            calls.lock().unwrap().clear();
            let (st, v) = post(&url, body).await;
            assert_eq!(st, 200, "{v}");
            let log = calls.lock().unwrap().clone();
            (v, log)
        }
    };
    let (v, log) = run(json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(log[0], (6, LogitsWanted::Last), "{log:?}");
    assert!(log[1..].iter().all(|&c| c == (1, LogitsWanted::Last)), "{log:?}");
    assert_eq!(log.len(), v["usage"]["completion_tokens"].as_u64().unwrap() as usize, "one forward a token: {log:?}");
    // No checkpoint before its last token: an exact repeat of a raw prompt this short resumes
    // from nothing (a longer one from its last --prefix-checkpoint-tokens multiple). Seen before,
    // it goes the old way, all but its last token and a step on that, whose snapshot the next
    // repeat resumes from.
    let (v, log) = run(json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");
    assert_eq!(log[..2], [(5, LogitsWanted::None), (1, LogitsWanted::Last)], "{log:?}");
    let (v, log) = run(json!({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 5, "{v}");
    assert_eq!(log[0], (1, LogitsWanted::Last), "{log:?}");

    let im_start = 248045;
    let chat = json!([im_start, 10, 11, 12, im_start, 20, 21]);
    let (_, log) = run(json!({"prompt": chat, "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(log[..2], [(4, LogitsWanted::None), (3, LogitsWanted::Last)], "{log:?}");
    let (v, log) = run(json!({"prompt": chat, "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 4, "{v}");
    assert_eq!(log[..2], [(2, LogitsWanted::None), (1, LogitsWanted::Last)], "{log:?}");
    let (v, _) = run(json!({"prompt": chat, "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 6, "{v}");

    let (_, log) = run(json!({"prompt": [2, 3, 4, 5, 6, 7], "max_tokens": 2, "temperature": 0, "logprobs": 1})).await;
    assert_eq!(log[..2], [(5, LogitsWanted::None), (1, LogitsWanted::Last)], "{log:?}");
}
