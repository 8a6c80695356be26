//! CUDA backend for Hopper (sm_90): hand-written kernels (`kernels/<family>.cu`, compiled by
//! NVRTC, cached on disk) reading the MLX 4-bit weights directly.
//!
//! Layout, mirroring `cpu/`: one launcher module per op family beside its kernels (`qmatmul`,
//! `gdn`, `attention`, `moe`, `ops`, `sampling`), each with its kernel choice as a pure, tested
//! `select` function; `registry` (modules loaded per context) and `device` (the one launch path);
//! `forward` (the layer loop, written once) with its two passes, `decode` (T = 1, one CUDA graph
//! per step, greedy tokens kept on the device and two steps in flight), `prefill` (T tokens in
//! chunks) and `batch` (one token of each of B sequences per step: GEMV sets and expert products
//! over the batch's tokens, per-row mixers);
//! `options` (every setting, read once); `timeline` (where a graph decode step's time goes, a
//! developer knob). See docs/cuda.md and docs/cuda-prefill.md.

pub mod activations;
pub mod attention;
pub mod batch;
pub mod blas;
pub mod budget;
pub mod decode;
pub mod device;
pub mod forward;
pub mod gdn;
pub mod handover;
pub mod hostmem;
pub mod moe;
pub mod nvrtc;
pub mod ops;
pub mod options;
pub mod prefill;
pub mod qmatmul;
pub mod registry;
pub mod sampling;
pub mod seqmem;
pub mod state;
#[cfg(feature = "cuda-testing")]
pub mod testing;
pub mod timeline;
pub mod vmm;
pub mod weights;

use super::{Backend, BatchRow, HostSequence, LogitsWanted, PrefillPiece, Sequence, SequenceMemoryReport, StepHooks, TokenSink};
use crate::checkpoint::{Checkpoint, ModelConfig};
use crate::engine::sampling::SamplerSnapshot;
use crate::model::ModelWeights;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaSlice;
use decode::{Decoder, StepOut};
pub use device::Gpu;
use forward::Probe;
pub use options::CudaOptions;
use prefill::ChunkBuffers;
use seqmem::SequenceMemory;
use state::CudaSequence;
use std::sync::Arc;
use weights::DevWeights;

pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    pub(crate) cfg: ModelConfig,
    pub(crate) w: DevWeights,
    pub(crate) opts: CudaOptions,
    decoder: Decoder,
    /// The budget and pools sequences draw their memory from.
    mem: Arc<SequenceMemory>,
    /// Prefill buffers, grown to the longest chunk seen.
    chunk_buffers: Option<ChunkBuffers>,
    /// cuBLAS for long prefill chunks (when `opts.cublas` and libcublas loads).
    pub(crate) blas: Option<blas::Blas>,
    /// Captured decode steps, keyed by what they bake in ([`step_key`]) and what they produce,
    /// with their attention split count (the launch shapes a graph's update keeps).
    graphs: Vec<(Vec<u64>, StepOut, usize, StepGraph)>,
    /// Decode graphs made another sequence's by [`recapture`] (tests).
    graph_updates: u64,
    /// Batched decode buffers and their captured steps, once a batch ran.
    batcher: Option<batch::Batcher>,
    /// Pinned host slots the greedy decode loop reads tokens back through (depth 2).
    readback: Option<[Readback; 2]>,
    /// The same for batched decode: `[token, position]` of up to `batch::MAX_BATCH` rows.
    batch_readback: Option<[Readback; 2]>,
    /// False after a capture failed (then every step launches directly) or without graphs.
    use_graphs: bool,
    /// With `opts.profile`: per-phase decode GPU time, printed when the backend is dropped.
    profile: Option<DecodeProfile>,
}

