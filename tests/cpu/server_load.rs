//! Bounded load test on loopback: 200 concurrent streaming clients against the tiny model,
//! a third hanging up at once and a third after the first chunk. Checks: zero 5xx, every
//! client that stayed got a complete stream, the server drains its queue and keeps serving,
//! and memory returns near the baseline. Bounded to 60 s.

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use crate::server_support::*;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const CLIENTS: usize = 200;

#[derive(Debug, Default)]
struct Outcome {
    status: u16,
    done: bool,
    finished: bool,
    hung_up: bool,
}

/// Runs in a process of its own ([`crate::alone`]): the memory check reads the process's RSS,
/// which the other tests of this binary would move.
#[test]
fn two_hundred_streaming_clients_with_disconnects() {
    let name = format!("{}::two_hundred_streaming_clients_with_disconnects", module_path!().split_once("::").unwrap().1);
    crate::alone(&name, || tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(load()));
}

async fn load() {
    let mut a = args();
    a.max_queue = 512;
    a.prefix_cache_mb = Some(8);
    let s = spawn(a).unwrap();
    let url = format!("{}/v1/chat/completions", s.url());
    let c = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();

    // Warm up (allocator pools, caches), then take the baseline.
    for i in 0..10 {
        let r = c.post(&url).json(&json!({"messages": user(&format!("warm up {i}")), "max_tokens": 6, "stream": true})).send().await.unwrap();
        let _ = r.text().await.unwrap();
    }
    let baseline = rss_bytes();
    let t0 = Instant::now();

    let mut rng = rand::rngs::StdRng::seed_from_u64(1234);
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let mode: u32 = rng.random_range(0..3);
        let words: Vec<String> = (0..rng.random_range(3..12)).map(|_| format!("w{}", rng.random_range(0..1000))).collect();
        let max_tokens = rng.random_range(2..8);
        let c = c.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"messages": user(&format!("client {i}: {}", words.join(" "))), "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}});
            let mut out = Outcome::default();
            let mut r = match c.post(&url).json(&body).send().await {
                Ok(r) => r,
                Err(e) => panic!("request {i} failed to send: {e}"),
            };
            out.status = r.status().as_u16();
            if out.status != 200 {
                return out;
            }
            match mode {
                0 => {
                    out.hung_up = true; // drop right after the headers
                }
                1 => {
                    let _ = r.chunk().await;
                    out.hung_up = true; // drop after the first chunk
                }
                _ => {
                    let text = r.text().await.unwrap_or_default();
                    for ev in text.split("\n\n") {
                        let Some(d) = ev.strip_prefix("data: ") else { continue };
                        if d == "[DONE]" {
                            out.done = true;
                        } else if let Ok(v) = serde_json::from_str::<Value>(d) {
                            assert!(v.get("error").is_none(), "error event: {d}");
                            if v["choices"][0]["finish_reason"].is_string() {
                                out.finished = true;
                            }
                        }
                    }
                }
            }
            out
        }));
    }
    let results = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks)).await.expect("load test exceeded 60 s");
    let elapsed = t0.elapsed();
    let outcomes: Vec<Outcome> = results.into_iter().map(|r| r.unwrap()).collect();

    // The queue drains (cancelled requests are skipped or stopped within a token).
    let t1 = Instant::now();
    while s.metrics.queue_depth.load(Relaxed) > 0 || s.metrics.running.load(Relaxed) > 0 {
        assert!(t1.elapsed() < Duration::from_secs(30), "queue did not drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n5xx = outcomes.iter().filter(|o| o.status >= 500).count();
    let n429 = outcomes.iter().filter(|o| o.status == 429).count();
    let stayed: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 200 && !o.hung_up).collect();
    let complete = stayed.iter().filter(|o| o.done && o.finished).count();
    let hung_up = outcomes.iter().filter(|o| o.hung_up).count();
    assert_eq!(n5xx, 0, "server errors under load");
    assert_eq!(complete, stayed.len(), "incomplete streams among clients that stayed");
    let server_5xx: u64 = s.metrics.requests_by_status().iter().filter(|((_, st), _)| *st >= 500).map(|(_, n)| n).sum();
    assert_eq!(server_5xx, 0);

    // Still serving.
    let r = c.post(&url).json(&json!({"messages": user("after the storm"), "max_tokens": 3})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    drop(c);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss_bytes();
    let growth = after as i64 - baseline as i64;
    eprintln!(
        "load: {CLIENTS} clients in {:.1}s: {} complete streams, {} hung up ({} cancelled by the server), {n429} x 429, {n5xx} x 5xx; \
         completion tokens {}; RSS baseline {:.1} MB, after {:.1} MB (growth {:.1} MB; prefix cache {:.1} MB)",
        elapsed.as_secs_f64(),
        complete,
        hung_up,
        s.metrics.cancelled.load(Relaxed),
        s.metrics.completion_tokens.load(Relaxed),
        baseline as f64 / 1e6,
        after as f64 / 1e6,
        growth as f64 / 1e6,
        s.metrics.cache_bytes.load(Relaxed) as f64 / 1e6,
    );
    assert!(growth < 64 << 20, "RSS grew by {} MB", growth >> 20);
}
