//! The model worker: one thread owns the backend and schedules a running batch (continuous
//! batching).
//!
//! Each turn of its loop:
//! 1. **Admit** queued requests in FIFO order while the batch has room (`--max-batch`): look up
//!    the prefix cache, take a sequence and reserve its memory (prompt + max_tokens), evicting
//!    cached snapshots when the budget needs them. A request that does not fit while others run
//!    waits at the head of the queue until they free memory; one that cannot fit at all gets 503.
//! 2. **Prefill** up to `--prefill-chunk` prompt tokens (more while more prompts wait than rows
//!    decode, e.g. a burst of requests: `turn_tokens`), from the admitted prompts in order,
//!    several prompts' pieces per backend call (`prefill_round`: one forward reads the weights
//!    once for all of them); a prompt with all but its last token fed joins the decoding rows
//!    and ends the turn, so the next step feeds that token and draws the first one as soon as
//!    its prompt is in, with the running rows' next tokens. So a long prompt delays the running
//!    streams by one chunk per turn, not by its whole prefill. A prompt that will decode alone
//!    (an idle server) instead goes in with its first token: the decode call prefills the rest
//!    after its last checkpoint and chooses the first token from the prefill's last row
//!    (`rest_with_first_token`, `Backend::decode_after`), with no decode step of its own for
//!    the last prompt token. The prefill snapshots its sequence into the prefix cache at
//!    checkpoints: each chat message's start, every `--prefix-checkpoint-tokens`, and before the
//!    prompt's last token (not where the rest goes in with the first token).
//! 3. **Decode** one or more steps of every decoding row: one row alone runs the backend's
//!    pipelined single-sequence loop; several run `Backend::decode_batch`, where a structured-
//!    output row's grammar masks its draws (`StepHooks::mask`); rows whose client wants logprobs,
//!    and a structured-output row with no other row to batch with, step on the host with their
//!    logits. Without prefill work, a call runs up to [`DECODE_HORIZON`] steps and ends early
//!    when a waiting request can be admitted, or could be once the call's finished rows retire.
//! 4. **Retire** finished rows: the final event, usage and metrics, and the sequence into the
//!    prefix cache.
//!
//! Every row's tokens are drawn with draws keyed by (seed, position), so a request's tokens do not
//! depend on how its steps were split or batched (on the CPU reference they are exactly its solo
//! output). A client that goes away is noticed within a step; a backend error or panic fails the
//! requests it touched, and the worker keeps serving.

use super::constrain::Constraint;
use super::error::ApiError;
use super::metrics::{Metrics, RequestRecord, WorkerPhase};
use super::output::Delta;
use super::prefix_cache::{next_checkpoint, HostTier, Leaving, PrefixCache, RecentPrompts, Stored};
use super::reply::{logprob_entry, token_text, End, Reply};
use super::request::ParsedRequest;
use super::turn_trace::Turn;
use crate::backend::{is_memory_full, Backend, BatchRow, HostSequence, HostSequenceCopy, LogitsWanted, PrefillPiece, Sequence, StepHooks, TokenSink};
use crate::tokenizer::Tokenizer;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Default prompt tokens prefilled per turn of the scheduler while rows decode
/// (`--prefill-chunk`): what one turn adds to the running streams' inter-token latency while a
/// prompt is prefilled. Smaller chunks run the prefill kernels below their speed, take fewer
/// prompts per forward and add decode steps of a partly filled batch (docs/server.md and
/// docs/benchmarks.md have the measured trade-off).
pub const PREFILL_CHUNK: usize = 4096;

/// Prompt tokens per turn while more prompts wait than rows decode ([`turn_tokens`]): large
/// enough that prompts go in at the prefill's full speed, small enough that a newcomer is admitted
/// and a departed client noticed within a second or so.
const BURST_PREFILL_CHUNK: usize = 32768;

/// The prefix cache's budget on a backend without a sequence memory budget of its own (CPU).
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 2048 << 20;

/// Free sequence memory kept ahead of demand, as a share of the budget: while less is free, the
/// prefix cache's least-recently-used entries move to its host tier while rows decode, instead of
/// when a request or a snapshot needs the memory (a copy the worker waits for, the GPU idle
/// meanwhile). A batched decode starts them and settles them between its steps, one of each per
/// step, while the device has the step queued ([`StepHooks::beside_steps`]: the host's part of a
/// move, mapping a snapshot's pages and queueing its copies, then costs the GPU nothing), and
/// their copies run on a stream of their own; an entry's device memory is freed once the call
/// returns.
const MOVE_AHEAD_FREE: f64 = 1.0 / 16.0;

/// Entries moving ahead at once at most.
const MOVES_IN_FLIGHT: usize = 4;

/// A prefix-cache entry on its way to the host tier. Field order matters: a move dropped
/// unsettled (the worker ending) waits for its copy before the entry's device memory goes.
struct Move {
    copy: anyhow::Result<HostSequenceCopy>,
    entry: Leaving<Sequence>,
}

/// Prompt tokens per forward when every position's logits are wanted (prompt logprobs): 32 rows
/// of the 248K vocabulary are 32 MB.
const PROMPT_LOGPROB_CHUNK: usize = 32;

/// Prompts remembered to tell a repeat ([`RecentPrompts`]): a few hundred KB at most.
const RECENT_PROMPTS: usize = 4096;

/// Decode steps one backend call runs at most when no prompt waits for prefill. Each call ends
/// with its pipeline drained and a turn of the worker before the next one starts (~1 ms of an
/// idle GPU at one stream), so calls are long; a request that could join ends one early
/// ([`Waiting`]), so this bounds only how long a finished row's sequence waits to be retired
/// into the prefix cache while nothing else waits.
pub const DECODE_HORIZON: usize = 64;

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

