//! The model worker: one thread owns the backend and runs queued requests one at a time
//! (batch 1, FIFO). Each job carries an event channel; when the HTTP side drops its receiver
//! (client disconnected), the worker notices between prefill chunks or within one token and
//! moves on. A panic inside one job is caught, reported to that client, and the worker keeps
//! serving. Each request reserves its sequence memory (prompt + max_tokens) before it starts,
//! evicting cached snapshots if the budget needs them; one that cannot fit gets 503.

use super::error::ApiError;
use super::metrics::{Metrics, RequestRecord};
use super::output::{Delta, OutputPipeline};
use super::prefix_cache::PrefixCache;
use super::request::{Endpoint, ParsedRequest};
use crate::backend::{is_memory_full, Backend, LogitsWanted, Sequence};
use crate::engine::sampling::log_softmax;
use crate::engine::{generate, FinishReason, Next, Sampler};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Prompt tokens fed per forward call before the last chunk, so cancellation is noticed
/// during long prefills too.
pub const PREFILL_CHUNK: usize = 512;

/// Prompt tokens per forward when every position's logits are wanted (prompt logprobs): 32 rows
/// of the 248K vocabulary are 32 MB.
const PROMPT_LOGPROB_CHUNK: usize = 32;

/// Log-probability of one generated token (with its top alternatives).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Completions with `echo` and `logprobs`: every prompt token's entry (the first has no
    /// logprob: NaN), before any generated token.
    PromptLogprobs(Vec<TokenLogprob>),
    Delta { delta: Delta, logprobs: Vec<TokenLogprob> },
    Done { finish_reason: &'static str, usage: Usage },
    Error(ApiError),
}

/// A validated, tokenized request waiting for the model.
pub struct Job {
    pub req: ParsedRequest,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Chat: whether the rendered prompt left a `<think>` block open.
    pub starts_in_reasoning: bool,
    pub events: mpsc::UnboundedSender<Event>,
    pub arrived: Instant,
    pub path: &'static str,
}

pub struct WorkerConfig {
    pub max_seq: usize,
    pub stop_ids: Vec<u32>,
    pub prefix_cache_bytes: usize,
}

fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

fn logprob_entry(tok: &Tokenizer, logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let (token, bytes) = token_text(tok, id);
    let mut tops = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        for i in idx {
            let (t, b) = token_text(tok, i);
            tops.push((t, b, lp[i as usize].max(-9999.0)));
        }
    }
    TokenLogprob { token, bytes, logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY).max(-9999.0), top: tops }
}

pub struct Worker {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    cfg: WorkerConfig,
    cache: PrefixCache<Sequence>,
}

enum JobEnd {
    Finished { usage: Usage, finish: &'static str, secs: f64 },
    ClientGone { usage: Usage, secs: f64 },
}

impl Worker {
    pub fn new(backend: Box<dyn Backend>, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>, cfg: WorkerConfig) -> Self {
        let cache = PrefixCache::new(cfg.prefix_cache_bytes);
        Worker { backend, tokenizer, metrics, cfg, cache }
    }

    /// Serves jobs until the queue closes.
    pub fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        while let Some(job) = rx.blocking_recv() {
            self.metrics.queue_depth.fetch_sub(1, Relaxed);
            self.serve_one(job);
        }
    }

    /// A client that left before its answer: 499 in `lily_requests_total` for a non-streamed
    /// request (its handler went with the connection; a stream was counted 200 when it began).
    fn count_gone(&self, job: &Job) {
        self.metrics.cancelled.fetch_add(1, Relaxed);
        if !job.req.stream {
            self.metrics.count_request(super::routes::endpoint_label(job.path), 499);
        }
    }

