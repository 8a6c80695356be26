//! Server metrics and the recent-request log shared with the dashboard. The serving path counts
//! in plain atomics; a scrape copies them into a [`Scrape`], which prometheus-client encodes in
//! the Prometheus text format.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// A histogram of seconds (prometheus-client's, which the scrape encodes) and its sample count.
pub struct Histogram {
    inner: prometheus_client::metrics::histogram::Histogram,
    count: AtomicU64,
}

pub const TTFT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
pub const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { inner: prometheus_client::metrics::histogram::Histogram::new(bounds.iter().copied()), count: AtomicU64::new(0) }
    }
    pub fn observe(&self, secs: f64) {
        self.inner.observe(secs);
        self.count.fetch_add(1, Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
}

/// One scrape's values, in the order they are rendered.
#[derive(Debug)]
struct Scrape(Vec<Item>);

#[derive(Debug)]
enum Item {
    /// `lily_info{model, version} 1`.
    Info(Vec<(String, String)>),
    /// A counter: its name without `_total`, which the encoder appends.
    Counter(&'static str, &'static str, u64),
    /// A counter with labels, one value per label set.
    Counters(&'static str, &'static str, Vec<(Vec<(String, String)>, u64)>),
    Gauge(&'static str, &'static str, f64),
    Histogram(&'static str, &'static str, prometheus_client::metrics::histogram::Histogram),
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for item in &self.0 {
            match item {
                Item::Info(labels) => enc.encode_descriptor("lily", "Server information.", None, MetricType::Info)?.encode_info(labels)?,
                Item::Counter(name, help, v) => enc.encode_descriptor(name, help, None, MetricType::Counter)?.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(v, None)?,
                Item::Counters(name, help, values) => {
                    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
                    for (labels, v) in values {
                        m.encode_family(labels)?.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(v, None)?;
                    }
                }
                Item::Gauge(name, help, v) => enc.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_gauge(v)?,
                Item::Histogram(name, help, h) => h.encode(enc.encode_descriptor(name, help, None, MetricType::Histogram)?)?,
            }
        }
        Ok(())
    }
}

/// One finished request, for the log line and the dashboard.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub method: &'static str,
    pub path: &'static str,
    pub status: u16,
    pub ms: u64,
    pub prompt: usize,
    pub cached: usize,
    pub completion: usize,
    pub tok_s: f64,
    pub finish: String,
    pub error: Option<String>,
    /// Arrival to joining the batch (template and tokenizer, waiting in the queue), and arrival
    /// to the first token: where a request's time to first token went.
    pub queue_ms: Option<u64>,
    pub ttft_ms: Option<u64>,
    /// Within the time to first token: taking the request's sequence (the prefix-cache copy or
    /// restore from the host tier, the memory reservation), and prefilling the prompt up to its
    /// last token (the rest is the first decode step).
    pub resume_ms: Option<u64>,
    pub prefill_ms: Option<u64>,
}

impl RequestRecord {
    pub fn log_line(&self) -> String {
        let mut s = format!("{} {} {} {}ms", self.method, self.path, self.status, self.ms);
        if self.status < 400 {
            let _ = write!(s, " prompt={} cached={} completion={} tok/s={:.1} finish={}", self.prompt, self.cached, self.completion, self.tok_s, self.finish);
            if let (Some(q), Some(t)) = (self.queue_ms, self.ttft_ms) {
                let _ = write!(s, " queue={q}ms");
                if let (Some(r), Some(p)) = (self.resume_ms, self.prefill_ms) {
                    let _ = write!(s, " resume={r}ms prefill={p}ms");
                }
                let _ = write!(s, " ttft={t}ms");
            }
        }
        if let Some(e) = &self.error {
            let _ = write!(s, " error={e:?}");
        }
        s
    }
}