impl Usage {
    /// Adds another choice's usage (a request with several choices reports their sum).
    pub fn add(&mut self, o: &Usage) {
        self.prompt_tokens += o.prompt_tokens;
        self.cached_tokens += o.cached_tokens;
        self.completion_tokens += o.completion_tokens;
        self.reasoning_tokens += o.reasoning_tokens;
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Completions with `echo` and `logprobs`: every prompt token's entry (the first has no
    /// logprob: NaN), before any generated token; for the choices `index..index + n` of its job.
    PromptLogprobs { index: usize, entries: Vec<TokenLogprob> },
    /// Choice `index`'s next piece.
    Delta { index: usize, delta: Delta, logprobs: Vec<TokenLogprob> },
    /// Choice `index` ended. A choice forked from another reports no prompt tokens of its own.
    Done { index: usize, finish_reason: &'static str, usage: Usage },
    Error(ApiError),
}

/// A validated, tokenized request waiting for the model.
pub struct Job {
    pub req: ParsedRequest,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Chat: whether the rendered prompt left a `<think>` block open.
    pub starts_in_reasoning: bool,
    /// Structured output: the grammar the answer must match.
    pub constraint: Option<Constraint>,
    pub events: mpsc::UnboundedSender<Event>,
    pub arrived: Instant,
    pub path: &'static str,
    /// The request's choice this job answers first, and how many choices it answers: the others
    /// fork from its sequence once the prompt is in (they share the prefill).
    pub index: usize,
    pub n: usize,
}

impl Job {
    /// Tokens its sequence reserves room for before it starts: the prompt and every token it may
    /// generate, within max-seq (so it never runs out of memory midway).
    fn room(&self, max_seq: usize) -> usize {
        (self.prompt.len() + self.max_tokens).min(max_seq)
    }

    /// Choice `index` of the same prompt, to continue a copy of this job's sequence.
    fn fork(&self, index: usize) -> Job {
        Job {
            req: self.req.clone(),
            prompt: self.prompt.clone(),
            max_tokens: self.max_tokens,
            starts_in_reasoning: self.starts_in_reasoning,
            constraint: self.constraint.clone(),
            events: self.events.clone(),
            arrived: self.arrived,
            path: self.path,
            index,
            n: 1,
        }
    }
}


pub struct WorkerConfig {
    pub max_seq: usize,
    pub stop_ids: Vec<u32>,
    /// The prefix cache's budget (`None`: the backend's sequence memory, else
    /// [`DEFAULT_PREFIX_CACHE_BYTES`]).
    pub prefix_cache_bytes: Option<usize>,
    /// The prefix cache's host tier (`None`: the backend's `default_host_tier_bytes`; 0: no host
    /// tier).
    pub prefix_cache_host_bytes: Option<usize>,
    /// Most sequences decoded together (`None`: the backend's `batch_capacity`).
    pub max_batch: Option<usize>,
    /// Prompt tokens prefilled per turn.
    pub prefill_chunk: usize,
    /// Prefix-cache checkpoints every this many prompt tokens (0: only at message starts and
    /// before the last token).
    pub checkpoint_every: usize,
    /// The token that starts a chat message (`<|im_start|>`): a checkpoint before each one.
    pub message_start: Option<u32>,
    /// Warm the backend up for the batch before serving ([`Backend::warm_up`]).
    pub warm_up: bool,
    /// One stderr line per turn ([`super::turn_trace`]).
    pub trace_turns: bool,
}

/// A request in the batch: its sequence and its reply.
struct Active {
    seq: Sequence,
    reply: Reply,
    /// Prompt logprobs collected so far (completions with `echo` and `logprobs`).
    prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// The prompt is in; the row decodes.
    decoding: bool,
    /// The prompt was among the recent ones ([`RecentPrompts`]).
    seen_before: bool,
}

impl Active {
    fn finished(&self) -> bool {
        self.reply.end.is_some() || self.reply.failed.is_some()
    }

    /// Takes decode steps: its prompt is in and it has not finished.
    fn stepping(&self) -> bool {
        self.decoding && !self.finished()
    }

    /// A row with its first tokens out ([`BURST_ROW_TOKENS`] or fewer): it decodes, and its
    /// prompt went in on one of the last turns, so it may belong to the burst the waiting
    /// prompts are the rest of ([`turn_tokens`]).
    fn fresh(&self) -> bool {
        self.stepping() && self.reply.generated.len() <= BURST_ROW_TOKENS
    }

    /// Still being prefilled: its prompt is not all in and it has not finished.
    fn prefilling(&self) -> bool {
        !self.decoding && !self.finished()
    }
}

/// What a turn's prefill did: prompt tokens fed, prompts that went in (their rows decode from the
/// next step), and the time the checkpoints' snapshots took.
#[derive(Default)]
struct PrefillTurn {
    tokens: usize,
    prompts_in: usize,
    snapshots: Duration,
}

/// What the steps need besides the rows (borrowed apart from them).
struct Ctx<'a> {
    backend: &'a mut dyn Backend,
    tokenizer: &'a Tokenizer,
    metrics: &'a Metrics,
    cfg: &'a WorkerConfig,
}

/// Runs `f`, turning a panic into an error (the worker keeps serving).
fn guarded<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into());
            Err(anyhow::anyhow!("panic: {msg}"))
        }
    }
}

pub struct Worker {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    cfg: WorkerConfig,
    cache: PrefixCache<Sequence, HostSequence>,
    recent: RecentPrompts,
    max_batch: usize,
    active: Vec<Active>,
    /// The queue's head, waiting for room in the batch or for sequence memory that running
    /// requests hold.
    held: Option<Job>,
    /// Prefix-cache entries moving to the host tier ahead of need ([`MOVE_AHEAD_FREE`]).
    moving: Vec<Move>,
    /// Bytes of entries still to move this turn.
    to_move: u64,
    /// Device memory of entries settled during a decode call, freed after it (freeing waits for
    /// the stream).
    moved_out: Vec<Sequence>,
}

impl Worker {
    pub fn new(mut backend: Box<dyn Backend>, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>, cfg: WorkerConfig) -> Self {
        let cache_bytes = cfg.prefix_cache_bytes.unwrap_or_else(|| backend.sequence_memory().map_or(DEFAULT_PREFIX_CACHE_BYTES, |r| r.budget_bytes as usize));
        let host_bytes = cfg.prefix_cache_host_bytes.unwrap_or_else(|| backend.default_host_tier_bytes());
        let host = HostTier { budget: host_bytes, spill: Sequence::to_host, spill_bytes: Sequence::host_bytes, size: HostSequence::bytes };
        let cache = PrefixCache::new(cache_bytes, Sequence::memory_bytes).with_bound(Sequence::memory_bound).with_host_tier(host);
        if host_bytes > 0 {
            backend.prepare_host_copies(host_bytes);
        }
        let capacity = backend.batch_capacity();
        let max_batch = match cfg.max_batch {
            Some(m) if m > capacity => {
                eprintln!("lily: --max-batch {m} is more than the {} backend takes in one step; using {capacity}", backend.name());
                capacity
            }
            Some(m) => m,
            None => capacity,
        }
        .max(1);
        if cfg.warm_up {
            // Serving without it only costs the first requests time: a failure is reported, not fatal.
            match backend.warm_up(max_batch) {
                Ok(Some(done)) => eprintln!("lily: {done}"),
                Ok(None) => {}
                Err(e) => eprintln!("lily: warm-up failed ({e:#}); serving without it"),
            }
        }
        metrics.max_batch.store(max_batch as u64, Relaxed);
        Worker { backend, tokenizer, metrics, cfg, cache, recent: RecentPrompts::new(RECENT_PROMPTS), max_batch, active: Vec::new(), held: None, moving: Vec::new(), to_move: 0, moved_out: Vec::new() }
    }

