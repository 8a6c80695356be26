//! Continuous batching in the server, on the tiny model and the CPU backend: concurrent streams
//! share decode steps (each still gets exactly its solo output, greedy or seeded), a client that
//! hangs up leaves the others untouched, a long prompt is prefilled between the running streams'
//! steps instead of stalling them, a request arriving while one stream decodes alone joins
//! within a step, and `--max-batch` bounds a step.

use serde_json::{json, Value};
use crate::server_support::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A completions body over a prompt of token ids (distinct per `i`).
fn body(i: usize, max_tokens: usize, sampled: bool) -> Value {
    let prompt: Vec<u32> = (0..6 + i % 5).map(|j| (1000 + 37 * i + 11 * j) as u32).collect();
    let mut b = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true});
    if sampled {
        b["temperature"] = json!(0.9);
        b["top_p"] = json!(0.9);
        b["presence_penalty"] = json!(0.5);
        b["seed"] = json!(100 + i);
    }
    b
}

/// One streamed completion as the client saw it.
#[derive(Debug, Default, Clone)]
struct Stream {
    text: String,
    /// Arrival time of each chunk that carried text.
    chunks: Vec<Instant>,
    finish: Option<String>,
    /// Arrival time of the chunk that carried the finish reason.
    ended: Option<Instant>,
}

/// Streams a completion, hanging up after `hang_up_after` text chunks when given.
async fn stream(url: &str, body: Value, hang_up_after: Option<usize>) -> Stream {
    let mut r = client().post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut out = Stream::default();
    let mut buf = String::new();
    while let Some(bytes) = r.chunk().await.unwrap() {
        buf.push_str(std::str::from_utf8(&bytes).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            let c = &v["choices"][0];
            if let Some(t) = c["text"].as_str().filter(|t| !t.is_empty()) {
                out.text.push_str(t);
                out.chunks.push(Instant::now());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                out.finish = Some(f.to_string());
                out.ended = Some(Instant::now());
            }
        }
        if hang_up_after.is_some_and(|n| out.chunks.len() >= n) {
            return out;
        }
    }
    out
}

async fn stream_owned(url: String, body: Value) -> Stream {
    stream(&url, body, None).await
}