#[derive(Default)]
struct DecodeProfile {
    steps: usize,
    /// (phase, total ms), in first-seen order.
    phases: Vec<(&'static str, f64)>,
}

impl DecodeProfile {
    /// Adds one step's phase times.
    fn add(&mut self, phases: &[(&'static str, f64)]) {
        for &(name, ms) in phases {
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some(e) => e.1 += ms,
                None => self.phases.push((name, ms)),
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(t) = self.gpu.timeline() {
            if let Err(e) = t.report(&self.gpu) {
                eprintln!("lily: CUDA timeline: {e:#}");
            }
        }
        if let Some(p) = &self.profile {
            if p.steps == 0 {
                return;
            }
            let total: f64 = p.phases.iter().map(|(_, t)| t).sum();
            eprintln!("lily: CUDA profile over {} steps (direct launches, {:.3} ms/step):", p.steps, total / p.steps as f64);
            for (name, t) in &p.phases {
                eprintln!("  {name:<14} {:>9.1} us/step  {:>5.1}%", 1000.0 * t / p.steps as f64, 100.0 * t / total);
            }
        }
    }
}

/// One pinned host slot of a pipelined decode loop, mapped into the device, and the event
/// recorded after the step's tokens are written to it (our own event: event tracking is off, so
/// the slice's built-in event is never recorded). A kernel writes the tokens (`readback_words`),
/// not a device-to-host copy: a copy would wait behind any long copy queued on the same copy
/// engine from another stream (the prefix cache's moves to its host tier).
struct Readback {
    host: cudarc::driver::PinnedHostSlice<i32>,
    /// The slot's address on the device.
    dev: u64,
    done: cudarc::driver::CudaEvent,
}

const READBACK_WORDS: registry::Kernel = registry::Kernel::ordered_stamping(&registry::OPS, "readback_words");

impl Readback {
    /// The two slots of a loop with two steps in flight, `len` words each.
    fn pair(gpu: &Gpu, len: usize) -> Result<[Readback; 2]> {
        let alloc = || -> Result<Readback> {
            // SAFETY: page-locked host memory mapped into the device; only read after the event
            // that follows the kernel writing it.
            let mut host = unsafe { gpu.ctx.alloc_pinned_with_flags::<i32>(len, cudarc::driver::sys::CU_MEMHOSTALLOC_DEVICEMAP) }
                .map_err(|e| anyhow!("pinned host allocation: {e:?}"))?;
            let at = host.as_mut_ptr().map_err(|e| anyhow!("pinned host allocation: {e:?}"))?;
            let mut dev: cudarc::driver::sys::CUdeviceptr = 0;
            // SAFETY: `at` is the start of a live allocation made with CU_MEMHOSTALLOC_DEVICEMAP in
            // this context; the call only writes `dev`.
            unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut dev, at.cast(), 0) }
                .result()
                .map_err(|e| anyhow!("mapping the token readback into the device: {e:?}"))?;
            let done = gpu.ctx.new_event(None).map_err(|e| anyhow!("{e:?}"))?;
            Ok(Readback { host, dev, done })
        };
        Ok([alloc()?, alloc()?])
    }

    /// Queues the kernel writing the first `n` words of `src` into the slot's first words, then
    /// the slot's event.
    fn enqueue(&mut self, gpu: &Gpu, src: &CudaSlice<i32>, n: usize) -> Result<()> {
        if n > src.len() || n > self.host.len() {
            bail!("token readback of {n} words from {} into a slot of {}", src.len(), self.host.len());
        }
        let args = [device::Arg::P(device::ptr(src, &gpu.stream)), device::Arg::I(n as i32), device::Arg::P(self.dev)];
        gpu.launch(READBACK_WORDS, (1, 1, 1), 256, 0, &args)?;
        self.done.record(&gpu.stream).map_err(|e| anyhow!("token readback: {e:?}"))
    }

    /// The slot's first `len` words, once its kernel is done.
    fn wait(&self, len: usize) -> Result<&[i32]> {
        let err = |e: cudarc::driver::DriverError| anyhow!("CUDA error during the forward pass: {e:?}");
        self.done.synchronize().map_err(err)?;
        Ok(&self.host.as_slice().map_err(err)?[..len])
    }
}

/// A captured decode step. CUDA graphs may be launched from any thread as long as calls are not
/// concurrent; the backend is used through `&mut self`, which serialises them.
struct StepGraph {
    graph: cudarc::driver::CudaGraph,
    /// With the decode timeline: its launch log of the capture, added at each replay.
    timeline: Option<(Arc<timeline::Timeline>, Vec<timeline::Entry>)>,
}
// SAFETY: see above: only launched through `&mut CudaBackend`.
unsafe impl Send for StepGraph {}

impl StepGraph {
    fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(|e| anyhow::anyhow!("CUDA graph launch failed: {e:?}"))?;
        if let Some((t, entries)) = &self.timeline {
            t.replayed(entries);
        }
        Ok(())
    }