    /// Serves jobs until the queue closes and the batch is empty.
    pub fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        let metrics = Arc::clone(&self.metrics);
        let serving = Instant::now();
        let mut t = serving;
        loop {
            if self.active.is_empty() && self.held.is_none() {
                metrics.worker_waits(t);
                let job = rx.blocking_recv();
                t = metrics.worker_wait_ended();
                match job {
                    Some(job) => self.held = Some(job),
                    None => break,
                }
            }
            let mut turn = Turn { at: t.duration_since(serving).as_secs_f64(), ..Turn::default() };
            let (start, rows) = (t, self.active.len());
            self.admit(&mut rx);
            t = metrics.worker_spent(WorkerPhase::Admit, t);
            (turn.admit, turn.admitted) = (t - start, self.active.len().saturating_sub(rows));
            let start = t;
            let prefilled = self.prefill();
            t = metrics.worker_spent_with_part(WorkerPhase::Prefill, (WorkerPhase::Snapshot, prefilled.snapshots), t);
            (turn.prefill, turn.snapshots, turn.prompt_tokens, turn.prompts_in) = (t - start, prefilled.snapshots, prefilled.tokens, prefilled.prompts_in);
            let (start, generated) = (t, metrics.generated_tokens.load(Relaxed));
            turn.decode_rows = self.active.iter().filter(|a| a.stepping()).count();
            self.move_ahead();
            // A prompt's rest fed with its first token is prefill time inside the decode call.
            let rest_prefill = self.decode(&rx);
            t = metrics.worker_spent_with_part(WorkerPhase::Decode, (WorkerPhase::Prefill, rest_prefill), t);
            turn.prefill += rest_prefill;
            (turn.decode, turn.generated) = ((t - start).saturating_sub(rest_prefill), metrics.generated_tokens.load(Relaxed) - generated);
            let rows = self.active.len();
            self.retire();
            t = metrics.worker_spent(WorkerPhase::Retire, t);
            turn.retired = rows.saturating_sub(self.active.len());
            if self.cfg.trace_turns {
                eprintln!("{}", turn.line());
            }
        }
    }

    /// A client that left before its answer: 499 in `lily_requests_total` for a non-streamed
    /// request (its handler went with the connection; a stream was counted 200 when it began).
    fn count_gone(&self, job: &Job) {
        self.metrics.cancelled.fetch_add(1, Relaxed);
        // One HTTP request, however many choices it has: its first choice counts the 499.
        if !job.req.stream && job.index == 0 {
            self.metrics.count_request(super::routes::endpoint_label(job.path), 499);
        }
    }

    /// Starts queued jobs while the batch has room (see the module comment).
    fn admit(&mut self, rx: &mut mpsc::Receiver<Job>) {
        let mut started = 0;
        while self.active.len() < self.max_batch {
            let job = match self.held.take() {
                Some(job) => job,
                None => match rx.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                },
            };
            // A job's choices join the batch together: it waits for room for all of them (alone
            // it starts anyway).
            if self.active.len() + job.n > self.max_batch && !self.active.is_empty() {
                self.held = Some(job);
                break;
            }
            if job.events.is_closed() {
                self.metrics.queue_depth.fetch_sub(1, Relaxed);
                self.count_gone(&job);
                self.metrics.record(RequestRecord { method: "POST", path: job.path, status: 499, ms: job.arrived.elapsed().as_millis() as u64, prompt: job.prompt.len(), cached: 0, completion: 0, tok_s: 0.0, finish: "cancelled".into(), error: Some("client went away while queued".into()), queue_ms: None, ttft_ms: None, resume_ms: None, prefill_ms: None });
                continue;
            }
            let admitted = Instant::now();
            match guarded(|| self.take_sequence(&job)) {
                Ok((seq, cached)) => {
                    started += 1;
                    self.metrics.queue_time.observe(admitted.duration_since(job.arrived).as_secs_f64());
                    let prompt_logprobs = (job.req.echo && job.req.logprobs).then(|| {
                        let (token, bytes) = token_text(&self.tokenizer, job.prompt[0]);
                        vec![TokenLogprob { token, bytes, logprob: f32::NAN, top: vec![] }]
                    });
                    let mut reply = Reply::new(job, cached);
                    reply.admitted = admitted;
                    reply.resumed = Instant::now();
                    let seen_before = self.cache.enabled() && self.recent.seen_again(&reply.job.prompt);
                    self.active.push(Active { seq, reply, prompt_logprobs, decoding: false, seen_before });
                }
                Err(e) if is_memory_full(&e) && !self.active.is_empty() => {
                    self.held = Some(job);
                    break;
                }
                Err(e) => {
                    self.metrics.queue_depth.fetch_sub(1, Relaxed);
                    self.fail(&job, 0, &e);
                }
            }
        }
        // Running first, then waiting: a reader that reads the waiting count before the running
        // one (the drain on shutdown) always finds a started request in one of them.
        if started > 0 {
            self.publish();
            self.metrics.queue_depth.fetch_sub(started, std::sync::atomic::Ordering::Release);
        }
    }

    /// A sequence for `job` with room reserved for all of it: a copy of the longest cached
    /// prefix of its prompt, or a fresh one; and the prompt tokens it already holds.
    fn take_sequence(&mut self, job: &Job) -> anyhow::Result<(Sequence, usize)> {
        // Prompt logprobs need every prompt position's logits, which a cached snapshot lacks.
        // Other snapshots make room for the copy; if it still cannot be allocated, the request
        // prefills from scratch.
        let backend = &self.backend;
        let copy = |item: Stored<&Sequence, &HostSequence>| match item {
            Stored::Device(snap) => snap.try_clone(),
            Stored::Host(copy) => backend.restore_sequence(copy),
        };
        let found = if job.req.echo && job.req.logprobs { None } else { self.cache.copy_longest(&job.prompt, job.req.prompt_cache_key.as_deref(), copy, is_memory_full) };
        let hit = match found {
            Some(Ok(h)) => Some(h),
            Some(Err(e)) => {
                eprintln!("lily: prefix cache hit not used (copying the snapshot failed: {e:#})");
                None
            }
            None => None,
        };
        let hit_found = hit.is_some();
        let (mut seq, cached) = match hit {
            Some(h) => h,
            None => (self.with_memory(|w| w.backend.new_sequence(w.cfg.max_seq))?, 0),
        };
        let room = job.room(self.cfg.max_seq);
        self.with_memory(|_| seq.reserve(room))?;
        self.metrics.cache_lookups.fetch_add(1, Relaxed);
        if hit_found {
            self.metrics.cache_hits.fetch_add(1, Relaxed);
        }
        Ok((seq, cached))
    }

    /// Runs `f`, evicting cached snapshots (least recently used first, then the moves under way,
    /// waited for) while it fails for want of sequence memory; the error stays when nothing is
    /// left to evict.
    fn with_memory<T>(&mut self, mut f: impl FnMut(&mut Self) -> anyhow::Result<T>) -> anyhow::Result<T> {
        loop {
            match f(self) {
                Err(e) if is_memory_full(&e) && (self.cache.evict_lru().is_some() || self.settle_moves(true)) => {}
                r => return r,
            }
        }
    }

    /// Prefills up to `prefill_chunk` prompt tokens (more while more prompts wait than rows
    /// decode: [`turn_tokens`]), from the admitted prompts in order, in rounds of one backend
    /// call over several prompts' pieces ([`prefill_round`]). A prompt that is in ends the turn
    /// (see the module comment).
    fn prefill(&mut self) -> PrefillTurn {
        let chunk = turn_tokens(self.cfg.prefill_chunk, &TurnLoad::of(&self.active));
        let mut budget = chunk;
        let Worker { backend, tokenizer, metrics, cfg, cache, active, .. } = self;
        let mut ctx = Ctx { backend: backend.as_mut(), tokenizer, metrics, cfg };
        let mut forks = Vec::new();
        let mut done = PrefillTurn::default();
        loop {
            // Rows with all but their last prompt token in decode from the next step on. Their
            // clients have waited for the whole prompt: the turn ends here, and the next decode
            // step draws their first tokens with the running rows' next ones, instead of after
            // more prompts.
            let mut started = false;
            for a in active.iter_mut().filter(|a| a.prefilling() && a.seq.len() + 1 >= a.reply.job.prompt.len()) {
                match guarded(|| start_row(&mut ctx, a, &mut forks)) {
                    Ok(()) => {
                        started = true;
                        done.prompts_in += 1;
                    }
                    Err(e) => a.reply.failed = Some(e),
                }
            }
            if !started {
                if let Some(a) = rest_with_first_token(active, budget, cache.enabled(), cfg) {
                    let prompt = &a.reply.job.prompt;
                    done.tokens += prompt.len() - a.seq.len();
                    done.prompts_in += 1;
                    started = true;
                    start_decoding(a, prompt[prompt.len() - 1]);
                }
            }
            if started || budget == 0 {
                break;
            }
            let fed = prefill_round(&mut ctx, cache, active, budget, chunk, &mut done.snapshots);
            if fed == 0 {
                break;
            }
            done.tokens += fed;
            budget -= fed.min(budget);
        }
        active.extend(forks);
        done
    }

    /// Decodes the rows whose prompt is in (see the module comment). Returns the time it spent
    /// prefilling a prompt's rest with its first token ([`solo_steps`]).
    fn decode(&mut self, rx: &mpsc::Receiver<Job>) -> Duration {
        let prefill_waits = self.active.iter().any(Active::prefilling);
        let waiting = Waiting { room: self.held.is_none() && self.active.len() < self.max_batch, held: self.held.is_some(), rx };
        let Worker { backend, tokenizer, metrics, cfg, active, cache, moving, to_move, moved_out, .. } = self;
        let mut ctx = Ctx { backend: backend.as_mut(), tokenizer, metrics, cfg };
        // A row at max-seq cannot take another step.
        for a in active.iter_mut().filter(|a| a.stepping() && a.seq.len() >= a.seq.max_seq()) {
            a.reply.end = Some(End::Length);
        }
        // Structured-output rows step in the batch, masked in its sampler; alone, one steps on
        // the host like a logprobs row (the single-sequence forward beats a batch step of one).
        let alone = active.iter().filter(|a| a.stepping() && !a.reply.wants_logits()).count() == 1;
        let (mut host, mut device): (Vec<&mut Active>, Vec<&mut Active>) =
            active.iter_mut().filter(|a| a.stepping()).partition(|a| a.reply.wants_logits() || (alone && a.reply.job.constraint.is_some()));
        ctx.metrics.batch_size.store((host.len() + device.len()) as u64, Relaxed);
        let horizon = if prefill_waits || !host.is_empty() { 1 } else { DECODE_HORIZON };
        let solo = device.len() == 1 && host.is_empty() && !prefill_waits;
        if !solo {
            host.iter_mut().chain(device.iter_mut()).for_each(|a| settle_rest(&mut ctx, a));
            host.retain(|a| !a.finished());
            device.retain(|a| !a.finished());
        }
        let mut rest_prefill = Duration::ZERO;
        match device.len() {
            0 => {}
            1 if solo => {
                // The single-sequence loop runs nothing beside its steps: the turn's moves start
                // before it.
                while step_moves(cache, moving, to_move, moved_out) {}
                let mut device = device;
                rest_prefill = solo_steps(&mut ctx, device.pop().expect("one row"), DECODE_HORIZON, &waiting);
            }
            _ => {
                let mut beside = || {
                    step_moves(cache, moving, to_move, moved_out);
                };
                batch_steps(&mut ctx, device, horizon, &waiting, &mut beside)
            }
        }
        for a in host {
            host_step(&mut ctx, a);
        }
        // The backend is idle: what the moves settled during the call can go.
        if !self.moved_out.is_empty() {
            self.moved_out.clear();
            self.publish();
        }
        rest_prefill
    }

    /// Settles the moves whose copies are done (into the host tier; their device memory freed:
    /// the backend is idle between its calls), then, while rows decode, sets the turn's bytes to
    /// move: what less sequence memory is free than [`MOVE_AHEAD_FREE`] of the budget (counting
    /// what the moves under way will free). The decode starts them ([`step_moves`]).
    fn move_ahead(&mut self) {
        self.settle_moves(false);
        self.to_move = 0;
        // Only beside decode steps: without them nothing hides the copies.
        if !self.active.iter().any(|a| a.stepping()) {
            return;
        }
        let Some(r) = self.backend.sequence_memory() else { return };
        let want = (r.budget_bytes as f64 * MOVE_AHEAD_FREE) as u64;
        let on_the_way: u64 = self.moving.iter().map(|m| m.entry.item.memory_bytes() as u64).sum();
        self.to_move = want.saturating_sub(r.budget_bytes.saturating_sub(r.in_use_bytes + r.reserved_bytes) + on_the_way);
    }

    /// Settles the moves whose copies are done, or all of them (`wait`); whether any settled.
    fn settle_moves(&mut self, wait: bool) -> bool {
        let mut settled = false;
        while let Some(freed) = settle_next(&mut self.cache, &mut self.moving, wait) {
            drop(freed);
            settled = true;
        }
        if settled {
            self.publish();
        }
        settled
    }

    /// Ends the finished rows: their final events where they were not sent as the rows ended
    /// (a row ended outside a decode step: max-seq, a departed client), metrics, and their
    /// sequences into the prefix cache.
    fn retire(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if !self.active[i].finished() {
                i += 1;
                continue;
            }
            let Active { seq, mut reply, .. } = self.active.remove(i);
            // A reply answered before a later step of its call failed stands; its sequence's
            // state is unknown then, and is not cached.
            let cache_it = match reply.failed.take() {
                Some(e) if !reply.answered() => {
                    self.fail(&reply.job, reply.usage.cached_tokens, &e);
                    continue;
                }
                failed => failed.is_none(),
            };
            let finish = reply.finish();
            if cache_it {
                self.cache_sequence(seq, &reply);
            }
            let (usage, job) = (&reply.usage, &reply.job);
            let secs = reply.started.elapsed().as_secs_f64();
            self.metrics.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Relaxed);
            self.metrics.cached_tokens.fetch_add(usage.cached_tokens as u64, Relaxed);
            self.metrics.completion_tokens.fetch_add(usage.completion_tokens as u64, Relaxed);
            let (status, finish, error) = match finish {
                Some(f) => (200, f, None),
                None => {
                    self.count_gone(job);
                    (499, "cancelled", Some("client disconnected".to_string()))
                }
            };
            self.metrics.record(RequestRecord {
                method: "POST",
                path: job.path,
                status,
                ms: job.arrived.elapsed().as_millis() as u64,
                prompt: usage.prompt_tokens,
                cached: usage.cached_tokens,
                completion: usage.completion_tokens,
                tok_s: usage.completion_tokens as f64 / secs.max(1e-3),
                finish: finish.to_string(),
                error,
                queue_ms: Some(reply.admitted.duration_since(job.arrived).as_millis() as u64),
                ttft_ms: reply.first_token_at.map(|t| t.duration_since(job.arrived).as_millis() as u64),
                resume_ms: Some(reply.resumed.duration_since(reply.admitted).as_millis() as u64),
                prefill_ms: reply.prompt_in.map(|t| t.duration_since(reply.resumed).as_millis() as u64),
            });
        }
        self.publish();
    }

    /// Keeps a finished sequence in the prefix cache under exactly the tokens it consumed.
    fn cache_sequence(&mut self, seq: Sequence, reply: &Reply) {
        if let Some(tokens) = consumed_tokens(&reply.job.prompt, &reply.generated, reply.stop_token(), seq.len()) {
            self.cache.insert(tokens, seq, reply.job.req.prompt_cache_key.clone());
        }
    }

    /// Answers a request that failed: 503 with the reason when sequence memory ran out, 500
    /// otherwise (the details go to the log, not to the client).
    fn fail(&self, job: &Job, cached: usize, e: &anyhow::Error) {
        let (status, event) = if is_memory_full(e) {
            eprintln!("lily: request refused: {e:#}");
            (503, ApiError::unavailable(format!("not enough GPU memory for this request ({e}); retry with fewer tokens (prompt + max_tokens) or later")))
        } else {
            eprintln!("lily: request failed: {e:#}");
            (500, ApiError::internal())
        };
        let _ = job.events.send(Event::Error(event));
        self.metrics.record(RequestRecord {
            method: "POST",
            path: job.path,
            status,
            ms: job.arrived.elapsed().as_millis() as u64,
            prompt: job.prompt.len(),
            cached,
            completion: 0,
            tok_s: 0.0,
            finish: "error".into(),
            error: Some(format!("{e:#}")),
            queue_ms: None,
            ttft_ms: None,
            resume_ms: None,
            prefill_ms: None,
        });
    }

    /// Publishes the batch's gauges; the running count last, so a reader that sees a request
    /// finished also sees the memory it left behind.
    fn publish(&self) {
        let m = &self.metrics;
        m.active_seq_bytes.store(self.active.iter().map(|a| a.seq.memory_bytes() as u64).sum(), Relaxed);
        m.active_tokens.store(self.active.iter().map(|a| a.seq.len() as u64).sum(), Relaxed);
        m.cache_bytes.store(self.cache.memory_bytes() as u64, Relaxed);
        m.cache_entries.store(self.cache.len() as u64, Relaxed);
        m.cache_host_bytes.store(self.cache.host_memory_bytes() as u64, Relaxed);
        m.cache_host_entries.store(self.cache.host_len() as u64, Relaxed);
        m.cache_host_hits.store(self.cache.host_hits, Relaxed);
        m.cache_spills.store(self.cache.spills, Relaxed);
        m.cache_spill_ms.store(self.cache.spill_ms, Relaxed);
        if let Some(r) = self.backend.sequence_memory() {
            m.seq_memory_budget_bytes.store(r.budget_bytes, Relaxed);
            m.seq_memory_used_bytes.store(r.in_use_bytes, Relaxed);
        }
        if self.active.iter().all(|a| !a.decoding) {
            m.batch_size.store(0, Relaxed);
        }
        m.running.store(self.active.len() as i64, Release);
    }
}

