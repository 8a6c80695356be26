//! `lily serve`: an OpenAI-compatible HTTP server (axum + tokio).
//!
//! * Routes: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE streaming),
//!   `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//! * One model worker thread owns the backend and runs a continuous batch (worker.rs): requests
//!   join as their prompts are prefilled (in chunks between decode steps) and leave when they
//!   finish; a bounded FIFO queue waits for room, a full queue answers 429 with `Retry-After`; a
//!   client that goes away cancels its generation within one step.
//! * Prefix cache of sequence snapshots (KV + Gated DeltaNet state), LRU within a byte budget.
//! * Output pipeline: stop strings (never leaked) → reasoning split at `</think>` → Qwen XML
//!   tool calls as OpenAI `tool_calls`.
//!
//! See docs/server.md for the API details.

pub mod constrain;
pub mod error;
pub mod fuzz;
pub mod listen;
pub mod metrics;
pub mod output;
pub mod prefix_cache;
pub mod reasoning;
pub mod reply;
pub mod request;
pub mod responses;
pub mod responses_api;
pub mod routes;
pub mod scripted;
pub mod stop;
pub mod tokenize;
pub mod tools;
pub mod tui;
pub mod turn_trace;
pub mod worker;

use crate::backend::cuda::CudaOptions;
use crate::backend::{open_backend_with, Backend, BackendKind, KvCache};
use crate::checkpoint::Checkpoint;
use crate::engine::sampling::SamplingParams;
use crate::tokenizer::{ChatTemplate, Tokenizer};
use anyhow::{bail, Context, Result};
use axum::extract::DefaultBodyLimit;
use metrics::Metrics;
use responses::ReasoningField;
use routes::AppState;
use serde_json::{Map, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// The model id the API reports.
pub const MODEL_ID: &str = "Qwen3.6-35B-A3B";

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Checkpoint directory (MLX 4-bit layout). Without it: the embedded tiny synthetic model
    /// (random weights, for trying the API).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub bind: String,
    /// Longest sequence (prompt + completion) in tokens; capped at the model's
    /// max_position_embeddings.
    #[arg(long, default_value_t = 4096)]
    pub max_seq: usize,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendKind,
    /// Attention KV cache element type (default: the backend's: CUDA bf16, CPU f32).
    #[arg(long, value_enum)]
    pub kv_cache: Option<KvCache>,
    /// CUDA: share of the GPU's memory for weights, scratch and sequences (KV pages and state
    /// slots draw on what is left of it; default LILY_GPU_MEMORY_FRACTION or 0.9).
    #[arg(long, value_parser = crate::backend::cuda::options::parse_memory_fraction)]
    pub gpu_memory_fraction: Option<f64>,
    /// CUDA: the GPU to serve on, an index among the visible ones (default LILY_CUDA_DEVICE or
    /// 0); one replica per GPU, each on its own port (docs/deploy.md).
    #[arg(long)]
    pub gpu: Option<usize>,
    /// What a request's unset sampling fields (temperature, top_p, top_k, min_p,
    /// repetition_penalty) default to: the checkpoint's generation_config.json (`model`, as vLLM
    /// does) or OpenAI's temperature 1 over the whole vocabulary (`openai`).
    #[arg(long, value_enum, default_value = "model")]
    pub sampling_defaults: SamplingDefaults,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from LILY_API_KEY).
    #[arg(long, env = "LILY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Show a live dashboard instead of one log line per request.
    #[arg(long)]
    pub tui: bool,
    /// Requests allowed to wait for the model; more get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Most requests decoded together (default: what the backend's batch and its sequence
    /// memory take; 64 on the CPU).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Prompt tokens prefilled per scheduler turn, between decode steps of the running requests:
    /// larger prefills long prompts faster, smaller keeps the running streams' inter-token
    /// latency lower while a prompt is prefilled. While more prompts wait than requests decode
    /// (none decoding included), a turn takes up to 16,384 in one forward.
    #[arg(long, default_value_t = worker::PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Start without warming up (CUDA: a short prefill and the batch steps of every batch size
    /// captured ahead, a few seconds at start; without it the first requests of each batch size
    /// wait for them instead).
    #[arg(long)]
    pub no_warmup: bool,
    /// Print one line per turn of the model worker to stderr: requests admitted, prompt tokens
    /// prefilled and the time its snapshots took, rows and tokens decoded, requests retired
    /// (how the scheduler cut a load; docs/server.md).
    #[arg(long)]
    pub trace_turns: bool,
    /// Memory budget of the prefix cache (sequence snapshots), in MiB. Default: all of the
    /// sequence memory where the backend has a budget of its own (CUDA; snapshots then give way
    /// to running requests, least recently used first), else 2048.
    #[arg(long)]
    pub prefix_cache_mb: Option<usize>,
    /// Host memory (pinned) for prefix-cache entries pushed out of the device, in MiB: a hit on
    /// one copies it back instead of recomputing it (0: none). Pinned while the server loads
    /// (about 0.7 s per GiB). Default on a GPU: a quarter of the host memory available
    /// at start, at most 8192; on the CPU backend 0 (its cache is in host memory already).
    #[arg(long)]
    pub prefix_cache_host_mb: Option<usize>,
    /// A prompt's prefill also snapshots its sequence into the prefix cache every this many
    /// tokens (0: only at chat message starts and, unless the prompt's rest goes in with its first
    /// token, before the last token), so prompts that share
    /// a long prefix without a message boundary (a document, then different questions) resume
    /// within this many tokens of where they diverge.
    #[arg(long, default_value_t = 2048)]
    pub prefix_checkpoint_tokens: usize,
    /// Most client connections open at once; more wait in the listen backlog.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds a connection has to send a request's headers (also closes idle keep-alive and
    /// silent connections).
    #[arg(long, default_value_t = 30)]
    pub header_timeout_secs: u64,
    /// Seconds the running requests get to finish after SIGTERM or Ctrl-C (new requests get 503
    /// and /health answers 503 "draining" meanwhile), and then open connections to close.
    #[arg(long, default_value_t = 20)]
    pub shutdown_timeout_secs: u64,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Model id reported by /v1/models and in responses.
    #[arg(long, default_value = MODEL_ID)]
    pub served_model_name: String,
    /// Which field(s) carry the reasoning in responses.
    #[arg(long, value_enum, default_value = "both")]
    pub reasoning_field: ReasoningField,
    /// Server-wide default for the template's enable_thinking (requests override it with
    /// chat_template_kwargs); unset = the template's default (thinking on for Qwen3.6).
    #[arg(long)]
    pub enable_thinking: Option<bool>,
    /// Allowed CORS origins (comma-separated, or * for any); no CORS headers when unset.
    #[arg(long, value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// TEST ONLY: replace the model with scripted replies from this JSON file
    /// (see src/server/scripted.rs).
    #[arg(long, hide = true)]
    pub test_script: Option<PathBuf>,
}