    fn serve_one(&mut self, job: Job) {
        let path = job.path;
        if job.events.is_closed() {
            self.count_gone(&job);
            self.metrics.record(RequestRecord { method: "POST", path, status: 499, ms: job.arrived.elapsed().as_millis() as u64, prompt: job.prompt.len(), cached: 0, completion: 0, tok_s: 0.0, finish: "cancelled".into(), error: Some("client went away while queued".into()) });
            return;
        }
        self.metrics.running.fetch_add(1, Relaxed);
        let events = job.events.clone();
        let arrived = job.arrived;
        let prompt_len = job.prompt.len();
        let result = catch_unwind(AssertUnwindSafe(|| self.run_job(&job)));
        // Memory first, then the running count: a reader that sees the request finished also
        // sees the memory it left behind.
        self.metrics.active_seq_bytes.store(0, Relaxed);
        if let Some(m) = self.backend.sequence_memory() {
            self.metrics.seq_memory_budget_bytes.store(m.budget_bytes, Relaxed);
            self.metrics.seq_memory_used_bytes.store(m.in_use_bytes, Relaxed);
        }
        self.metrics.running.fetch_sub(1, std::sync::atomic::Ordering::Release);
        let ms = arrived.elapsed().as_millis() as u64;
        let rec = |status: u16, usage: &Usage, secs: f64, finish: &str, error: Option<String>| RequestRecord {
            method: "POST",
            path,
            status,
            ms,
            prompt: usage.prompt_tokens,
            cached: usage.cached_tokens,
            completion: usage.completion_tokens,
            tok_s: usage.completion_tokens as f64 / secs.max(1e-3),
            finish: finish.to_string(),
            error,
        };
        match result {
            Ok(Ok(JobEnd::Finished { usage, finish, secs })) => {
                self.metrics.record(rec(200, &usage, secs, finish, None));
            }
            Ok(Ok(JobEnd::ClientGone { usage, secs })) => {
                self.count_gone(&job);
                self.metrics.record(rec(499, &usage, secs, "cancelled", Some("client disconnected".into())));
            }
            Ok(Err(e)) if is_memory_full(&e) => {
                eprintln!("lily: request refused: {e:#}");
                let _ = events.send(Event::Error(ApiError::unavailable(format!("not enough GPU memory for this request ({e}); retry with fewer tokens (prompt + max_tokens) or later"))));
                let u = Usage { prompt_tokens: prompt_len, ..Default::default() };
                self.metrics.record(rec(503, &u, 0.0, "error", Some(format!("{e:#}"))));
            }
            Ok(Err(e)) => {
                eprintln!("lily: request failed: {e:#}");
                let _ = events.send(Event::Error(ApiError::internal()));
                let u = Usage { prompt_tokens: prompt_len, ..Default::default() };
                self.metrics.record(rec(500, &u, 0.0, "error", Some(format!("{e:#}"))));
            }
            Err(panic) => {
                let msg = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into());
                eprintln!("lily: request panicked (the server keeps serving): {msg}");
                let _ = events.send(Event::Error(ApiError::internal()));
                let u = Usage { prompt_tokens: prompt_len, ..Default::default() };
                self.metrics.record(rec(500, &u, 0.0, "error", Some(format!("panic: {msg}"))));
            }
        }
    }

    /// Runs `f`, evicting cached snapshots (least recently used first) while it fails for want of
    /// sequence memory; the error stays when nothing is left to evict.
    fn with_memory<T>(&mut self, mut f: impl FnMut(&mut Self) -> anyhow::Result<T>) -> anyhow::Result<T> {
        loop {
            match f(self) {
                Err(e) if is_memory_full(&e) && self.cache.evict_lru() => {
                    self.metrics.cache_bytes.store(self.cache.memory_bytes() as u64, Relaxed);
                    self.metrics.cache_entries.store(self.cache.len() as u64, Relaxed);
                }
                r => return r,
            }
        }
    }

    /// Feeds all but the last prompt token, `PROMPT_LOGPROB_CHUNK` at a time with every
    /// position's logits, and returns each prompt token's entry: its log-probability after the
    /// tokens before it, with `top` alternatives (the first token has none: NaN). `None` when the
    /// client left meanwhile.
    fn prompt_logprobs(&mut self, seq: &mut Sequence, prompt: &[u32], top: usize, job: &Job) -> anyhow::Result<Option<Vec<TokenLogprob>>> {
        let (token, bytes) = token_text(&self.tokenizer, prompt[0]);
        let mut out = vec![TokenLogprob { token, bytes, logprob: f32::NAN, top: vec![] }];
        let head = &prompt[..prompt.len() - 1];
        for (c, chunk) in head.chunks(PROMPT_LOGPROB_CHUNK).enumerate() {
            if job.events.is_closed() {
                return Ok(None);
            }
            let logits = self.backend.forward(seq, chunk, LogitsWanted::All)?;
            let vocab = logits.len() / chunk.len();
            for (j, row) in logits.chunks(vocab).enumerate() {
                out.push(logprob_entry(&self.tokenizer, row, prompt[c * PROMPT_LOGPROB_CHUNK + j + 1], top));
            }
        }
        Ok(Some(out))
    }

    fn run_job(&mut self, job: &Job) -> anyhow::Result<JobEnd> {
        let t0 = Instant::now();
        let req = &job.req;
        let prompt = &job.prompt;
        self.metrics.cache_lookups.fetch_add(1, Relaxed);
        // Prompt logprobs need every prompt position's logits, which a cached snapshot lacks.
        let prompt_logprobs = req.echo && req.logprobs;
        // A cached snapshot is copied to resume from; if the copy cannot be allocated (device
        // memory), the request just prefills from scratch.
        let found = if prompt_logprobs { None } else { self.cache.lookup(prompt, req.prompt_cache_key.as_deref()) };
        let hit = match found {
            Some((snap, n)) => match snap.try_clone() {
                Ok(seq) => Some((seq, n)),
                Err(e) => {
                    eprintln!("lily: prefix cache hit not used (copying the snapshot failed: {e:#})");
                    None
                }
            },
            None => None,
        };
        let (mut seq, cached) = match hit {
            Some(h) => {
                self.metrics.cache_hits.fetch_add(1, Relaxed);
                h
            }
            None => (self.with_memory(|w| w.backend.new_sequence(w.cfg.max_seq))?, 0),
        };
        // Room for the whole request up front, so it never runs out of memory midway.
        let need = (prompt.len() + job.max_tokens).min(self.cfg.max_seq);
        self.with_memory(|_| seq.reserve(need))?;
        let mut usage = Usage { prompt_tokens: prompt.len(), cached_tokens: cached, ..Default::default() };
        let mut rest = &prompt[cached..];
        if prompt_logprobs {
            match self.prompt_logprobs(&mut seq, prompt, req.top_logprobs, job)? {
                Some(lps) => {
                    let _ = job.events.send(Event::PromptLogprobs(lps));
                }
                None => return Ok(JobEnd::ClientGone { usage, secs: t0.elapsed().as_secs_f64() }),
            }
            rest = &prompt[prompt.len() - 1..];
        }
        // Prefill all but the last chunk without logits, checking for cancellation.
        while rest.len() > PREFILL_CHUNK {
            if job.events.is_closed() {
                return Ok(JobEnd::ClientGone { usage, secs: t0.elapsed().as_secs_f64() });
            }
            let (head, tail) = rest.split_at(PREFILL_CHUNK);
            self.backend.forward(&mut seq, head, LogitsWanted::None)?;
            rest = tail;
        }
        // Snapshot at prompt length - 1 so an exact repeat of this prompt (regenerate, retries,
        // benchmarks) resumes with one token left to feed.
        if rest.len() >= 2 {
            let (head, last) = rest.split_at(rest.len() - 1);
            if job.events.is_closed() {
                return Ok(JobEnd::ClientGone { usage, secs: t0.elapsed().as_secs_f64() });
            }
            self.backend.forward(&mut seq, head, LogitsWanted::None)?;
            // A snapshot that cannot be allocated is simply not cached.
            match seq.try_clone() {
                Ok(snap) => {
                    let bytes = snap.memory_bytes();
                    self.cache.insert(prompt[..prompt.len() - 1].to_vec(), snap, bytes, req.prompt_cache_key.clone());
                }
                Err(e) => eprintln!("lily: prompt not cached (copying the sequence failed: {e:#})"),
            }
            rest = last;
        }
        self.metrics.active_seq_bytes.store(seq.memory_bytes() as u64, Relaxed);

        let chat = req.endpoint == Endpoint::Chat;
        let tools = if req.has_tools() { Some(req.tool_schemas.clone()) } else { None };
        let mut pipeline = OutputPipeline::new(req.stop.clone(), if chat { Some(job.starts_in_reasoning) } else { None }, tools);
        let mut decoder = StreamDecoder::new().skip_special(true);
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut generated: Vec<u32> = Vec::new();
        let mut reasoning_tokens = 0usize;
        let mut stop_hit = false;
        let mut client_gone = false;
        let mut last_tok: Option<Instant> = None;
        let tokenizer = self.tokenizer.clone();
        let metrics = self.metrics.clone();
        let events = job.events.clone();
        let arrived = job.arrived;
        let want_lp = req.logprobs;
        let top_lp = req.top_logprobs;

        let stats = generate(self.backend.as_mut(), &mut seq, rest, job.max_tokens, &mut sampler, &self.cfg.stop_ids, want_lp, |tok, logits| {
            let now = Instant::now();
            match last_tok {
                None => metrics.ttft.observe(now.duration_since(arrived).as_secs_f64()),
                Some(t) => metrics.itl.observe(now.duration_since(t).as_secs_f64()),
            }
            last_tok = Some(now);
            generated.push(tok);
            if pipeline.in_reasoning() {
                reasoning_tokens += 1;
            }
            let text = decoder.push(&tokenizer, tok);
            let (delta, hit) = pipeline.push(&text);
            let logprobs = if want_lp { vec![logprob_entry(&tokenizer, logits, tok, top_lp)] } else { vec![] };
            if !delta.is_empty() || !logprobs.is_empty() {
                if events.send(Event::Delta { delta, logprobs }).is_err() {
                    client_gone = true;
                    return Next::Stop;
                }
            } else if events.is_closed() {
                client_gone = true;
                return Next::Stop;
            }
            if hit {
                stop_hit = true;
                return Next::Stop;
            }
            Next::Continue
        })?;
        let secs = t0.elapsed().as_secs_f64();
        usage.completion_tokens = generated.len() + usize::from(stats.finish == FinishReason::Stop);
        usage.reasoning_tokens = reasoning_tokens;

        // Keep a snapshot of exactly what the sequence consumed.
        let fed = seq.len();
        if fed >= prompt.len() && fed - prompt.len() <= generated.len() {
            let mut tokens = prompt.clone();
            tokens.extend_from_slice(&generated[..fed - prompt.len()]);
            let bytes = seq.memory_bytes();
            self.cache.insert(tokens, seq, bytes, req.prompt_cache_key.clone());
        }
        self.metrics.cache_bytes.store(self.cache.memory_bytes() as u64, Relaxed);
        self.metrics.cache_entries.store(self.cache.len() as u64, Relaxed);

        self.metrics.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
        self.metrics.cached_tokens.fetch_add(usage.cached_tokens as u64, Relaxed);
        self.metrics.completion_tokens.fetch_add(usage.completion_tokens as u64, Relaxed);

        if client_gone {
            return Ok(JobEnd::ClientGone { usage, secs });
        }
        let tail = if stop_hit { Delta::default() } else { pipeline.finish(&decoder.finish()) };
        if !tail.is_empty() {
            let _ = job.events.send(Event::Delta { delta: tail, logprobs: vec![] });
        }
        // "tool_calls" only when every call is whole: a call cut by the end of sequence, a stop
        // string or max_tokens ends as "stop" / "length" with its partial arguments.
        let finish = if pipeline.tool_calls() > 0 && !pipeline.tool_call_cut() && stats.finish != FinishReason::Length {
            "tool_calls"
        } else if stop_hit {
            "stop"
        } else {
            stats.finish.as_openai()
        };
        if job.events.send(Event::Done { finish_reason: finish, usage: usage.clone() }).is_err() {
            return Ok(JobEnd::ClientGone { usage, secs });
        }
        Ok(JobEnd::Finished { usage, finish, secs })
    }
}