/// Tokens a decoding row has drawn at most to count as fresh ([`Active::fresh`]): a burst's
/// prompts go in over a few turns (the first arrivals, then one or two forwards of the rest),
/// each followed by one decode step of the rows in, so the burst's earlier rows have one or two
/// tokens out while its later prompts wait.
const BURST_ROW_TOKENS: usize = 2;

/// The rows that decide a turn's prefill size: running streams, fresh rows (their first tokens
/// out), the prompts waiting and the most tokens one of them has still to feed.
struct TurnLoad {
    streams: usize,
    fresh: usize,
    waiting: usize,
    longest_waiting: usize,
}

impl TurnLoad {
    fn of(active: &[Active]) -> Self {
        let waiting = || active.iter().filter(|a| a.prefilling());
        TurnLoad {
            streams: active.iter().filter(|a| a.stepping() && !a.fresh()).count(),
            fresh: active.iter().filter(|a| a.fresh()).count(),
            waiting: waiting().count(),
            longest_waiting: waiting().map(|a| a.reply.job.prompt.len().saturating_sub(a.seq.len())).max().unwrap_or(0),
        }
    }
}

/// Prompt tokens one turn prefills, and the most one forward of it takes: `chunk`
/// (`--prefill-chunk`) while at least as many rows decode as prompts wait, since the turn adds
/// to those rows' inter-token latency; [`BURST_PREFILL_CHUNK`] while more prompts wait than rows
/// decode (none decoding included). Then most of the batch waits on the prompts, and one forward
/// takes them together at the prefill's full speed where chunks would take a few of them per
/// turn, each turn followed by a decode step of the part of the batch that is in (a burst of
/// requests arriving together, as when a batch's streams end at the same step and their clients
/// send the next ones). Fresh rows count as the burst's own, not as decoding rows, while every
/// waiting prompt's rest fits in a chunk: the burst's requests arrive a few ms apart, so its
/// first ones are in and have drawn a token or two when the rest come (a fresh row then waits
/// for at most [`BURST_ROW_TOKENS`] burst forwards); a long prompt arriving just after short
/// ones still goes in by chunks between their steps.
fn turn_tokens(chunk: usize, load: &TurnLoad) -> usize {
    let chunk = chunk.max(1);
    let joins = load.longest_waiting <= chunk;
    let decoding = load.streams + if joins { 0 } else { load.fresh };
    if load.waiting > decoding {
        chunk.max(BURST_PREFILL_CHUNK)
    } else {
        chunk
    }
}