impl ServeArgs {
    fn limits(&self) -> listen::Limits {
        listen::Limits {
            max_connections: self.max_connections,
            header_timeout: std::time::Duration::from_secs(self.header_timeout_secs.max(1)),
            shutdown_deadline: std::time::Duration::from_secs(self.shutdown_timeout_secs),
        }
    }

    /// Defaults as the CLI has them, for `model` (tests and embedding).
    pub fn for_model(model: Option<PathBuf>) -> Self {
        ServeArgs {
            model,
            bind: "127.0.0.1:0".into(),
            max_seq: 4096,
            backend: BackendKind::Cpu,
            kv_cache: None,
            gpu_memory_fraction: None,
            gpu: None,
            sampling_defaults: SamplingDefaults::Model,
            api_key: None,
            tui: false,
            max_queue: 256,
            max_batch: None,
            prefill_chunk: worker::PREFILL_CHUNK,
            no_warmup: false,
            trace_turns: false,
            prefix_cache_mb: None,
            prefix_cache_host_mb: None,
            prefix_checkpoint_tokens: 2048,
            max_connections: 1024,
            header_timeout_secs: 30,
            shutdown_timeout_secs: 20,
            max_body_bytes: 8 * 1024 * 1024,
            served_model_name: MODEL_ID.into(),
            reasoning_field: ReasoningField::Both,
            enable_thinking: None,
            cors_origins: vec![],
            test_script: None,
        }
    }
}

/// Everything loaded before the listener starts.
struct Loaded {
    state: Arc<AppState>,
    worker: worker::Worker,
    rx: mpsc::Receiver<worker::Job>,
    backend_name: &'static str,
}