    /// Puts the graph on the device ahead of its first launch (which would otherwise do it).
    fn upload(&self) -> Result<()> {
        self.graph.upload().map_err(|e| anyhow::anyhow!("CUDA graph upload failed: {e:?}"))
    }
}

/// Captures what `enqueue` launches on the stream into a graph (not launched). A capture that
/// another thread's implicitly synchronising call (a free, an unmap, a module load on the same
/// device) invalidated is taken again: the capture launched nothing, so nothing ran twice.
fn capture(gpu: &Gpu, enqueue: impl Fn() -> Result<()>) -> Result<StepGraph> {
    const TRIES: usize = 3;
    let mut tries = 0;
    loop {
        tries += 1;
        match capture_once(gpu, &enqueue) {
            Err(Capture::Invalidated(e)) if tries < TRIES => eprintln!("lily: CUDA graph capture invalidated ({e}); capturing again"),
            Err(Capture::Invalidated(e) | Capture::Failed(e)) => return Err(e),
            Ok(g) => return Ok(g),
        }
    }
}

/// Captures what `enqueue` launches and updates `into`'s executable graph to it
/// (`cuGraphExecUpdate`: the same kernels and launch shapes, other parameters), which costs the
/// capture and the update but not an instantiation and upload. `Ok(false)` when the driver
/// refuses the update (another topology); `into` is then left as the driver leaves it and must
/// be dropped, as after an error.
fn recapture(gpu: &Gpu, into: &mut StepGraph, enqueue: impl Fn() -> Result<()>) -> Result<bool> {
    use cudarc::driver::result;
    use cudarc::driver::sys::{CUresult, CUstreamCaptureMode};
    let st = &gpu.stream;
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow!("begin capture: {e:?}"))?;
    if let Some(t) = gpu.timeline() {
        t.begin_capture();
    }
    let enq = enqueue();
    // SAFETY: the stream is capturing: begun above on this thread (thread-local mode).
    let graph = unsafe { result::stream::end_capture(st.cu_stream()) };
    let timeline = gpu.timeline().map(|t| (t.clone(), t.end_capture()));
    let graph = match (enq, graph) {
        (Ok(()), Ok(g)) if !g.is_null() => g,
        (enq, graph) => {
            if let Ok(g) = &graph {
                if !g.is_null() {
                    // SAFETY: a graph this function ended and nothing else holds.
                    let _ = unsafe { result::graph::destroy(*g) };
                }
            }
            bail!("recapture: {:?} / {:?}", enq.err(), graph.err());
        }
    };
    // SAFETY: zeroed is a valid CUgraphExecUpdateResultInfo (a result code and two null nodes),
    // which the driver fills.
    let mut info: cudarc::driver::sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    // SAFETY: `into` owns a live executable graph and `graph` is the complete capture above.
    let r = unsafe { cudarc::driver::sys::cuGraphExecUpdate_v2(into.graph.cu_graph_exec(), graph, &mut info) };
    // SAFETY: the executable graph does not refer to the graph it was updated from.
    let _ = unsafe { result::graph::destroy(graph) };
    if r != CUresult::CUDA_SUCCESS {
        return Ok(false);
    }
    into.timeline = timeline;
    Ok(true)
}

enum Capture {
    /// Ended by `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: something outside the capture broke it.
    Invalidated(anyhow::Error),
    Failed(anyhow::Error),
}

fn capture_once(gpu: &Gpu, enqueue: &impl Fn() -> Result<()>) -> std::result::Result<StepGraph, Capture> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
    let st = &gpu.stream;
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| Capture::Failed(anyhow!("begin capture: {e:?}")))?;
    if let Some(t) = gpu.timeline() {
        t.begin_capture();
    }
    let enq = enqueue();
    let graph = st.end_capture(CUgraphInstantiate_flags(0));
    let timeline = gpu.timeline().map(|t| (t.clone(), t.end_capture()));
    match (enq, graph) {
        (Ok(()), Ok(Some(graph))) => Ok(StepGraph { graph, timeline }),
        (enq, graph) => {
            let invalidated = matches!(&graph, Err(e) if e.0 == CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            let e = anyhow!("{:?} / {:?}", enq.err(), graph.err());
            Err(if invalidated { Capture::Invalidated(e) } else { Capture::Failed(e) })
        }
    }
}

/// Prompt tokens of [`CudaBackend`]'s warm-up: past `options::CUBLAS_MIN_TOKENS` and
/// `moe::TCB_PREFILL_TOKENS`, so its prefill takes the long chunks' routes (cuBLAS loads on its
/// first GEMM; the wgmma expert kernels).
const WARM_UP_PROMPT: usize = 1024;

/// Graphs kept at once (a prefix cache holds a few live sequences).
const MAX_GRAPHS: usize = 8;

/// What a captured decode step of `seq` bakes in: the sequence's addresses
/// ([`CudaSequence::binding`]) and the options `decode::enqueue` reads, which tests change between
/// calls.
fn step_key(seq: &CudaSequence, opts: &CudaOptions) -> Vec<u64> {
    let mut k = seq.binding();
    k.extend([opts.gemv_tc_min_tiles as u64, opts.force_cuda_core_moe as u64]);
    k
}