/// One round of prefill: the next piece of each prefilling row's prompt, in order, up to its
/// next checkpoint, at most `budget` tokens in all; after the first, rows join while their whole
/// piece fits in `chunk` tokens (so short prompts go in a chunk at a time, and every prompt a
/// round starts also ends in it).
/// The pieces go through one backend call, so their projections and experts read the weights
/// once; each row is snapshotted into the prefix cache at its checkpoint (the time that takes is
/// added to `snapshots`). A row whose client wants prompt logprobs runs its own forwards (it
/// needs every position's logits). Returns the tokens fed.
fn prefill_round(ctx: &mut Ctx, cache: &mut PrefixCache<Sequence, HostSequence>, active: &mut [Active], budget: usize, chunk: usize, snapshots: &mut Duration) -> usize {
    // (row, tokens, the row's checkpoint)
    let mut plan: Vec<(usize, usize, usize)> = Vec::new();
    let mut packed = 0;
    for (i, a) in active.iter_mut().enumerate() {
        if !a.prefilling() {
            continue;
        }
        if packed >= budget.min(chunk) {
            break;
        }
        if a.reply.client_gone() {
            a.reply.end = Some(End::ClientGone);
            continue;
        }
        let left = budget - packed;
        if a.prompt_logprobs.is_some() {
            match guarded(|| prompt_logprob_piece(ctx, a, left)) {
                Ok(k) => packed += k,
                Err(e) => a.reply.failed = Some(e),
            }
            continue;
        }
        let (prompt, fed) = (&a.reply.job.prompt, a.seq.len());
        let checkpoint = next_checkpoint(prompt, fed, prompt.len() - 1, ctx.cfg.message_start, ctx.cfg.checkpoint_every);
        // A row joins a round only if its whole piece fits the chunk: one that would be cut
        // waits for the round and its next one too, for nothing (the first row is cut as needed).
        if !plan.is_empty() && packed + (checkpoint - fed) > chunk {
            continue;
        }
        let k = (checkpoint - fed).min(left);
        plan.push((i, k, checkpoint));
        packed += k;
    }
    if plan.is_empty() {
        return packed;
    }
    let results = {
        let mut pieces: Vec<PrefillPiece> = Vec::with_capacity(plan.len());
        let mut next = plan.iter().peekable();
        for (i, a) in active.iter_mut().enumerate() {
            if let Some(&(_, k, _)) = next.next_if(|p| p.0 == i) {
                let fed = a.seq.len();
                pieces.push(PrefillPiece { seq: &mut a.seq, tokens: &a.reply.job.prompt[fed..fed + k] });
            }
        }
        guarded(|| Ok(ctx.backend.prefill_pieces(&mut pieces)))
    };
    match results {
        Ok(results) => {
            let t = Instant::now();
            for (&(i, _, checkpoint), r) in plan.iter().zip(results) {
                match r {
                    Ok(()) => snapshot_at(cache, &mut active[i], checkpoint),
                    Err(e) => active[i].reply.failed = Some(e),
                }
            }
            *snapshots += t.elapsed();
        }
        Err(e) => {
            for &(i, _, _) in &plan {
                active[i].reply.failed = Some(anyhow::anyhow!("{e:#}"));
            }
        }
    }
    packed
}