/// `tokenizer`: the model's tokenizer already loaded, else it is loaded from the model directory.
fn load(args: &ServeArgs, tokenizer: Option<Arc<Tokenizer>>) -> Result<Loaded> {
    if args.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    if args.max_batch == Some(0) {
        bail!("--max-batch must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let dir = crate::engine::default_model::resolve_model(args.model.as_deref())?;
    let t0 = Instant::now();
    eprintln!("lily: loading {} ...", dir.display());
    let ck = Checkpoint::open(&dir).with_context(|| format!("cannot open checkpoint {}", dir.display()))?;
    let config = ck.config.clone();
    eprintln!("lily: checkpoint ok ({} tensors, {:.1} MB) in {:.1}s; loading tokenizer", ck.tensor_count(), ck.total_bytes() as f64 / 1e6, t0.elapsed().as_secs_f64());
    let tokenizer = match tokenizer {
        Some(t) => t,
        None => Arc::new(Tokenizer::load(&dir).with_context(|| format!("cannot load the tokenizer of {}", dir.display()))?),
    };
    let template = match ChatTemplate::load(&dir) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            eprintln!("lily: warning: no usable chat template ({e:#}); /v1/chat/completions will answer 400");
            None
        }
    };
    let mut backend: Box<dyn Backend> = match &args.test_script {
        Some(p) => {
            eprintln!("lily: TEST MODE: replies come from the script {}, not the model", p.display());
            Box::new(scripted::ScriptedBackend::new(config.clone(), tokenizer.clone(), scripted::ScriptedBackend::load_rules(p)?))
        }
        None => {
            eprintln!("lily: loading weights into the {:?} backend ...", args.backend);
            let mut opts = CudaOptions::from_env();
            opts.memory_fraction = args.gpu_memory_fraction.unwrap_or(opts.memory_fraction);
            opts.device = args.gpu.unwrap_or(opts.device);
            open_backend_with(args.backend, &ck, opts)?
        }
    };
    if let Some(kv) = args.kv_cache {
        kv.apply(backend.as_mut());
    }
    let backend_name = backend.name();
    let mut max_seq = args.max_seq;
    if config.max_position_embeddings > 0 {
        max_seq = max_seq.min(config.max_position_embeddings);
    }
    if max_seq < 2 {
        bail!("--max-seq must be at least 2");
    }
    let mut stop_ids = config.eos_token_ids.clone();
    for t in ["<|im_end|>", "<|endoftext|>"] {
        if let Some(id) = tokenizer.token_id(t) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
    }
    eprintln!("lily: model ready on {backend_name} in {:.1}s (max-seq {max_seq})", t0.elapsed().as_secs_f64());
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = mpsc::channel(args.max_queue);
    // A constrained answer ends with the end of turn (any stop token would end it).
    let answer_end = tokenizer.token_id("<|im_end|>").or(stop_ids.first().copied()).unwrap_or(0);
    let grammars = constrain::Grammars::new(tokenizer.clone(), config.vocab_size, answer_end);
    let worker = worker::Worker::new(backend, tokenizer.clone(), metrics.clone(), worker_config(args, max_seq, stop_ids, &tokenizer));
    let sampling_defaults = sampling_defaults(args.sampling_defaults, &dir);
    let mut default_kwargs = Map::new();
    if let Some(t) = args.enable_thinking {
        default_kwargs.insert("enable_thinking".into(), Value::Bool(t));
    }
    let state = Arc::new(AppState {
        model_id: args.served_model_name.clone(),
        tokenizer,
        template,
        vocab_size: config.vocab_size,
        queue: tx,
        max_queue: args.max_queue,
        max_seq,
        metrics,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        reasoning_field: args.reasoning_field,
        default_kwargs,
        created: routes::now_secs(),
        counter: AtomicU64::new(0),
        tokenize_permits: tokio::sync::Semaphore::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 16)),
        sampling_defaults,
        grammars,
        responses: std::sync::Mutex::new(responses_api::ResponseStore::default()),
    });
    Ok(Loaded { state, worker, rx, backend_name })
}

fn worker_config(args: &ServeArgs, max_seq: usize, stop_ids: Vec<u32>, tokenizer: &Tokenizer) -> worker::WorkerConfig {
    worker::WorkerConfig {
        max_seq,
        stop_ids,
        prefix_cache_bytes: args.prefix_cache_mb.map(|mb| mb.saturating_mul(1 << 20)),
        prefix_cache_host_bytes: args.prefix_cache_host_mb.map(|mb| mb.saturating_mul(1 << 20)),
        max_batch: args.max_batch,
        prefill_chunk: args.prefill_chunk,
        checkpoint_every: args.prefix_checkpoint_tokens,
        message_start: tokenizer.token_id("<|im_start|>"),
        warm_up: !args.no_warmup,
        trace_turns: args.trace_turns,
    }
}