pub struct Metrics {
    pub started: Instant,
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cancelled: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Arrival to joining the batch, and joining the batch to the first token: the two parts of
    /// the time to first token.
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub queue_depth: AtomicI64,
    pub running: AtomicI64,
    pub cache_lookups: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    /// The prefix cache's host tier: bytes and entries there, hits served from it, entries moved
    /// to it.
    pub cache_host_bytes: AtomicU64,
    pub cache_host_entries: AtomicU64,
    pub cache_host_hits: AtomicU64,
    pub cache_spills: AtomicU64,
    pub cache_spill_ms: AtomicU64,
    /// Memory of the sequences being prefilled or generated (KV + recurrent state).
    pub active_seq_bytes: AtomicU64,
    /// Sequences in the last decode step, and the most one step takes (`--max-batch`).
    pub batch_size: AtomicU64,
    pub max_batch: AtomicU64,
    /// Tokens generated so far (as they are sent; `completion_tokens` counts finished requests).
    pub generated_tokens: AtomicU64,
    /// Generated tokens per second over the last [`RATE_WINDOW_SECS`], by whole seconds.
    rate: Mutex<VecDeque<(u64, u64)>>,
    /// The backend's sequence memory budget and what sequences and snapshots hold of it
    /// (0 for backends without one).
    pub seq_memory_budget_bytes: AtomicU64,
    pub seq_memory_used_bytes: AtomicU64,
    pub recent: Mutex<VecDeque<RequestRecord>>,
    /// Print a log line per request (off while the dashboard owns the terminal).
    pub log_lines: std::sync::atomic::AtomicBool,
    /// Shutting down: new requests get 503, running ones finish.
    pub draining: std::sync::atomic::AtomicBool,
    /// Tokens held by the running requests' sequences (the gateway's load figure).
    pub active_tokens: AtomicU64,
    /// The model worker's time by what it was doing, in microseconds ([`WorkerPhase`]).
    worker_us: [AtomicU64; WorkerPhase::ALL.len()],
    /// The start of the worker's wait for a request under way, counted as idle time while it
    /// lasts (a wait can last minutes; added only at its end, the counter would jump then).
    /// Its lock also covers adding an ended wait to the idle count, so a reading sees each wait
    /// once.
    waiting_since: Mutex<Option<Instant>>,
}

/// What the model worker spends its time on, one turn of its loop after another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerPhase {
    /// Waiting for a request with nothing to run.
    Idle,
    /// Starting queued requests: the prefix-cache lookup and copy, the memory reservation, and
    /// the snapshots evicted or spilled to the host tier to make room.
    Admit,
    /// Prefill rounds (their checkpoints' snapshots apart).
    Prefill,
    /// Copying prefilled sequences into the prefix cache at their checkpoints (within a prefill
    /// turn).
    Snapshot,
    /// Decode steps, with the host's work on their tokens.
    Decode,
    /// Ending finished requests: final events and keeping their sequences in the prefix cache.
    Retire,
}

impl WorkerPhase {
    pub const ALL: [WorkerPhase; 6] = [WorkerPhase::Idle, WorkerPhase::Admit, WorkerPhase::Prefill, WorkerPhase::Snapshot, WorkerPhase::Decode, WorkerPhase::Retire];

    fn label(self) -> &'static str {
        match self {
            WorkerPhase::Idle => "idle",
            WorkerPhase::Admit => "admit",
            WorkerPhase::Prefill => "prefill",
            WorkerPhase::Snapshot => "snapshot",
            WorkerPhase::Decode => "decode",
            WorkerPhase::Retire => "retire",
        }
    }
}

pub const RECENT: usize = 50;