/// Snapshots `a`'s sequence into the prefix cache when it stands at `checkpoint` (see
/// `next_checkpoint`); older snapshots make room for it, and one that still cannot be allocated
/// is not cached.
fn snapshot_at(cache: &mut PrefixCache<Sequence, HostSequence>, a: &mut Active, checkpoint: usize) {
    let (prompt, at) = (&a.reply.job.prompt, a.seq.len());
    if at != checkpoint || !cache.enabled() || cache.contains(&prompt[..at]) {
        return;
    }
    let copy = loop {
        match a.seq.try_clone() {
            Err(e) if is_memory_full(&e) && cache.evict_lru().is_some() => {}
            r => break r,
        }
    };
    match copy {
        Ok(snap) => cache.insert(prompt[..at].to_vec(), snap, a.reply.job.req.prompt_cache_key.clone()),
        Err(e) => eprintln!("lily: prompt prefix not cached (copying the sequence failed: {e:#})"),
    }
}

/// Feeds the next prompt tokens of a row that wants prompt logprobs (at most `budget`, with
/// every position's logits) and records their entries; returns the tokens fed.
fn prompt_logprob_piece(ctx: &mut Ctx, a: &mut Active, budget: usize) -> anyhow::Result<usize> {
    let (prompt, fed) = (&a.reply.job.prompt, a.seq.len());
    let entries = a.prompt_logprobs.as_mut().expect("a prompt-logprobs row");
    let k = (prompt.len() - 1 - fed).min(PROMPT_LOGPROB_CHUNK).min(budget);
    let logits = ctx.backend.forward(&mut a.seq, &prompt[fed..fed + k], LogitsWanted::All)?;
    let vocab = logits.len() / k;
    for (j, row) in logits.chunks(vocab).enumerate() {
        entries.push(logprob_entry(ctx.tokenizer, row, prompt[fed + j + 1], a.reply.job.req.top_logprobs));
    }
    Ok(k)
}

/// The row whose prompt's rest goes in with its first token: the one row of the batch, still
/// prefilling, that decodes alone after it (no prompt logprobs or other choices, no logits on the
/// host, no grammar, its client still there), whose rest (two tokens or more) fits the turn's
/// `budget` and holds no prefix-cache checkpoint before its last token. Its decode feeds the rest
/// through the prefill and takes the first token from the last row (`Backend::decode_after`),
/// saving the decode step of the last token, which reads every weight for one token. The
/// exact-repeat snapshot (all but the last token) is not taken: a repeat resumes from the last
/// message start or every-N-tokens checkpoint instead. So a prompt seen before among the recent
/// ones keeps the old path, and its snapshot serves the repeats after it.
fn rest_with_first_token<'a>(active: &'a mut [Active], budget: usize, cache_enabled: bool, cfg: &WorkerConfig) -> Option<&'a mut Active> {
    let mut live = active.iter_mut().filter(|a| !a.finished());
    let a = live.next()?;
    if live.next().is_some() || !a.prefilling() {
        return None;
    }
    let (job, fed) = (&a.reply.job, a.seq.len());
    let (len, rest) = (job.prompt.len(), job.prompt.len().saturating_sub(fed));
    let plain = !a.seen_before && a.prompt_logprobs.is_none() && job.n == 1 && !a.reply.wants_logits() && job.constraint.is_none() && !a.reply.client_gone();
    let no_checkpoint = !cache_enabled || next_checkpoint(&job.prompt, fed, len - 1, cfg.message_start, cfg.checkpoint_every) == len - 1;
    (plain && no_checkpoint && (2..=budget).contains(&rest)).then_some(a)
}

/// All but the last prompt token are in: the row decodes, its first step feeding that token
/// (so the first token comes from a decode step like every other, batched with the running
/// rows, with no separate forward). Its prompt logprobs, if asked for, go out now; the job's
/// other choices continue copies of the sequence (pushed onto `forks`).
fn start_row(ctx: &mut Ctx, a: &mut Active, forks: &mut Vec<Active>) -> anyhow::Result<()> {
    if let Some(entries) = a.prompt_logprobs.take() {
        let _ = a.reply.job.events.send(Event::PromptLogprobs { index: a.reply.job.index, entries });
    }
    let prompt = &a.reply.job.prompt;
    let last = prompt[prompt.len() - 1];
    for i in 1..a.reply.job.n {
        let mut seq = a.seq.try_clone()?;
        seq.reserve(a.reply.job.room(ctx.cfg.max_seq))?;
        let job = a.reply.job.fork(a.reply.job.index + i);
        let mut sibling = Active { seq, reply: Reply::new(job, 0), prompt_logprobs: None, decoding: false, seen_before: false };
        (sibling.reply.admitted, sibling.reply.resumed) = (a.reply.admitted, a.reply.resumed);
        start_decoding(&mut sibling, last);
        forks.push(sibling);
    }
    start_decoding(a, last);
    Ok(())
}

/// The row decodes from `next`, the last prompt token (a request for no tokens ends here). Its
/// prompt is in now unless its rest goes in with the first token (the decode marks it then).
fn start_decoding(a: &mut Active, next: u32) {
    a.decoding = true;
    if a.seq.len() + 1 >= a.reply.job.prompt.len() {
        a.reply.prompt_in.get_or_insert_with(Instant::now);
    }
    a.reply.next = next;
    if a.reply.remaining() == 0 {
        a.reply.end = Some(End::Length);
    }
}

/// Steps the row's sequence can still take: its remaining tokens within max-seq (counting the
/// prompt's rest where it goes in with the first token), at most `cap`.
fn steps_for(a: &Active, cap: usize) -> usize {
    let held = a.seq.len().max(a.reply.job.prompt.len().saturating_sub(1));
    a.reply.remaining().min(a.seq.max_seq().saturating_sub(held)).min(cap)
}

/// What a decoding row's next step feeds: the prompt's rest where it goes in with the first token
/// ([`rest_with_first_token`]), else its next token.
fn feed_of(a: &Active) -> &[u32] {
    let prompt = &a.reply.job.prompt;
    match a.seq.len() + 1 < prompt.len() {
        true => &prompt[a.seq.len()..],
        false => std::slice::from_ref(&a.reply.next),
    }
}

/// Feeds all but the last token of a prompt's rest that was to go in with the first token, for a
/// row that steps in a batch or on the host after all (those steps feed one token a row).
fn settle_rest(ctx: &mut Ctx, a: &mut Active) {
    let (prompt, fed) = (&a.reply.job.prompt, a.seq.len());
    if fed + 1 >= prompt.len() {
        return;
    }
    if let Err(e) = guarded(|| ctx.backend.forward(&mut a.seq, &prompt[fed..prompt.len() - 1], LogitsWanted::None)) {
        a.reply.failed = Some(e);
    }
}