/// One-line reason why the CUDA backend cannot run here, or None when it can (cheap: no kernel
/// compilation, no weights).
pub fn unavailable_reason(device: usize) -> Option<String> {
    if !device::driver_available() {
        return Some("no NVIDIA driver found".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n as usize > device => {}
        Ok(0) => return Some("no GPU visible to the NVIDIA driver".into()),
        Ok(n) => return Some(format!("GPU {device} was asked for, but {n} GPU(s) are visible")),
        Err(e) => return Some(format!("CUDA driver not usable: {e:?}")),
    }
    match cudarc::driver::CudaContext::new(device).and_then(|c| c.compute_capability()) {
        Ok((9, 0)) => {}
        Ok((a, b)) => return Some(format!("GPU {device} has compute capability {a}.{b}; the CUDA backend needs sm_90 (H100/H200)")),
        Err(e) => return Some(format!("cannot open GPU {device}: {e:?}")),
    }
    if !nvrtc::nvrtc_available() {
        return Some("libnvrtc (CUDA 13) not found; set LD_LIBRARY_PATH to the CUDA lib64".into());
    }
    None
}

/// Why the CUDA backend cannot run this model's shapes, if it cannot.
fn unsupported_shapes(cfg: &ModelConfig) -> Option<String> {
    if !gdn::step_supported(&gdn::GdnDims::new(cfg)) {
        return Some(format!("GDN head dims {}x{} are not supported by the CUDA backend", cfg.linear_key_head_dim, cfg.linear_value_head_dim));
    }
    if attention::select_split(cfg.head_dim, false).is_none() {
        return Some(format!("attention head_dim {} is not supported by the CUDA backend (64, 128 or 256)", cfg.head_dim));
    }
    if cfg.num_experts > 512 || cfg.num_experts_per_tok > 16 || cfg.num_experts_per_tok > cfg.num_experts {
        return Some(format!(
            "{} experts / top-{} is not supported by the CUDA backend (at most 512 / 16)",
            cfg.num_experts, cfg.num_experts_per_tok
        ));
    }
    None
}

impl CudaBackend {
    /// The backend with the options of the environment ([`CudaOptions::from_env`]).
    pub fn new(ck: &Checkpoint) -> Result<Self> {
        Self::with_options(ck, CudaOptions::from_env())
    }

    pub fn with_options(ck: &Checkpoint, opts: CudaOptions) -> Result<Self> {
        let mut gpu = Gpu::open(opts.device, opts.pdl)?;
        if opts.timeline {
            gpu.enable_timeline()?;
        }
        let mw = ModelWeights::from_checkpoint(ck)?;
        let cfg = mw.config.clone();
        if let Some(why) = unsupported_shapes(&cfg) {
            bail!(why);
        }
        gpu.load_all()?;
        let frag_experts = moe::fragment_order_experts(&moe::MoeDims::new(&cfg), opts.force_cuda_core_moe);
        let mut w = DevWeights::upload(&gpu, &mw, ck.total_bytes(), frag_experts)?;
        let blas = if opts.cublas { blas::Blas::open(&gpu.stream) } else { None };
        if blas.is_some() {
            w.keep_dense_bf16(&gpu, cfg.quant.group_size, opts.memory_fraction)?;
        }
        let decoder = Decoder::new(&gpu, &cfg, &w)?;
        let mem = SequenceMemory::new(gpu.ctx.clone(), gpu.stream.clone(), gpu.device_copy()?, state::layout(&cfg, opts.gdn_state_f16).1, opts.memory_fraction, opts.sequence_memory_cap)?;
        gpu.sync()?;
        Ok(CudaBackend {
            use_graphs: opts.graphs,
            profile: opts.profile.then(DecodeProfile::default),
            gpu,
            cfg,
            w,
            opts,
            decoder,
            mem,
            chunk_buffers: None,
            blas,
            graphs: Vec::new(),
            graph_updates: 0,
            batcher: None,
            readback: None,
            batch_readback: None,
        })
    }

    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn enqueue_step(&self, seq: &CudaSequence, splits: usize, out: StepOut, probe: &mut Probe) -> Result<()> {
        decode::enqueue(&self.gpu, &self.cfg, &self.opts, &self.w, &self.decoder, seq, splits, out, probe)
    }

    /// Runs one decode step of `seq` (step buffer already written) through its CUDA graph,
    /// capturing it on first use; falls back to direct launches if capture fails.
    fn run_step(&mut self, seq: &CudaSequence, out: StepOut) -> Result<()> {
        let splits = attention::splits_for(seq.max_seq);
        if let Some(p) = self.profile.as_mut() {
            p.steps += 1;
            // Hold the stream for a few ms so the host queues the whole step before the GPU
            // starts: the events then time the kernels back to back, not the host's launch rate.
            sampling::spin_us(&self.gpu, 20_000)?;
            let mut probe = Probe::profiling(true);
            self.enqueue_step(seq, splits, out, &mut probe)?;
            let phases = probe.phase_ms(&self.gpu)?;
            self.profile.as_mut().expect("profiling").add(&phases);
            return Ok(());
        }
        if !self.use_graphs {
            return self.enqueue_step(seq, splits, out, &mut Probe::default());
        }
        let key = step_key(seq, &self.opts);
        if let Some(i) = self.graphs.iter().position(|(k, o, _, _)| *k == key && *o == out) {
            // The graph a steady stream of requests replays stays the last to be evicted.
            let hit = self.graphs.remove(i);
            hit.3.launch()?;
            self.graphs.push(hit);
            return Ok(());
        }
        // With every place taken, the least recently used graph of the same kernels and launch
        // shapes becomes this sequence's: its executable graph takes the new capture's parameters
        // (each new request of a server that keeps finished sequences as prefix-cache snapshots is
        // a new set of addresses). Refused or failed, it goes, and the step is captured anew.
        if self.graphs.len() >= MAX_GRAPHS {
            if let Some(i) = self.graphs.iter().position(|(_, o, s, _)| *o == out && *s == splits) {
                let (_, _, _, mut g) = self.graphs.remove(i);
                if let Ok(true) = recapture(&self.gpu, &mut g, || self.enqueue_step(seq, splits, out, &mut Probe::default())) {
                    g.launch()?;
                    self.graphs.push((key, out, splits, g));
                    self.graph_updates += 1;
                    return Ok(());
                }
            }
        }
        match capture(&self.gpu, || self.enqueue_step(seq, splits, out, &mut Probe::default())) {
            Ok(g) => {
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.remove(0);
                }
                g.launch()?;
                self.graphs.push((key, out, splits, g));
                Ok(())
            }
            Err(e) => {
                eprintln!("lily: CUDA graph capture failed ({e:#}); launching kernels directly");
                self.use_graphs = false;
                self.enqueue_step(seq, splits, out, &mut Probe::default())
            }
        }
    }

    /// The batched prefill of `tokens` at the sequence's position (validated by the caller).
    fn prefill(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let pos = seq.len();
        let out = self.prefill_run(&[prefill::Piece { seq: seq.state::<CudaSequence>(), pos, tokens }], wanted)?;
        seq.advance(tokens.len());
        Ok(out)
    }

    /// One prefill call over `pieces` (validated by the caller; see `prefill::Prefill::run`).
    fn prefill_run(&mut self, pieces: &[prefill::Piece], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let run = prefill_call(&self.gpu, &self.cfg, &self.w, self.blas.as_ref(), &self.opts);
        run.run(&mut self.chunk_buffers, pieces, wanted)
    }

    /// Queues the prefill of `feed` (two tokens or more) and, on its last row, the decode step's
    /// head and token choice (`out`), which write the first token and its position into the step
    /// buffer as a step would. The sequence is left one short of the feed, as if its last token
    /// were a step in flight: reading the token advances it.
    fn prefill_and_choose(&mut self, seq: &mut Sequence, feed: &[u32], out: StepOut) -> Result<()> {
        self.check_tokens(seq, feed)?;
        let pos = seq.len();
        let last = pos + feed.len() - 1;
        let run = prefill_call(&self.gpu, &self.cfg, &self.w, self.blas.as_ref(), &self.opts);
        let st = seq.state::<CudaSequence>();
        let row = run.run_to_last_row(&mut self.chunk_buffers, &prefill::Piece { seq: st, pos, tokens: feed })?;
        // The step buffer: the feed's last token and position, which the choice advances.
        let st = seq.state_mut::<CudaSequence>();
        decode::upload_step(&self.gpu, st, feed[feed.len() - 1], last)?;
        decode::finish_from_row(&self.gpu, &self.cfg, &self.opts, &self.w, &mut self.decoder, st, &row, out)?;
        seq.advance(feed.len() - 1);
        Ok(())
    }

    /// Single tokens, and models whose shapes the prefill kernels do not cover (or
    /// `opts.decode_forward`): the decode step per token.
    fn forward_per_token(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = seq.len();
            let last = i + 1 == tokens.len();
            let want_logits = matches!(wanted, LogitsWanted::All) || (last && wanted == LogitsWanted::Last);
            let st = seq.state_mut::<CudaSequence>();
            decode::upload_step(&self.gpu, st, tok, pos)?;
            self.run_step(st, if want_logits { StepOut::Logits } else { StepOut::None })?;
            if want_logits {
                out.extend(self.decoder.read_logits(&self.gpu)?);
            }
            seq.advance(1);
        }
        Ok(out)
    }

    /// Whether `n` tokens of a sequence go through the batched prefill (else the decode step per
    /// token): more than one, on a model whose shapes the prefill kernels take, unless
    /// `opts.decode_forward`.
    fn prefills(&self, n: usize) -> bool {
        n > 1 && prefill::supported(&self.cfg) && !self.opts.decode_forward
    }

    /// Checks tokens and room before a forward, and maps the KV pages it writes.
    fn check_tokens(&self, seq: &mut Sequence, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let vocab = self.cfg.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary ({vocab} entries)");
        }
        seq.check_room(tokens.len())?;
        let end = seq.len() + tokens.len();
        seq.state_mut::<CudaSequence>().grow(end)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kv_bf16(&self) -> bool {
        self.opts.kv_bf16
    }

    /// A prompt of [`WARM_UP_PROMPT`] tokens through the prefill (cuBLAS loads on the first GEMM
    /// of a long enough chunk, the prefill scratch is allocated) and one decode step; then the
    /// batch buffers at their final capacity and the batch steps captured
    /// (`capture_batch_steps`), so the first requests pay for none of it (docs/server.md).
    fn warm_up(&mut self, max_batch: usize) -> Result<Option<String>> {
        let t0 = std::time::Instant::now();
        let vocab = self.cfg.vocab_size as u32;
        let prompt: Vec<u32> = (0..WARM_UP_PROMPT as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let mut seq = self.new_sequence(WARM_UP_PROMPT + 1)?;
        self.forward(&mut seq, &prompt, LogitsWanted::Last)?;
        self.forward(&mut seq, &prompt[..1], LogitsWanted::Last)?;
        drop(seq);
        let w = self.capture_batch_steps(max_batch)?;
        Ok(Some(format!(
            "warmed up in {:.1}s: a {WARM_UP_PROMPT}-token prefill and a decode step, the batch buffers of {} rows ({} MiB), {} batch step graphs ({} MiB)",
            t0.elapsed().as_secs_f64(),
            w.rows,
            w.buffer_bytes >> 20,
            w.graphs,
            w.graph_bytes >> 20
        )))
    }

    /// `true` stores K and V rounded to bf16, as the CPU backend does with the same setting.
    fn set_kv_bf16(&mut self, bf16: bool) {
        self.opts.kv_bf16 = bf16;
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        let (free, total) = self.gpu.mem_info().ok()?;
        Some(((total - free) as u64, total as u64))
    }

    fn sequence_memory(&self) -> Option<SequenceMemoryReport> {
        Some(self.mem.report())
    }

    fn default_host_tier_bytes(&self) -> usize {
        hostmem::default_tier_bytes()
    }

    fn prepare_host_copies(&self, bytes: usize) {
        let t0 = std::time::Instant::now();
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        match self.mem.pinned().warm(bytes) {
            Ok(b) => eprintln!("lily: pinned {:.1} GiB of host memory for the prefix cache's host tier in {:.1}s", gib(b), t0.elapsed().as_secs_f64()),
            Err(e) => eprintln!("lily: pinning host memory for the prefix cache stopped: {e:#}"),
        }
    }

    /// The batch GEMMs' row limit, or fewer when the sequence memory budget cannot hold that
    /// many sequences at their smallest.
    fn batch_capacity(&self) -> usize {
        let regions = state::kv_regions(&state::layout(&self.cfg, self.opts.gdn_state_f16).0);
        let fits = self.mem.report().budget_bytes as usize / self.mem.sequence_floor_bytes(regions).max(1);
        batch::MAX_BATCH.min(fits).max(1)
    }

    /// A state slot and the KV address space of `max_seq` tokens; KV pages are mapped as the
    /// sequence grows.
    fn new_sequence(&self, max_seq: usize) -> Result<Sequence> {
        let st = CudaSequence::new(&self.gpu, &self.mem, &self.cfg, max_seq, self.opts.kv_bf16, self.opts.gdn_state_f16)?;
        Ok(Sequence::new(max_seq, Box::new(st)))
    }

    fn restore_sequence(&self, host: &HostSequence) -> Result<Sequence> {
        let Some(h) = host.data.downcast_ref::<state::CudaHostState>() else {
            bail!("the host copy of a sequence came from another backend");
        };
        let st = CudaSequence::from_host(&self.gpu, &self.mem, &self.cfg, host.max_seq, host.len, h)?;
        let mut seq = Sequence::new(host.max_seq, Box::new(st));
        seq.advance(host.len);
        Ok(seq)
    }

    fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        self.check_tokens(seq, tokens)?;
        if self.prefills(tokens.len()) {
            self.prefill(seq, tokens, wanted)
        } else {
            self.forward_per_token(seq, tokens, wanted)
        }
    }

    /// The pieces that pass `check_tokens` go through one prefill call (several sequences' rows
    /// in each chunk); a failure of that call fails each of them.
    fn prefill_pieces(&mut self, pieces: &mut [PrefillPiece]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = Vec::with_capacity(pieces.len());
        let mut ok = Vec::new();
        for (i, p) in pieces.iter_mut().enumerate() {
            // What `forward` would not prefill (a single token, say) takes its path.
            if !self.prefills(p.tokens.len()) {
                results.push(self.forward(p.seq, p.tokens, LogitsWanted::None).map(|_| ()));
                continue;
            }
            let r = self.check_tokens(p.seq, p.tokens);
            if r.is_ok() {
                ok.push(i);
            }
            results.push(r);
        }
        if ok.is_empty() {
            return results;
        }
        let run = {
            let views: Vec<prefill::Piece> = ok.iter().map(|&i| prefill::Piece { seq: pieces[i].seq.state::<CudaSequence>(), pos: pieces[i].seq.len(), tokens: pieces[i].tokens }).collect();
            self.prefill_run(&views, LogitsWanted::None)
        };
        for &i in &ok {
            match &run {
                Ok(_) => pieces[i].seq.advance(pieces[i].tokens.len()),
                Err(e) => results[i] = Err(anyhow!("{e:#}")),
            }
        }
        results
    }

    /// Greedy decode with the token kept on the device: each step's graph ends with
    /// `argmax_next`, which writes the next token and position into the step buffer (see
    /// [`CudaBackend::device_loop`]).
    fn decode_greedy(&mut self, seq: &mut Sequence, first_token: u32, steps: usize, on_token: &mut dyn TokenSink) -> Result<usize> {
        self.device_loop(seq, Start::Token(first_token), steps, StepOut::Greedy, on_token)
    }

    /// Sampled decode on the device: the snapshot's parameters, seed and counts are loaded once,
    /// then each step's graph ends with the device sampler (sampling.rs); plain greedy snapshots
    /// take the argmax path.
    fn decode_sampled(&mut self, seq: &mut Sequence, first_token: u32, steps: usize, snap: &SamplerSnapshot, on_token: &mut dyn TokenSink) -> Result<usize> {
        let out = self.load_sampler(snap)?;
        self.device_loop(seq, Start::Token(first_token), steps, out, on_token)
    }

    /// A feed the prefill takes goes through it, and the decode step's head and token choice
    /// run on its last row (`decode::finish_from_row`), queued behind it like a step: the first
    /// token costs no decode step, and the steps after it stay pipelined.
    fn decode_after(&mut self, seq: &mut Sequence, feed: &[u32], steps: usize, snap: Option<&SamplerSnapshot>, on_token: &mut dyn TokenSink) -> Result<usize> {
        if !self.prefills(feed.len()) {
            return super::decode_after_forward(self, seq, feed, steps, snap, on_token);
        }
        let out = match snap {
            None => StepOut::Greedy,
            Some(s) => self.load_sampler(s)?,
        };
        self.device_loop(seq, Start::Prompt(feed), steps, out, on_token)
    }

    /// Batched decode through the batch GEMMs, per-row mixers and device token choice
    /// (batch.rs), one CUDA graph per batch shape; the next step is queued before a step's
    /// tokens are read where the hooks allow it.
    fn decode_batch(&mut self, rows: &mut [BatchRow], hooks: &mut dyn StepHooks) -> Result<Vec<usize>> {
        self.batch_decode(rows, hooks)
    }
}