/// Seconds the generation rate is averaged over.
pub const RATE_WINDOW_SECS: u64 = 10;

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            started: Instant::now(),
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            queue_time: Histogram::new(TTFT_BUCKETS),
            prefill_time: Histogram::new(TTFT_BUCKETS),
            queue_depth: AtomicI64::new(0),
            running: AtomicI64::new(0),
            cache_lookups: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
            cache_entries: AtomicU64::new(0),
            cache_host_bytes: AtomicU64::new(0),
            cache_host_entries: AtomicU64::new(0),
            cache_host_hits: AtomicU64::new(0),
            cache_spills: AtomicU64::new(0),
            cache_spill_ms: AtomicU64::new(0),
            active_seq_bytes: AtomicU64::new(0),
            batch_size: AtomicU64::new(0),
            max_batch: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            rate: Mutex::new(VecDeque::new()),
            seq_memory_budget_bytes: AtomicU64::new(0),
            seq_memory_used_bytes: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::new()),
            log_lines: std::sync::atomic::AtomicBool::new(true),
            draining: std::sync::atomic::AtomicBool::new(false),
            active_tokens: AtomicU64::new(0),
            worker_us: Default::default(),
            waiting_since: Mutex::new(None),
        }
    }

    /// Adds the time since `since` to the worker's `phase`; returns now (the next phase's start).
    pub fn worker_spent(&self, phase: WorkerPhase, since: Instant) -> Instant {
        let now = Instant::now();
        self.worker_us[phase as usize].fetch_add(now.duration_since(since).as_micros() as u64, Relaxed);
        now
    }

    /// As [`Metrics::worker_spent`], with `part` of the time (at most all of it) counted in its
    /// own phase instead: a phase measured inside another.
    pub fn worker_spent_with_part(&self, phase: WorkerPhase, part: (WorkerPhase, std::time::Duration), since: Instant) -> Instant {
        let now = Instant::now();
        let total = now.duration_since(since).as_micros() as u64;
        let inner = (part.1.as_micros() as u64).min(total);
        self.worker_us[part.0 as usize].fetch_add(inner, Relaxed);
        self.worker_us[phase as usize].fetch_add(total - inner, Relaxed);
        now
    }

    /// The worker waits for a request from `since` (its last phase's end) until
    /// [`Metrics::worker_wait_ended`]; the wait counts as idle time while it lasts.
    pub fn worker_waits(&self, since: Instant) {
        *self.waiting_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(since);
    }

    /// The wait [`Metrics::worker_waits`] began ends now; returns now (the next phase's start).
    pub fn worker_wait_ended(&self) -> Instant {
        let mut waiting = self.waiting_since.lock().unwrap_or_else(|e| e.into_inner());
        match waiting.take() {
            Some(since) => self.worker_spent(WorkerPhase::Idle, since),
            None => Instant::now(),
        }
    }

    /// The worker's time in `phase` so far, in microseconds.
    fn worker_micros(&self, phase: WorkerPhase) -> u64 {
        match phase {
            WorkerPhase::Idle => {
                let waiting = self.waiting_since.lock().unwrap_or_else(|e| e.into_inner());
                self.worker_us[phase as usize].load(Relaxed) + waiting.map_or(0, |s| s.elapsed().as_micros() as u64)
            }
            _ => self.worker_us[phase as usize].load(Relaxed),
        }
    }

    pub fn count_request(&self, endpoint: &'static str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint, status)).or_insert(0) += 1;
    }

    pub fn requests_by_status(&self) -> BTreeMap<(&'static str, u16), u64> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Counts `n` generated tokens now (for the generation rate).
    pub fn generated(&self, n: u64) {
        self.generated_tokens.fetch_add(n, Relaxed);
        let sec = self.started.elapsed().as_secs();
        let mut q = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        match q.back_mut() {
            Some((s, c)) if *s == sec => *c += n,
            _ => q.push_back((sec, n)),
        }
        while q.front().is_some_and(|&(s, _)| s + RATE_WINDOW_SECS <= sec) {
            q.pop_front();
        }
    }

    /// Generated tokens per second over the last [`RATE_WINDOW_SECS`] (fewer right after start).
    pub fn generation_rate(&self) -> f64 {
        let now = self.started.elapsed().as_secs_f64();
        let sec = now as u64;
        let q = self.rate.lock().unwrap_or_else(|e| e.into_inner());
        let n: u64 = q.iter().filter(|&&(s, _)| s + RATE_WINDOW_SECS > sec).map(|&(_, c)| c).sum();
        n as f64 / now.min(RATE_WINDOW_SECS as f64).max(1.0)
    }

    /// Records a finished request: the log line (unless the dashboard is on) and the recent list.
    pub fn record(&self, r: RequestRecord) {
        if self.log_lines.load(Relaxed) {
            eprintln!("{}", r.log_line());
        }
        let mut q = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() == RECENT {
            q.pop_front();
        }
        q.push_back(r);
    }

    /// cached / prompt tokens over all requests.
    pub fn cache_hit_ratio(&self) -> f64 {
        let p = self.prompt_tokens.load(Relaxed);
        if p == 0 {
            0.0
        } else {
            self.cached_tokens.load(Relaxed) as f64 / p as f64
        }
    }

    /// The Prometheus text of every metric now.
    pub fn render(&self, model: &str) -> String {
        use Item::*;
        let requests = self.requests_by_status().into_iter().map(|((ep, st), n)| (vec![("endpoint".to_string(), ep.to_string()), ("status".to_string(), st.to_string())], n)).collect();
        let worker = WorkerPhase::ALL.iter().map(|&p| (vec![("phase".to_string(), p.label().to_string())], self.worker_micros(p))).collect();
        let items = vec![
            Info(vec![("model".into(), model.into()), ("version".into(), env!("CARGO_PKG_VERSION").into())]),
            Gauge("lily_uptime_seconds", "Seconds since start.", (self.started.elapsed().as_secs_f64() * 1e3).round() / 1e3),
            Counters("lily_requests", "HTTP requests by endpoint and status.", requests),
            Counter("lily_prompt_tokens", "Prompt tokens of completed requests (including cached ones).", self.prompt_tokens.load(Relaxed)),
            Counter("lily_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", self.cached_tokens.load(Relaxed)),
            Counter("lily_completion_tokens", "Generated tokens.", self.completion_tokens.load(Relaxed)),
            Counter("lily_requests_cancelled", "Generations cancelled because the client went away.", self.cancelled.load(Relaxed)),
            Histogram("lily_time_to_first_token_seconds", "Time from arrival to the first generated token.", self.ttft.inner.clone()),
            Histogram("lily_inter_token_latency_seconds", "Time between consecutive generated tokens.", self.itl.inner.clone()),
            Histogram("lily_request_queue_time_seconds", "Time from arrival to joining the running batch (template, tokenizer, waiting).", self.queue_time.inner.clone()),
            Histogram("lily_request_prefill_time_seconds", "Time from joining the running batch to the first token (prefix-cache copy, prefill, first step).", self.prefill_time.inner.clone()),
            Gauge("lily_queue_depth", "Requests waiting for the model.", self.queue_depth.load(Relaxed) as f64),
            Gauge("lily_requests_running", "Requests being generated.", self.running.load(std::sync::atomic::Ordering::Acquire) as f64),
            Counter("lily_prefix_cache_lookups", "Prefix-cache lookups.", self.cache_lookups.load(Relaxed)),
            Counter("lily_prefix_cache_hits", "Prefix-cache lookups that reused a cached sequence.", self.cache_hits.load(Relaxed)),
            Gauge("lily_prefix_cache_hit_ratio", "Cached prompt tokens / prompt tokens.", self.cache_hit_ratio()),
            Gauge("lily_prefix_cache_bytes", "Memory held by prefix-cache snapshots in the backend's memory (device tier).", self.cache_bytes.load(Relaxed) as f64),
            Gauge("lily_prefix_cache_entries", "Prefix-cache entries (both tiers).", self.cache_entries.load(Relaxed) as f64),
            Gauge("lily_prefix_cache_host_bytes", "Host memory held by prefix-cache entries moved out of the device (host tier).", self.cache_host_bytes.load(Relaxed) as f64),
            Gauge("lily_prefix_cache_host_entries", "Prefix-cache entries in the host tier.", self.cache_host_entries.load(Relaxed) as f64),
            Counter("lily_prefix_cache_host_hits", "Prefix-cache hits copied back from the host tier.", self.cache_host_hits.load(Relaxed)),
            Counter("lily_prefix_cache_spills", "Prefix-cache entries moved from the device to the host tier.", self.cache_spills.load(Relaxed)),
            Counter("lily_prefix_cache_spill_milliseconds", "Time spent copying prefix-cache entries to the host tier.", self.cache_spill_ms.load(Relaxed)),
            Gauge("lily_batch_size", "Sequences in the last decode step.", self.batch_size.load(Relaxed) as f64),
            Gauge("lily_max_batch", "Most sequences one decode step takes (--max-batch).", self.max_batch.load(Relaxed) as f64),
            Gauge("lily_generation_tokens_per_second", "Generated tokens per second over the last 10 s.", self.generation_rate()),
            Gauge("lily_active_sequence_bytes", "KV + recurrent state memory of the running sequences.", self.active_seq_bytes.load(Relaxed) as f64),
            Gauge("lily_sequence_memory_budget_bytes", "Device memory sequences may hold (KV pages, state slots).", self.seq_memory_budget_bytes.load(Relaxed) as f64),
            Gauge("lily_sequence_memory_used_bytes", "Device memory held by sequences and cached snapshots.", self.seq_memory_used_bytes.load(Relaxed) as f64),
            Counters("lily_worker_microseconds", "The model worker's time by phase (idle, admit, prefill, decode, retire).", worker),
        ];
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape(items)));
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
            let _ = writeln!(out, "# error encoding metrics: {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::new();
        m.count_request("chat", 200);
        m.count_request("chat", 200);
        m.count_request("chat", 400);
        m.ttft.observe(0.02);
        m.prompt_tokens.store(10, Relaxed);
        m.cached_tokens.store(5, Relaxed);
        let t = m.render("m");
        assert!(t.contains("lily_requests_total{endpoint=\"chat\",status=\"200\"} 2"));
        assert!(t.contains("lily_time_to_first_token_seconds_bucket{le=\"0.025\"} 1"));
        assert!(t.contains("lily_time_to_first_token_seconds_bucket{le=\"0.01\"} 0"));
        assert!(t.contains("lily_prefix_cache_hit_ratio 0.5"));
        let t = Instant::now() - std::time::Duration::from_millis(3);
        m.worker_spent(WorkerPhase::Decode, t);
        let decode_us = m.render("m").lines().find_map(|l| l.strip_prefix("lily_worker_microseconds_total{phase=\"decode\"} ")).and_then(|v| v.parse::<u64>().ok());
        assert!(decode_us.is_some_and(|us| us >= 3000), "{decode_us:?}");
        assert!(m.render("m").contains("lily_worker_microseconds_total{phase=\"idle\"} 0"));
        // A phase measured inside another counts in its own, the rest in the outer one; a part
        // longer than the whole is cut to it.
        let us = |m: &Metrics, p: &str| m.render("m").lines().find_map(|l| l.strip_prefix(&format!("lily_worker_microseconds_total{{phase=\"{p}\"}} "))).and_then(|v| v.parse::<u64>().ok()).unwrap();
        let t = Instant::now() - std::time::Duration::from_millis(10);
        m.worker_spent_with_part(WorkerPhase::Prefill, (WorkerPhase::Snapshot, std::time::Duration::from_millis(4)), t);
        let (prefill, snapshot) = (us(&m, "prefill"), us(&m, "snapshot"));
        assert!(snapshot == 4000 && (6000..9000).contains(&prefill), "{prefill} {snapshot}");
        m.worker_spent_with_part(WorkerPhase::Prefill, (WorkerPhase::Snapshot, std::time::Duration::from_secs(60)), Instant::now() - std::time::Duration::from_millis(1));
        assert!(us(&m, "prefill") == prefill && us(&m, "snapshot") < 4000 + 100_000, "{}", us(&m, "snapshot"));
        // A wait under way counts as it goes, and once when it ends.
        let idle_us = |m: &Metrics| m.render("m").lines().find_map(|l| l.strip_prefix("lily_worker_microseconds_total{phase=\"idle\"} ")).and_then(|v| v.parse::<u64>().ok()).unwrap();
        m.worker_waits(Instant::now() - std::time::Duration::from_millis(5));
        let during = idle_us(&m);
        assert!(during >= 5000, "{during}");
        std::thread::sleep(std::time::Duration::from_millis(2));
        m.worker_wait_ended();
        let after = idle_us(&m);
        assert!(after >= during + 2000, "{during} {after}");
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(idle_us(&m), after, "no wait under way");
        m.generated(30);
        m.generated(20);
        assert!(m.render("m").contains("lily_generation_tokens_per_second 50"), "within the first second the rate is per one second");
    }
}