/// One row alone: the backend's pipelined single-sequence loop (the token stays on the device),
/// up to `steps` steps; it pauses (to resume next turn) once `waiting` says a request could
/// join, as a batch's rows do, so a stream running alone delays a newcomer by a step rather than
/// by the rest of its call. Returns the time to its first token where the call fed a prompt's
/// rest (the rest's prefill), else zero.
fn solo_steps(ctx: &mut Ctx, a: &mut Active, steps: usize, waiting: &Waiting) -> Duration {
    let steps = steps_for(a, steps);
    let feed = feed_of(a).to_vec();
    let Active { seq, reply, .. } = a;
    let snap = reply.sampler.clone();
    let (tokenizer, metrics, stop_ids) = (ctx.tokenizer, ctx.metrics, &ctx.cfg.stop_ids);
    let mut replies = [reply];
    // A prompt's rest is in once its first token is out.
    let accept = &mut |r: &mut Reply, t| {
        r.prompt_in.get_or_insert_with(Instant::now);
        r.accept(t, &[], stop_ids, tokenizer, metrics)
    };
    let mut hooks = RowHooks { replies: &mut replies, accept, waiting, ended: 0, beside: &mut || {}, ahead: false };
    let sampled = (!snap.params.is_plain_greedy()).then_some(&snap);
    let called = Instant::now();
    let r = guarded(|| ctx.backend.decode_after(seq, &feed, steps, sampled, &mut hooks));
    if let Err(e) = r {
        replies[0].failed = Some(e);
    }
    match (feed.len() > 1, replies[0].prompt_in) {
        (true, Some(t)) => t.saturating_duration_since(called),
        _ => Duration::ZERO,
    }
}

/// The tokens a sequence that consumed `fed` of them holds: its prompt's first ones, or the
/// prompt and the generated tokens, then the stop token that ended the reply where a pipelined
/// decode fed it (the single-sequence loop queues the next step before it reads a token). None
/// if `fed` is more than those.
fn consumed_tokens(prompt: &[u32], generated: &[u32], stop: Option<u32>, fed: usize) -> Option<Vec<u32>> {
    let mut t: Vec<u32> = prompt.iter().chain(generated).chain(stop.as_ref()).copied().collect();
    (fed <= t.len()).then(|| {
        t.truncate(fed);
        t
    })
}

/// Settles one move into the prefix cache's host tier: one whose copy is done (or failed), or
/// with `wait` any, waiting for its copy. Returns the entry's device item, for the caller to free
/// when the backend is idle; `None` when no move qualifies.
fn settle_next(cache: &mut PrefixCache<Sequence, HostSequence>, moving: &mut Vec<Move>, wait: bool) -> Option<Sequence> {
    let i = moving.iter().position(|m| wait || m.copy.as_ref().map_or(true, |c| c.is_done()))?;
    let Move { copy, entry } = moving.swap_remove(i);
    Some(cache.settle_moved(entry, || copy?.finish()))
}

/// One round of the prefix cache's moves to its host tier (beside a decode step, or before the
/// single-sequence loop): settles one move whose copy is done (its device memory kept in
/// `moved_out` until the backend is idle) and starts one more while `to_move` bytes are wanted
/// and fewer than [`MOVES_IN_FLIGHT`] are under way. Whether it started one.
fn step_moves(cache: &mut PrefixCache<Sequence, HostSequence>, moving: &mut Vec<Move>, to_move: &mut u64, moved_out: &mut Vec<Sequence>) -> bool {
    moved_out.extend(settle_next(cache, moving, false));
    if *to_move == 0 || moving.len() >= MOVES_IN_FLIGHT {
        return false;
    }
    let Some(leaving) = cache.take_lru_to_move() else {
        *to_move = 0;
        return false;
    };
    *to_move = to_move.saturating_sub(leaving.item.memory_bytes() as u64);
    let copy = leaving.item.start_to_host();
    moving.push(Move { copy, entry: leaving });
    true
}

/// Several rows through `Backend::decode_batch`, up to `horizon` steps; every row stops (and
/// resumes next turn) once `waiting` says a request could join; `beside` runs once per step
/// while the device has it queued.
fn batch_steps(ctx: &mut Ctx, rows: Vec<&mut Active>, horizon: usize, waiting: &Waiting, beside: &mut dyn FnMut()) {
    let mut batch = Vec::with_capacity(rows.len());
    let mut replies = Vec::with_capacity(rows.len());
    for a in rows {
        let max_tokens = steps_for(a, horizon);
        let Active { seq, reply, .. } = a;
        batch.push(BatchRow { seq, first_token: reply.next, max_tokens, sampler: reply.sampler.clone() });
        replies.push(reply);
    }
    let (tokenizer, metrics, stop_ids) = (ctx.tokenizer, ctx.metrics, &ctx.cfg.stop_ids);
    let mut hooks = RowHooks { replies: &mut replies, accept: &mut |r: &mut Reply, t| r.accept(t, &[], stop_ids, tokenizer, metrics), waiting, ended: 0, beside, ahead: false };
    let r = guarded(|| ctx.backend.decode_batch(&mut batch, &mut hooks));
    if let Err(e) = r {
        // A failed step leaves every row of it in an unknown state: all of them fail.
        let msg = format!("{e:#}");
        for r in replies {
            r.failed = Some(anyhow::anyhow!("batched decode failed: {msg}"));
        }
    }
}

/// The requests waiting while a decode call runs: whether one could start if the call paused
/// now, so that it ends early for them (the call's horizon bounds it otherwise).
struct Waiting<'a> {
    /// The batch has a free place and no request waits for memory.
    room: bool,
    /// A request waits for sequence memory that running rows hold.
    held: bool,
    rx: &'a mpsc::Receiver<Job>,
}

impl Waiting<'_> {
    /// With `ended` rows of the call finished (retiring them frees their places in the batch and
    /// their memory): a queued request could start, or the one waiting for memory try again.
    fn could_join(&self, ended: usize) -> bool {
        match ended {
            0 => self.room && !self.rx.is_empty(),
            _ => self.held || !self.rx.is_empty(),
        }
    }
}

/// A batched decode's view of its rows' replies: each token goes to its reply (`accept`: false
/// ends the row), a reply's structured-output constraint masks its row's draws, and every row
/// stops (to resume next turn) once `waiting` says a request could join.
struct RowHooks<'a, 'r, F: FnMut(&mut Reply, u32) -> bool> {
    replies: &'a mut [&'r mut Reply],
    accept: &'a mut F,
    waiting: &'a Waiting<'a>,
    /// Rows of this call that ended (finished or their clients gone).
    ended: usize,
    /// Host work beside the queued steps (the prefix cache's moves).
    beside: &'a mut dyn FnMut(),
    /// The backend queued the next step before this step's tokens: each row has been fed its
    /// token already, so none may pause at this step (it would be fed again on resuming).
    ahead: bool,
}

impl<F: FnMut(&mut Reply, u32) -> bool> StepHooks for RowHooks<'_, '_, F> {
    fn token(&mut self, row: usize, token: u32) -> bool {
        let more = (self.accept)(self.replies[row], token);
        self.ended += usize::from(!more);
        more && (self.ahead || !self.waiting.could_join(self.ended))
    }