/// Where a request's unset sampling fields come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SamplingDefaults {
    /// The checkpoint's generation_config.json (OpenAI's when it has none).
    Model,
    /// Temperature 1 over the whole vocabulary.
    Openai,
}

/// The sampling defaults the server applies, said once at start-up; a generation_config.json
/// that cannot be used is a warning (it is optional metadata), and OpenAI's defaults apply.
fn sampling_defaults(choice: SamplingDefaults, dir: &std::path::Path) -> SamplingParams {
    let openai = SamplingParams::openai();
    let chosen = match choice {
        SamplingDefaults::Openai => None,
        SamplingDefaults::Model => match SamplingParams::from_checkpoint_dir(dir) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("lily: warning: {e}; requests that set no sampling fields get OpenAI's defaults");
                None
            }
        },
    };
    let p = chosen.unwrap_or(openai);
    eprintln!(
        "lily: unset sampling fields default to temperature {}, top_p {}, top_k {}, min_p {}, repetition_penalty {}",
        p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty
    );
    p
}

fn app(args: &ServeArgs, state: Arc<AppState>) -> axum::Router {
    let mut router = routes::router(state).layer(DefaultBodyLimit::max(args.max_body_bytes));
    if !args.cors_origins.is_empty() {
        let origins = if args.cors_origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(args.cors_origins.iter().filter_map(|o| o.parse().ok()))
        };
        // The requested headers are listed back: `*` never covers `Authorization` (Fetch spec).
        let headers = tower_http::cors::AllowHeaders::mirror_request();
        router = router.layer(CorsLayer::new().allow_origin(origins).allow_methods(tower_http::cors::Any).allow_headers(headers));
    }
    router
}

/// Drains before shutdown: new requests get 503 and /health answers 503 "draining" (a gateway
/// stops routing here) while the admitted ones finish, for at most `deadline`.
async fn drain(metrics: &Metrics, deadline: std::time::Duration) {
    use std::sync::atomic::Ordering::Relaxed;
    metrics.draining.store(true, Relaxed);
    let t0 = Instant::now();
    // Waiting before running: the worker counts a request running before it stops counting it
    // waiting, so one of the two always holds it.
    let busy = || metrics.queue_depth.load(std::sync::atomic::Ordering::Acquire) > 0 || metrics.running.load(std::sync::atomic::Ordering::Acquire) > 0;
    if busy() {
        eprintln!("lily: draining: new requests get 503; waiting up to {}s for the running ones", deadline.as_secs());
    }
    while busy() && t0.elapsed() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    if busy() {
        eprintln!("lily: drain deadline passed with requests still running");
    }
}

