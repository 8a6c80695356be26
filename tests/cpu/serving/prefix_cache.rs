//! The prefix cache on real conversations, through the server on the tiny model: each later turn
//! of a chat with thinking on (the template drops the earlier reasoning), of an agent loop with
//! tool calls and results, and a second conversation over the same document resume from a
//! checkpoint covering at least 95% of what they share with the earlier prompt; and a cached
//! continuation gives exactly the tokens of an uncached one.

use serde_json::{json, Value};
use crate::server_support::*;

async fn post(url: &str, body: Value) -> Value {
    let r = client().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn server(prefix_cache_mb: usize, checkpoint_every: usize) -> lily::server::ServerHandle {
    let mut a = args();
    a.max_seq = 4096;
    a.prefix_cache_mb = Some(prefix_cache_mb);
    a.prefix_checkpoint_tokens = checkpoint_every;
    spawn(a).unwrap()
}

/// The prompt tokens a chat request would be fed.
async fn tokens(s: &lily::server::ServerHandle, body: &Value) -> Vec<u64> {
    let mut t = json!({"messages": body["messages"]});
    if let Some(tools) = body.get("tools") {
        t["tools"] = tools.clone();
    }
    let v = post(&format!("{}/tokenize", s.url()), t).await;
    v["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn shared(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Sends each turn in order; from the second on, its cached tokens must cover at least 95% of
/// the prefix it shares with the turn before. Returns the last reply.
async fn turns(s: &lily::server::ServerHandle, bodies: &[Value]) -> Value {
    let url = format!("{}/v1/chat/completions", s.url());
    let mut prev: Option<Vec<u64>> = None;
    let mut last = Value::Null;
    for (k, body) in bodies.iter().enumerate() {
        let toks = tokens(s, body).await;
        let v = post(&url, body.clone()).await;
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
        assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, toks.len());
        if let Some(p) = &prev {
            let common = shared(p, &toks);
            assert!(cached * 100 >= common * 95, "turn {k}: {cached} cached of {common} shared tokens");
            assert!(cached <= toks.len() - 1);
        }
        prev = Some(toks);
        last = v;
    }
    last
}

fn system() -> String {
    let words: Vec<String> = (0..150).map(|i| format!("rule{i}")).collect();
    format!("You are a careful assistant. Follow these rules: {}.", words.join(", "))
}

/// A five-turn chat with thinking on (the server default): the model reasons each turn, the
/// client sends back only the answers, and the template renders history without reasoning.
fn chat_turns() -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": system()})];
    let mut bodies = Vec::new();
    for k in 0..5 {
        messages.push(json!({"role": "user", "content": format!("Question number {k}: what next?")}));
        bodies.push(json!({"messages": messages.clone(), "max_tokens": 6, "temperature": 0}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {k}.")}));
    }
    bodies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_chat_turns_resume_from_the_conversation_so_far_and_match_uncached_output() {
    let cached = server(256, 2048);
    let last = turns(&cached, &chat_turns()).await;
    // The same last turn on a server without a cache: the same tokens.
    let plain = server(0, 2048);
    let v = post(&format!("{}/v1/chat/completions", plain.url()), chat_turns()[4].clone()).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(v["choices"][0]["message"], last["choices"][0]["message"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_loop_with_tool_calls_and_results_resumes_each_step() {
    let s = server(256, 2048);
    let tools = json!([{"type": "function", "function": {"name": "search", "description": "Search the docs", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]);
    let mut messages = vec![json!({"role": "system", "content": system()}), json!({"role": "user", "content": "Find the install steps."})];
    let mut bodies = Vec::new();
    for k in 0..4 {
        bodies.push(json!({"messages": messages.clone(), "tools": tools, "max_tokens": 6, "temperature": 0}));
        let id = format!("call_{k}");
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [{"id": id, "type": "function", "function": {"name": "search", "arguments": format!("{{\"q\": \"step {k}\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("Result {k}: run the installer with flag {k}.")}));
    }
    turns(&s, &bodies).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_sharing_a_document_resume_from_it() {
    let doc: Vec<String> = (0..300).map(|i| format!("fact{i}")).collect();
    let doc = doc.join(" ");
    // The document in the system message: the second conversation resumes at the message
    // boundary after it.
    let s = server(256, 2048);
    let ask = |q: &str| json!({"messages": [{"role": "system", "content": format!("Document: {doc}")}, {"role": "user", "content": q}], "max_tokens": 4, "temperature": 0});
    turns(&s, &[ask("What is fact 7?"), ask("Summarize it.")]).await;
    // Document and question in one message: checkpoints every 64 tokens bring the resume point
    // within 64 tokens of where the prompts diverge.
    let s = server(256, 64);
    let ask = |q: &str| json!({"messages": [{"role": "user", "content": format!("Document: {doc}\n\nQuestion: {q}")}], "max_tokens": 4, "temperature": 0});
    let (a, b) = (ask("What is fact 7?"), ask("Summarize it."));
    let common = shared(&tokens(&s, &a).await, &tokens(&s, &b).await);
    post(&format!("{}/v1/chat/completions", s.url()), a).await;
    let v = post(&format!("{}/v1/chat/completions", s.url()), b).await;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
    assert!(cached <= common && cached + 64 > common, "{cached} cached, {common} shared");
}

/// The value of an unlabelled metric in a Prometheus text page.
fn metric(page: &str, name: &str) -> f64 {
    page.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' '))).and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("{name} not in {page}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_in_the_host_tier_serve_later_turns_exactly() {
    // No device budget: every snapshot goes to the host tier, and every later turn resumes from
    // a copy brought back from it.
    let mut a = args();
    a.max_seq = 4096;
    a.prefix_cache_mb = Some(0);
    a.prefix_cache_host_mb = Some(256);
    let s = spawn(a).unwrap();
    let last = turns(&s, &chat_turns()).await;
    let plain = server(0, 2048);
    let v = post(&format!("{}/v1/chat/completions", plain.url()), chat_turns()[4].clone()).await;
    assert_eq!(v["choices"][0]["message"], last["choices"][0]["message"]);
    let page = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric(&page, "lily_prefix_cache_host_hits_total"), 4.0, "turns 2 to 5 hit the host tier");
    assert_eq!(metric(&page, "lily_prefix_cache_bytes"), 0.0);
    let (host, spills) = (metric(&page, "lily_prefix_cache_host_bytes"), metric(&page, "lily_prefix_cache_spills_total"));
    assert!(host > 0.0 && host <= (256 << 20) as f64 && spills >= 4.0, "host bytes {host}, spills {spills}");
}