    fn mask(&mut self, row: usize, allowed: &mut [u32]) -> anyhow::Result<bool> {
        Ok(self.replies[row].allowed(allowed))
    }

    /// Ahead only while no request waits to join (the rows pause one step later than they
    /// would otherwise) and no row is constrained (a grammar's mask follows the last token).
    fn queue_ahead(&mut self) -> bool {
        self.ahead = !self.waiting.could_join(self.ended) && self.replies.iter().all(|r| r.job.constraint.is_none());
        self.ahead
    }

    fn beside_steps(&mut self) {
        (self.beside)()
    }
}

/// A row alone ([`solo_steps`]): the same pause and queue-ahead rules for its one reply.
impl<F: FnMut(&mut Reply, u32) -> bool> TokenSink for RowHooks<'_, '_, F> {
    fn token(&mut self, token: u32) -> bool {
        StepHooks::token(self, 0, token)
    }

    fn queue_ahead(&mut self) -> bool {
        StepHooks::queue_ahead(self)
    }
}

/// One step of a row whose logits the host needs (logprobs).
fn host_step(ctx: &mut Ctx, a: &mut Active) {
    let at = a.seq.len();
    let r = guarded(|| {
        let mut logits = ctx.backend.forward(&mut a.seq, &[a.reply.next], LogitsWanted::Last)?;
        let tok = a.reply.draw(&mut logits, at)?;
        Ok((tok, logits))
    });
    match r {
        Ok((tok, logits)) => {
            a.reply.accept(tok, &logits, &ctx.cfg.stop_ids, ctx.tokenizer, ctx.metrics);
        }
        Err(e) => a.reply.failed = Some(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence state of `.0` bytes whose host copies are made at once.
    struct Bytes(usize);
    impl crate::backend::SequenceState for Bytes {
        fn try_clone_state(&self, _len: usize) -> anyhow::Result<Box<dyn crate::backend::SequenceState>> {
            Ok(Box::new(Bytes(self.0)))
        }
        fn memory_bytes(&self) -> usize {
            self.0
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    #[test]
    fn moves_beside_steps_take_the_least_recently_used_entries_to_the_host_tier() {
        let host = HostTier { budget: 1000, spill: Sequence::to_host, spill_bytes: Sequence::host_bytes, size: HostSequence::bytes };
        let mut cache = PrefixCache::new(1000, Sequence::memory_bytes).with_host_tier(host);
        for t in 0..6u32 {
            cache.insert(vec![t], Sequence::new(8, Box::new(Bytes(10))), None);
        }
        let (mut moving, mut to_move, mut moved_out) = (Vec::new(), 35u64, Vec::new());
        // One move starts per round; a copy done by the next round settles there.
        assert!(step_moves(&mut cache, &mut moving, &mut to_move, &mut moved_out));
        assert_eq!((moving.len(), to_move, moved_out.len()), (1, 25, 0));
        let mut rounds = 1;
        while step_moves(&mut cache, &mut moving, &mut to_move, &mut moved_out) {
            rounds += 1;
        }
        // 35 bytes wanted: four entries of 10 start, then rounds only settle.
        assert_eq!((rounds, to_move), (4, 0));
        while !moving.is_empty() {
            assert!(!step_moves(&mut cache, &mut moving, &mut to_move, &mut moved_out));
        }
        assert_eq!((moved_out.len(), cache.host_len(), cache.len(), cache.memory_bytes()), (4, 4, 6, 20));
        for t in 0..6u32 {
            let hit = cache.lookup(&[t, 99], None).map(|(s, n)| (matches!(s, Stored::Host(_)), n));
            assert_eq!(hit, Some((t < 4, 1)), "entry {t}: the four least recently used moved");
        }
    }

    #[test]
    fn a_cached_sequence_is_keyed_by_the_tokens_it_consumed() {
        let (p, g) = ([1, 2, 3], [7, 8]);
        assert_eq!(consumed_tokens(&p, &g, None, 2), Some(vec![1, 2]));
        assert_eq!(consumed_tokens(&p, &g, None, 4), Some(vec![1, 2, 3, 7]));
        assert_eq!(consumed_tokens(&p, &g, None, 5), Some(vec![1, 2, 3, 7, 8]));
        assert_eq!(consumed_tokens(&p, &g, None, 6), None);
        // A pipelined decode fed the stop token after the last generated one.
        assert_eq!(consumed_tokens(&p, &g, Some(9), 6), Some(vec![1, 2, 3, 7, 8, 9]));
        assert_eq!(consumed_tokens(&p, &g, Some(9), 5), Some(vec![1, 2, 3, 7, 8]));
        assert_eq!(consumed_tokens(&p, &g, Some(9), 7), None);
    }

    /// A turn's load without fresh rows: `streams` rows decoding, `waiting` prompts of 700 tokens.
    fn load(streams: usize, waiting: usize) -> TurnLoad {
        TurnLoad { streams, fresh: 0, waiting, longest_waiting: 700 }
    }

    #[test]
    fn a_turn_takes_a_chunk_unless_more_prompts_wait_than_rows_decode() {
        // Rows decoding and no more prompts than rows: one chunk per turn bounds their stall.
        assert_eq!(turn_tokens(4096, &load(15, 1)), 4096);
        assert_eq!(turn_tokens(4096, &load(1, 1)), 4096);
        assert_eq!(turn_tokens(4096, &load(3, 0)), 4096);
        // A burst (15 prompts behind one decoding row) or nobody decoding: one large forward.
        assert_eq!(turn_tokens(4096, &load(1, 15)), BURST_PREFILL_CHUNK);
        assert_eq!(turn_tokens(4096, &load(0, 1)), BURST_PREFILL_CHUNK);
        // A chunk above the burst size is kept; a zero chunk still feeds a token.
        assert_eq!(turn_tokens(65536, &load(0, 3)), 65536);
        assert_eq!(turn_tokens(0, &load(2, 1)), 1);
    }

    #[test]
    fn fresh_rows_wait_for_the_rest_of_their_burst_but_not_for_a_long_prompt() {
        // 8 of 16 clients' prompts went in on the last turn and drew a token each; the other 8
        // 700-token prompts are the rest of their burst: one forward.
        let rest = TurnLoad { streams: 0, fresh: 8, waiting: 8, longest_waiting: 700 };
        assert_eq!(turn_tokens(4096, &rest), BURST_PREFILL_CHUNK);
        // 64 clients: 2 rows with three tokens out are streams, 41 fresh; the round's other 21
        // prompts go in together.
        let tail = TurnLoad { streams: 2, fresh: 41, waiting: 21, longest_waiting: 700 };
        assert_eq!(turn_tokens(4096, &tail), BURST_PREFILL_CHUNK);
        // A long prompt arriving while three streams have their first token: chunks, so those
        // streams wait at most a chunk per turn.
        let long = TurnLoad { streams: 0, fresh: 3, waiting: 1, longest_waiting: 32_000 };
        assert_eq!(turn_tokens(4096, &long), 4096);
        // Rows that have streamed on hold the turn to the chunk as before.
        assert_eq!(turn_tokens(4096, &TurnLoad { streams: 8, fresh: 0, waiting: 8, longest_waiting: 700 }), 4096);
    }
}