/// A server running on a background thread (tests, embedding).
pub struct ServerHandle {
    pub addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    /// Sends whether to drain first.
    shutdown: Option<oneshot::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServerHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Stops accepting, finishes open responses, and joins the thread.
    pub fn shutdown(mut self) {
        self.stop(false);
    }
    /// Shuts down as on SIGTERM: drains (new requests 503, running ones finish within the
    /// shutdown timeout), then stops.
    pub fn drain_and_shutdown(mut self) {
        self.stop(true);
    }
    fn stop(&mut self, drain: bool) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(drain);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// Loads the model and starts serving on a background thread; returns once listening.
pub fn spawn(args: ServeArgs) -> Result<ServerHandle> {
    let loaded = load(&args, None)?;
    spawn_loaded(args, loaded)
}

/// Like [`spawn`] with the model's tokenizer already loaded (`args.model`'s own: the caller
/// vouches for that). Tests start many servers of one model, and a 248K-token vocabulary takes
/// ~2 s of CPU to load.
pub fn spawn_with_tokenizer(args: ServeArgs, tokenizer: Arc<Tokenizer>) -> Result<ServerHandle> {
    let loaded = load(&args, Some(tokenizer))?;
    spawn_loaded(args, loaded)
}

/// Like [`spawn`] with a caller-supplied backend (tests: a scripted or instrumented backend), and
/// optionally the model's tokenizer already loaded (as [`spawn_with_tokenizer`]).
pub fn spawn_with_backend(args: ServeArgs, tokenizer: Option<Arc<Tokenizer>>, backend: Box<dyn Backend>) -> Result<ServerHandle> {
    let mut loaded = load(&ServeArgs { test_script: None, ..args.clone() }, tokenizer)?;
    let tok = loaded.state.tokenizer.clone();
    let metrics = loaded.state.metrics.clone();
    let max_seq = loaded.state.max_seq;
    let stop_ids = {
        let mut v = backend.config().eos_token_ids.clone();
        v.extend(tok.token_id("<|im_end|>"));
        v
    };
    let cfg = worker_config(&args, max_seq, stop_ids, &tok);
    loaded.worker = worker::Worker::new(backend, tok, metrics, cfg);
    spawn_loaded(args, loaded)
}

fn spawn_loaded(args: ServeArgs, loaded: Loaded) -> Result<ServerHandle> {
    let Loaded { state, worker, rx, .. } = loaded;
    let metrics = state.metrics.clone();
    // Bound with std so this works from inside another runtime (async tests).
    let std_listener = std::net::TcpListener::bind(&args.bind).with_context(|| format!("cannot listen on {}", args.bind))?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    std::thread::Builder::new().name("lily-model".into()).spawn(move || worker.run(rx))?;
    let (stx, srx) = oneshot::channel::<bool>();
    let app = app(&args, state);
    let limits = args.limits();
    let drain_metrics = metrics.clone();
    let thread = std::thread::Builder::new().name("lily-http".into()).spawn(move || {
        let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("lily: cannot start the async runtime: {e}");
                return;
            }
        };
        rt.block_on(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else { return };
            listen::serve(listener, app, limits, async move {
                if srx.await == Ok(true) {
                    drain(&drain_metrics, limits.shutdown_deadline).await;
                }
            })
            .await;
        });
        rt.shutdown_timeout(std::time::Duration::from_secs(1));
    })?;
    Ok(ServerHandle { addr, metrics, shutdown: Some(stx), thread: Some(thread) })
}

/// `lily serve`: loads the model, prints the URL, serves until Ctrl-C (or `q` in the dashboard).
pub fn run(args: ServeArgs) -> Result<()> {
    let loaded = load(&args, None)?;
    let Loaded { state, worker, rx, backend_name } = loaded;
    let metrics = state.metrics.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind(&args.bind)).with_context(|| format!("cannot listen on {}", args.bind))?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new().name("lily-model".into()).spawn(move || worker.run(rx))?;
    let url = format!("http://{addr}");
    eprintln!("lily: serving {} on {url} (backend {backend_name}, OpenAI API at {url}/v1)", state.model_id);
    let (stx, srx) = oneshot::channel::<()>();
    let tui_thread = if args.tui {
        metrics.log_lines.store(false, std::sync::atomic::Ordering::Relaxed);
        let info = tui::DashInfo { model: state.model_id.clone(), url: url.clone(), max_seq: state.max_seq, backend: backend_name.to_string(), max_queue: args.max_queue };
        Some(tui::spawn(info, metrics.clone(), stx)?)
    } else {
        drop(stx);
        None
    };
    let app = app(&args, state);
    let tui_on = args.tui;
    let limits = args.limits();
    let drain_metrics = metrics.clone();
    rt.block_on(listen::serve(listener, app, limits, async move {
        let signal = async {
            #[cfg(unix)]
            {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut term) => tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    },
                    Err(_) => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            }
            #[cfg(not(unix))]
            {
                let _ = tokio::signal::ctrl_c().await;
            }
        };
        if tui_on {
            tokio::select! {
                _ = signal => {}
                _ = srx => {}
            }
        } else {
            signal.await;
        }
        eprintln!("lily: shutting down");
        drain(&drain_metrics, limits.shutdown_deadline).await;
    }));
    if let Some(t) = tui_thread {
        t.stop();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_defaults_come_from_generation_config_unless_asked_otherwise() {
        let dir = std::env::temp_dir().join(format!("lily-serve-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // No file, or a file that cannot be used: OpenAI's defaults.
        assert_eq!(sampling_defaults(SamplingDefaults::Model, &dir), SamplingParams::openai());
        std::fs::write(dir.join("generation_config.json"), r#"{"temperature": "warm"}"#).unwrap();
        assert_eq!(sampling_defaults(SamplingDefaults::Model, &dir), SamplingParams::openai());
        std::fs::write(dir.join("generation_config.json"), r#"{"do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8}"#).unwrap();
        let p = sampling_defaults(SamplingDefaults::Model, &dir);
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 20, 0.8));
        assert_eq!(sampling_defaults(SamplingDefaults::Openai, &dir), SamplingParams::openai());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