/// The prefill of a backend with these weights and options.
fn prefill_call<'a>(gpu: &'a Gpu, cfg: &'a ModelConfig, w: &'a DevWeights, blas: Option<&'a blas::Blas>, opts: &CudaOptions) -> prefill::Prefill<'a> {
    prefill::Prefill {
        gpu,
        cfg,
        w,
        blas,
        cublas_min_tokens: opts.cublas_min_tokens,
        tcb_prefill_tokens: opts.tcb_prefill_tokens,
        fuse_combine_norm: opts.fuse_combine_norm,
        chunk: opts.prefill_chunk,
        exact: opts.exact_prefill,
        gdn_state_f16: opts.gdn_state_f16,
        profile: opts.profile,
    }
}

/// What a pipelined decode's step 0 feeds.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// One token, as a decode step.
    Token(u32),
    /// Tokens through the prefill, the first token chosen from its last row.
    Prompt(&'a [u32]),
}

impl CudaBackend {
    /// The device token choice for a sampling snapshot, its state loaded where it samples.
    fn load_sampler(&mut self, snap: &SamplerSnapshot) -> Result<StepOut> {
        snap.params.validate().map_err(|e| anyhow::anyhow!(e))?;
        let out = match sampling::select(snap) {
            sampling::TokenChoice::Argmax => StepOut::Greedy,
            sampling::TokenChoice::Sample => StepOut::Sample,
            sampling::TokenChoice::SampleSmallK => StepOut::SampleSmallK,
        };
        if out != StepOut::Greedy {
            self.decoder.scratch.sample.load(&self.gpu, &[snap])?;
        }
        Ok(out)
    }