/// Polls /metrics while `running`, keeping the largest `lily_batch_size` seen.
fn watch_batch_size(url: String, running: Arc<AtomicBool>) -> (Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let max = Arc::new(AtomicU64::new(0));
    let m = max.clone();
    let task = tokio::spawn(async move {
        while running.load(Relaxed) {
            let text = client().get(&url).send().await.unwrap().text().await.unwrap();
            let b = text.lines().find_map(|l| l.strip_prefix("lily_batch_size ")).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            m.fetch_max(b as u64, Relaxed);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    (max, task)
}

/// The tiny model without a prefix cache, so solo runs leave nothing the concurrent ones reuse.
/// Each body streamed alone, one after the other, then all of them at once: (solo, together,
/// the largest `lily_batch_size` /metrics showed meanwhile).
async fn solo_then_together(s: &lily::server::ServerHandle, url: &str, bodies: &[Value]) -> (Vec<Stream>, Vec<Stream>, u64) {
    let mut solo = Vec::new();
    for b in bodies {
        solo.push(stream(url, b.clone(), None).await);
    }
    let running = Arc::new(AtomicBool::new(true));
    let (max_batch, watcher) = watch_batch_size(format!("{}/metrics", s.url()), running.clone());
    let tasks: Vec<_> = bodies.iter().map(|b| tokio::spawn(stream_owned(url.to_string(), b.clone()))).collect();
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.unwrap());
    }
    running.store(false, Relaxed);
    watcher.await.unwrap();
    (solo, together, max_batch.load(Relaxed))
}

fn uncached_args() -> lily::server::ServeArgs {
    let mut a = args();
    a.prefix_cache_mb = Some(0);
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_interleave_and_each_gets_its_solo_output() {
    let s = spawn(uncached_args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    // 8 greedy streams and 2 seeded sampled ones (with a penalty).
    let cases: Vec<Value> = (0..8).map(|i| body(i, 40, false)).chain([body(8, 40, true), body(9, 40, true)]).collect();
    let (solo, together, max_batch) = solo_then_together(&s, &url, &cases).await;
    for (k, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert!(!a.text.is_empty(), "case {k} produced text");
        assert_eq!(a.text, b.text, "case {k}: the batched stream differs from its solo run");
        assert_eq!(a.finish, b.finish, "case {k}");
    }
    // Interleaved in time: every stream had its first text before any other stream ended.
    for (i, a) in together.iter().enumerate() {
        for (j, b) in together.iter().enumerate() {
            if i != j {
                assert!(a.chunks[0] < *b.chunks.last().unwrap(), "stream {i} started only after stream {j} ended");
            }
        }
    }
    assert!(max_batch >= 2, "/metrics never showed a batch of two or more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_with_its_last_token_not_with_the_decode_call() {
    // A short request joins a long one's decode; a decode call runs up to 64 steps, and the short
    // one's last token comes at its third: its stream ends then, a few of the long one's tokens
    // later, not when the call returns.
    let s = spawn(uncached_args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let (mut long, mut short) = (body(1, 96, false), body(0, 3, false));
    long["ignore_eos"] = json!(true);
    short["ignore_eos"] = json!(true);
    let (r, mut first) = (client().post(&url).json(&long).send().await.unwrap(), None);
    assert_eq!(r.status(), 200);
    let mut r = r;
    // The long stream decodes before the short request is sent.
    while first.is_none() {
        let bytes = r.chunk().await.unwrap().unwrap();
        if std::str::from_utf8(&bytes).unwrap().contains("\"text\"") {
            first = Some(Instant::now());
        }
    }
    let reader = tokio::spawn(async move {
        let mut at = Vec::new();
        while let Some(bytes) = r.chunk().await.unwrap() {
            let n = std::str::from_utf8(&bytes).unwrap().matches("\"text\"").count();
            at.extend(std::iter::repeat_n(Instant::now(), n));
        }
        at
    });
    let a = stream(&url, short, None).await;
    let long_chunks = reader.await.unwrap();
    let (started, ended) = (a.chunks[0], a.ended.expect("the short stream ended"));
    assert_eq!(a.finish.as_deref(), Some("length"));
    let between = long_chunks.iter().filter(|&&t| t > started && t <= ended).count();
    assert!(long_chunks.len() > 40, "the long stream ran past the short one ({} chunks)", long_chunks.len());
    assert!(between < 8, "{between} of the long stream's chunks came between the short one's first token and its end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_running_alone_lets_a_newcomer_in_within_a_step() {
    // A stream decoding alone runs the single-sequence loop up to 64 steps per call; a request
    // that arrives meanwhile joins after the step under way, not after the call. Every forward
    // is logged (its end, and whether it was a decode step: the prefill's want no logits), and a
    // decode step takes 25 ms, so the HTTP path's latency is under a step or two even on a busy
    // machine (the old behaviour took 13 more steps here).
    use lily::backend::LogitsWanted;
    use std::sync::Mutex;
    let log = Arc::new(Mutex::new(Vec::<(Instant, bool)>::new()));
    let l = log.clone();
    let s = around_server(move |b: &mut dyn lily::backend::Backend, seq: &mut lily::backend::Sequence, tokens: &[u32], w| {
        let step = w == LogitsWanted::Last;
        if step {
            std::thread::sleep(Duration::from_millis(25));
        }
        let out = b.forward(seq, tokens, w);
        l.lock().unwrap().push((Instant::now(), step));
        out
    });
    let url = format!("{}/v1/completions", s.url());
    let mut long = body(1, 48, false);
    long["ignore_eos"] = json!(true);
    let mut r = client().post(&url).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // Its third token is out: the newcomer arrives early in the long stream's first decode call.
    let mut seen = 0;
    while seen < 3 {
        let bytes = r.chunk().await.unwrap().expect("the long stream goes on");
        seen += std::str::from_utf8(&bytes).unwrap().matches("\"text\"").count();
    }
    let sent = Instant::now();
    let reader = tokio::spawn(async move { while r.chunk().await.unwrap().is_some() {} });
    let short = stream(&url, body(0, 2, false), None).await;
    reader.await.unwrap();
    assert_eq!(short.finish.as_deref(), Some("length"));
    let log = log.lock().unwrap();
    // The long stream's steps after the newcomer was sent and before its prompt went in.
    let steps = log.iter().skip_while(|(t, _)| *t < sent).take_while(|(_, step)| *step).count();
    assert!(log.iter().any(|(t, step)| *t > sent && !step), "the newcomer's prompt was prefilled");
    assert!(steps <= 4, "the long stream took {steps} steps after the newcomer arrived before its prefill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_streams_batch_with_the_others_and_keep_their_solo_output() {
    let s = spawn(uncached_args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    // Two greedy and two seeded sampled json_object streams among two plain ones: the JSON
    // rows step in the batch (their grammar masks their draws) and must come out as alone.
    let json_body = |i: usize, sampled: bool| {
        let mut b = body(i, 24, sampled);
        b["response_format"] = json!({"type": "json_object"});
        b
    };
    let cases = [json_body(0, false), json_body(1, true), body(2, 24, false), json_body(3, false), json_body(4, true), body(5, 24, true)];
    let (solo, together, max_batch) = solo_then_together(&s, &url, &cases).await;
    for (k, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(a.text, b.text, "case {k}: the batched stream differs from its solo run");
        assert_eq!(a.finish, b.finish, "case {k}");
        if cases[k].get("response_format").is_some() {
            assert!(a.text.trim_start().starts_with('{'), "case {k}: {:?} is not a JSON object's start", a.text);
        }
    }
    assert!(max_batch >= 2, "/metrics never showed a batch of two or more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_leaves_the_others_untouched() {
    let s = spawn(uncached_args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let mut solo = Vec::new();
    for i in 0..4 {
        solo.push(stream(&url, body(i, 32, i == 3), None).await);
    }
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { stream(&url, body(i, 32, i == 3), (i == 1).then_some(3)).await })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    for i in [0, 2, 3] {
        assert_eq!(got[i].text, solo[i].text, "stream {i}");
        assert!(got[i].finish.is_some(), "stream {i} finished");
    }
    assert!(got[1].finish.is_none(), "stream 1 hung up");
    let t0 = Instant::now();
    while s.metrics.cancelled.load(Relaxed) < 1 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the hang-up was not noticed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_between_the_running_streams_steps() {
    let mut a = uncached_args();
    a.prefill_chunk = 32;
    let s = spawn(a).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let streams: Vec<_> = (0..3).map(|i| tokio::spawn(stream_owned(url.clone(), body(i, 120, false)))).collect();
    // Once the streams run, a prompt of 600 tokens arrives: 19 turns of 32 tokens.
    while s.metrics.ttft.count() < 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let long: Vec<u32> = (0..600).map(|j| 2000 + (j * 7) % 500).collect();
    let sent = Instant::now();
    let first = stream(&url, json!({"prompt": long, "max_tokens": 1, "temperature": 0, "stream": true}), None).await;
    let first_token = *first.chunks.first().expect("the long prompt's token");
    let (mut during, mut after) = (0, 0);
    for t in streams {
        let st = t.await.unwrap();
        during += st.chunks.iter().filter(|&&c| c > sent && c < first_token).count();
        after += st.chunks.iter().filter(|&&c| c > first_token).count();
    }
    // The streams kept decoding while the long prompt was prefilled (one step per 32-token
    // chunk), instead of waiting for all of it; and the long prompt did not wait for them to end.
    assert!(during >= 10, "only {during} tokens reached the running streams during the long prefill");
    assert!(after > 0, "the long prompt was served only after the running streams ended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_batch_bounds_the_decode_step_and_the_rest_wait_their_turn() {
    let mut a = uncached_args();
    a.max_batch = Some(2);
    // The per-turn trace's accounting runs beside the scheduler (its lines go to stderr).
    a.trace_turns = true;
    let s = spawn(a).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let running = Arc::new(AtomicBool::new(true));
    let (max_batch, watcher) = watch_batch_size(format!("{}/metrics", s.url()), running.clone());
    let tasks: Vec<_> = (0..5).map(|i| tokio::spawn(stream_owned(url.clone(), body(i, 16, false)))).collect();
    for t in tasks {
        assert!(t.await.unwrap().finish.is_some());
    }
    running.store(false, Relaxed);
    watcher.await.unwrap();
    let seen = max_batch.load(Relaxed);
    assert!((1..=2).contains(&seen), "batch of {seen} with --max-batch 2");
    let metrics = client().get(format!("{}/metrics", s.url())).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("lily_max_batch 2"), "{metrics}");
    // The worker's time went to prefill and decode (and is counted per phase).
    let worker_us = |phase: &str| metrics.lines().find_map(|l| l.strip_prefix(&format!("lily_worker_microseconds_total{{phase=\"{phase}\"}} "))).and_then(|v| v.parse::<u64>().ok());
    assert!(worker_us("prefill").is_some_and(|us| us > 0) && worker_us("decode").is_some_and(|us| us > 0), "{metrics}");
    assert!(["idle", "admit", "snapshot", "retire"].iter().all(|p| worker_us(p).is_some()), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_full_batch_starts_when_a_row_ends_not_with_the_call() {
    // --max-batch 2: a long stream and a short one decode together while a third request waits.
    // The short one ends at its third token; the decode call under way (up to 64 steps) ends
    // then too, so the third starts within a step or two of the long one's, not after the call
    // (which would outlast the long stream's 60 tokens). A decode step sleeps 20 ms per row, so
    // the HTTP path's latency is small beside it.
    use lily::backend::LogitsWanted;
    let mut a = uncached_args();
    a.max_batch = Some(2);
    let s = around_server_with(a, move |b: &mut dyn lily::backend::Backend, seq: &mut lily::backend::Sequence, tokens: &[u32], w| {
        if w == LogitsWanted::Last {
            std::thread::sleep(Duration::from_millis(20));
        }
        b.forward(seq, tokens, w)
    });
    let url = format!("{}/v1/completions", s.url());
    let (mut long, mut short) = (body(1, 60, false), body(0, 3, false));
    long["ignore_eos"] = json!(true);
    short["ignore_eos"] = json!(true);
    let mut r = client().post(&url).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut seen = 0;
    while seen < 2 {
        let bytes = r.chunk().await.unwrap().expect("the long stream goes on");
        seen += std::str::from_utf8(&bytes).unwrap().matches("\"text\"").count();
    }
    let reader = tokio::spawn(async move {
        let mut at = Vec::new();
        while let Some(bytes) = r.chunk().await.unwrap() {
            let n = std::str::from_utf8(&bytes).unwrap().matches("\"text\"").count();
            at.extend(std::iter::repeat_n(Instant::now(), n));
        }
        at
    });
    let short = tokio::spawn(stream_owned(url.clone(), short));
    // The short request is in the batch before the third one queues.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = body(2, 2, false);
    third["ignore_eos"] = json!(true);
    let third = stream(&url, third, None).await;
    let (short, long_chunks) = (short.await.unwrap(), reader.await.unwrap());
    assert_eq!((short.finish.as_deref(), third.finish.as_deref()), (Some("length"), Some("length")));
    let short_end = short.ended.expect("the short stream ended");
    let between = long_chunks.iter().filter(|&&t| t > short_end && t < third.chunks[0]).count();
    let after = long_chunks.iter().filter(|&&t| t > third.chunks[0]).count();
    assert!(between <= 4, "the long stream took {between} steps between the short one's end and the third's first token");
    assert!(after >= 30, "the third request started near the long stream's end ({after} of its tokens after)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_a_prefill_and_several_prompts_get_theirs() {
    // Two prompts x three choices: choice i answers prompt i / 3; seeded choices differ from each
    // other, each choice is reproducible, and the prompt is counted once per prompt.
    let s = spawn(uncached_args()).unwrap();
    let url = format!("{}/v1/completions", s.url());
    let body = json!({"prompt": ["Once upon a time", [1000, 1001, 1002]], "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 7});
    let r = client().post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
    let texts: Vec<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert!(texts[0] != texts[1] && texts[1] != texts[2], "{texts:?}");
    let first = client().post(&url).json(&json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7})).send().await.unwrap().json::<Value>().await.unwrap();
    let second = client().post(&url).json(&json!({"prompt": [1000, 1001, 1002], "max_tokens": 12, "temperature": 1.0, "seed": 7})).send().await.unwrap().json::<Value>().await.unwrap();
    // Choice 0 of each prompt is what the request alone gives (its seed).
    assert_eq!(texts[0], first["choices"][0]["text"]);
    assert_eq!(texts[3], second["choices"][0]["text"]);
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap() + second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
    // Streamed: every choice index gets its text and its own finish, then one usage chunk.
    let mut b = body.clone();
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let events = sse_events(client().post(&url).json(&b).send().await.unwrap()).await;
    let mut streamed = vec![String::new(); 6];
    let mut finished = vec![false; 6];
    let mut usage = Value::Null;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            let i = c["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(c["text"].as_str().unwrap_or(""));
            finished[i] |= c["finish_reason"].is_string();
        } else {
            usage = v["usage"].clone();
        }
    }
    assert_eq!(streamed, texts, "the stream's choices are the non-streamed ones");
    assert!(finished.iter().all(|&f| f));
    assert_eq!(usage["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_refuses_new_requests_and_finishes_running_ones() {
    // As on SIGTERM: /health turns 503 "draining" (a gateway stops routing here), new requests
    // get 503, and the stream already running ends normally with all its tokens.
    let s = spawn(uncached_args()).unwrap();
    let base = s.url();
    let url = format!("{base}/v1/completions");
    let running = tokio::spawn(stream_owned(url.clone(), body(0, 80, false)));
    while s.metrics.ttft.count() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The gateway's load figure: the running request and the tokens its sequence holds (the
    // worker publishes them between its turns: after the first 16 steps, which can take seconds
    // on a loaded 2-core CI machine while the suite's other tests run).
    let mut load = Value::Null;
    for _ in 0..2000 {
        load = client().get(format!("{base}/get_load")).send().await.unwrap().json().await.unwrap();
        if load[0]["num_tokens"].as_u64().unwrap() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(load[0]["num_reqs"], 1, "{load}");
    assert!(load[0]["num_tokens"].as_u64().unwrap() > 0, "{load}");
    let metrics = s.metrics.clone();
    let stopping = tokio::task::spawn_blocking(move || s.drain_and_shutdown());
    while !metrics.draining.load(Relaxed) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let h = client().get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(h.status(), 503);
    assert_eq!(h.json::<Value>().await.unwrap()["status"], "draining");
    let r = client().post(&url).json(&body(1, 4, false)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let done = running.await.unwrap();
    assert_eq!(done.finish.as_deref(), Some("length"), "the running stream ended normally");
    stopping.await.unwrap();
    assert!(client().get(format!("{base}/health")).send().await.is_err(), "the server is gone");
}