    /// Decoding with the token kept on the device (`out`: the step ends with the argmax or the
    /// sampler, which write the next token and position into the step buffer), so step N+1 is
    /// queued right behind step N; the 8-byte step buffer is copied to a pinned host slot after
    /// each step (two slots, one event each) and step N's token is read only after step N+1 has
    /// been submitted.
    fn device_loop(&mut self, seq: &mut Sequence, start: Start, steps: usize, out: StepOut, on_token: &mut dyn TokenSink) -> Result<usize> {
        if steps == 0 {
            return Ok(0);
        }
        let fed = match start {
            Start::Token(t) if t as usize >= self.cfg.vocab_size => bail!("token id {t} is outside the vocabulary"),
            Start::Token(_) => 1,
            Start::Prompt(feed) => feed.len(),
        };
        seq.check_room(fed - 1 + steps)?;
        if self.readback.is_none() {
            self.readback = Some(Readback::pair(&self.gpu, 2)?);
        }
        let mut rb = self.readback.take().expect("allocated above");
        let r = self.pipelined_steps(seq, start, steps, out, on_token, &mut rb);
        self.readback = Some(rb);
        if r.is_err() {
            // A step may still be in flight: it must be done before the caller frees what it reads.
            let _ = self.gpu.sync();
        }
        r
    }

    fn pipelined_steps(
        &mut self,
        seq: &mut Sequence,
        start: Start,
        steps: usize,
        out: StepOut,
        on_token: &mut dyn TokenSink,
        rb: &mut [Readback; 2],
    ) -> Result<usize> {
        let submit = |b: &mut Self,
                      seq: &mut Sequence,
                      slot: &mut Readback|
         -> Result<()> {
            let st = seq.state_mut::<CudaSequence>();
            b.run_step(st, out)?;
            slot.enqueue(&b.gpu, &st.step, st.step.len())
        };
        // Before a step is queued, the page its position writes is mapped (pages below the
        // sequence's length stay in place, so mapping never disturbs the steps in flight).
        let grow = |seq: &mut Sequence, fed: usize| -> Result<()> { seq.state_mut::<CudaSequence>().grow(fed) };
        // Step 0 feeds the token at `pos0` (the sequence's length until its token is read).
        let pos0 = match start {
            Start::Token(first_token) => {
                let pos0 = seq.len();
                grow(seq, pos0 + 1)?;
                decode::upload_step(&self.gpu, seq.state_mut::<CudaSequence>(), first_token, pos0)?;
                submit(self, seq, &mut rb[0])?;
                pos0
            }
            Start::Prompt(feed) => {
                self.prefill_and_choose(seq, feed, out)?;
                let st = seq.state::<CudaSequence>();
                rb[0].enqueue(&self.gpu, &st.step, st.step.len())?;
                seq.len()
            }
        };
        // Growth that fails (the memory budget) ends the loop after the steps already queued:
        // their tokens are delivered, then the error is returned.
        let mut stalled: Option<anyhow::Error> = None;
        // Queues step i + 1 (it feeds token i, on the device whether read yet or not) into the
        // other readback slot; whether it was queued.
        let queue_next = |b: &mut Self, seq: &mut Sequence, rb: &mut [Readback; 2], i: usize, stalled: &mut Option<anyhow::Error>| -> Result<bool> {
            if i + 1 >= steps || stalled.is_some() {
                return Ok(false);
            }
            if let Err(e) = grow(seq, pos0 + i + 2) {
                *stalled = Some(e);
                return Ok(false);
            }
            submit(b, seq, &mut rb[(i + 1) % 2])?;
            Ok(true)
        };
        for i in 0..steps {
            // Step i + 1 is queued before token i is read where the sink allows it (two steps in
            // flight), else once the sink took token i without stopping.
            let ahead = i + 1 < steps && stalled.is_none() && on_token.queue_ahead();
            let queued = ahead && queue_next(self, seq, rb, i, &mut stalled)?;
            let v = rb[i % 2].wait(2)?;
            let (tok, next_pos) = (v[0], v[1]);
            seq.advance(1);
            if next_pos as usize != pos0 + i + 1 || tok < 0 || tok as usize >= self.cfg.vocab_size
            {
                bail!("device step buffer out of sync (token {tok}, position {next_pos})");
            }
            if !on_token.token(tok as u32) {
                if queued {
                    // Step i + 1 already fed this token.
                    self.gpu.sync()?;
                    seq.advance(1);
                }
                return Ok(i + 1);
            }
            if !ahead {
                queue_next(self, seq, rb, i, &mut stalled)?;
            }
            if let Some(e) = stalled.take() {
                return Err(e);
            }
        }
        Ok(steps)
    }
}
