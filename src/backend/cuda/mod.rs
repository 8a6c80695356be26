//! CUDA backend for Hopper (sm_90): the whole decode step on the GPU with hand-written kernels
//! (`kernels/*.cu`, compiled by NVRTC at start-up, cached on disk), reading the MLX 4-bit
//! weights directly.
//!
//! Decode (T = 1) runs fully on the device as one CUDA graph, one kernel per fused phase (~7 per
//! layer); greedy decoding keeps the token on the device and pipelines two steps
//! (`decode_greedy`). Prefill (T > 1) runs whole chunks per layer (`prefill.rs`: grouped 4-bit
//! GEMMs, register-resident GDN scan, flash attention, GPU-side MoE routing). See docs/cuda.md and
//! docs/cuda-prefill.md.

pub mod blas;
pub mod context;
pub mod decode;
pub mod kernels;
pub mod prefill;
pub mod state;
pub mod weights;

use super::{Backend, LogitsWanted, Sequence};
use crate::checkpoint::{Checkpoint, ModelConfig};
use crate::model::ModelWeights;
use anyhow::{bail, Result};
pub use context::Gpu;
use decode::{Scratch, StepOut};
use state::CudaSequence;
use weights::DevWeights;

pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    pub(crate) cfg: ModelConfig,
    pub(crate) w: DevWeights,
    pub(crate) scratch: Scratch,
    /// Captured decode steps, keyed by (sequence id, what the step produces).
    graphs: Vec<(u64, StepOut, StepGraph)>,
    /// Pinned host slots the greedy decode loop reads tokens back through (depth 2).
    readback: Option<[Readback; 2]>,
    /// False after a capture failed (then every step launches directly) or with LILY_CUDA_GRAPH=0.
    use_graphs: bool,
    /// LILY_CUDA_PROFILE=1: direct launches with an event after every phase; per-phase GPU time
    /// is accumulated here and printed when the backend is dropped.
    profile: Option<Profile>,
    /// Prefill GEMM/attention precision: false = bf16 tensor cores (the default), true = the
    /// f32 FMA kernels that agree with the CPU reference to rounding (LILY_PREFILL_F32=1 at
    /// start-up, or [`CudaBackend::set_exact_prefill`]).
    pub(crate) exact_prefill: bool,
    /// Tokens per prefill chunk (`LILY_CUDA_PREFILL_CHUNK`, default [`prefill::DEFAULT_CHUNK`]).
    prefill_chunk: usize,
    /// Verification knob (`LILY_CUDA_DECODE_FORWARD=1`): multi-token forwards run the decode
    /// step once per token instead of the prefill kernels, so `lily logits` measures the decode
    /// kernels on a full-size checkpoint against transformers (scripts/device_accuracy.sh).
    decode_forward: bool,
    /// Attention KV cache element type of new sequences: bf16 (half the memory and half the
    /// long-context attention traffic) or f32. `LILY_KV_BF16=1` at start-up, or
    /// [`CudaBackend::set_kv_bf16`].
    kv_bf16: bool,
}

#[derive(Default)]
struct Profile {
    steps: usize,
    /// (phase, total ms), in first-seen order.
    phases: Vec<(&'static str, f64)>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            if p.steps == 0 {
                return;
            }
            let total: f64 = p.phases.iter().map(|(_, t)| t).sum();
            eprintln!(
                "lily: CUDA profile over {} steps (direct launches, {:.3} ms/step):",
                p.steps,
                total / p.steps as f64
            );
            for (name, t) in &p.phases {
                eprintln!(
                    "  {name:<14} {:>9.1} us/step  {:>5.1}%",
                    1000.0 * t / p.steps as f64,
                    100.0 * t / total
                );
            }
        }
    }
}

/// One pinned host slot of the greedy loop and the event recorded after its copy (our own event:
/// event tracking is off, so the slice's built-in event is never recorded).
struct Readback {
    host: cudarc::driver::PinnedHostSlice<i32>,
    done: cudarc::driver::CudaEvent,
}

/// A captured decode step. CUDA graphs may be launched from any thread as long as calls are not
/// concurrent; the backend is used through `&mut self`, which serialises them.
struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: see above: only launched through `&mut CudaBackend`.
unsafe impl Send for StepGraph {}

/// Graphs kept at once (a prefix cache holds a few live sequences).
const MAX_GRAPHS: usize = 8;

/// One-line reason why the CUDA backend cannot run here, or None when it can (cheap: no kernel
/// compilation, no weights).
pub fn unavailable_reason() -> Option<String> {
    if !context::driver_available() {
        return Some("no NVIDIA driver found".into());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n >= 1 => {}
        Ok(_) => return Some("no GPU visible to the NVIDIA driver".into()),
        Err(e) => return Some(format!("CUDA driver not usable: {e:?}")),
    }
    match cudarc::driver::CudaContext::new(0).and_then(|c| c.compute_capability()) {
        Ok((9, 0)) => {}
        Ok((a, b)) => {
            return Some(format!(
                "GPU 0 has compute capability {a}.{b}; the CUDA backend needs sm_90 (H100/H200)"
            ))
        }
        Err(e) => return Some(format!("cannot open GPU 0: {e:?}")),
    }
    if !context::nvrtc_available() {
        return Some("libnvrtc (CUDA 13) not found; set LD_LIBRARY_PATH to the CUDA lib64".into());
    }
    None
}

impl CudaBackend {
    pub fn new(ck: &Checkpoint) -> Result<Self> {
        let gpu = Gpu::open()?;
        let mw = ModelWeights::from_checkpoint(ck)?;
        let cfg = mw.config.clone();
        if cfg.linear_key_head_dim % 32 != 0
            || cfg.linear_value_head_dim * (cfg.linear_key_head_dim / 32) > 1024
        {
            bail!(
                "GDN head dims {}x{} are not supported by the CUDA backend",
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim
            );
        }
        if ![64, 128, 256].contains(&cfg.head_dim) {
            bail!(
                "attention head_dim {} is not supported by the CUDA backend (64, 128 or 256)",
                cfg.head_dim
            );
        }
        if cfg.num_experts > 512
            || cfg.num_experts_per_tok > 16
            || cfg.num_experts_per_tok > cfg.num_experts
        {
            bail!(
                "{} experts / top-{} is not supported by the CUDA backend (at most 512 / 16)",
                cfg.num_experts,
                cfg.num_experts_per_tok
            );
        }
        let w = DevWeights::upload(&gpu, &mw, ck.total_bytes())?;
        let scratch = Scratch::new(&gpu, &cfg, &w)?;
        gpu.sync()?;
        let use_graphs = std::env::var("LILY_CUDA_GRAPH")
            .map(|v| v != "0")
            .unwrap_or(true);
        let profile = std::env::var("LILY_CUDA_PROFILE")
            .is_ok_and(|v| v == "1")
            .then(Profile::default);
        Ok(CudaBackend {
            gpu,
            cfg,
            w,
            scratch,
            graphs: Vec::new(),
            readback: None,
            use_graphs,
            profile,
            exact_prefill: prefill::exact_from_env(),
            prefill_chunk: prefill::chunk_from_env(),
            decode_forward: std::env::var("LILY_CUDA_DECODE_FORWARD").is_ok_and(|v| v == "1"),
            // bf16 by default: half the KV traffic of long-context decode (+30% decode at 131K on
            // the H200, docs/cuda.md); LILY_KV_BF16=0 keeps f32.
            kv_bf16: crate::backend::kv_bf16_from_env(true),
        })
    }

    /// Chooses the prefill precision: `true` for the f32 kernels (exact to rounding against the
    /// CPU backend, ~3x slower), `false` for the bf16 tensor-core kernels.
    pub fn set_exact_prefill(&mut self, exact: bool) {
        self.exact_prefill = exact;
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Runs one decode step of `seq` (step buffer already written) through its CUDA graph,
    /// capturing it on first use; falls back to direct launches if capture fails.
    fn run_step(&mut self, seq: &CudaSequence, logits: StepOut) -> Result<()> {
        let splits = decode::splits_for(&self.gpu, seq.max_seq);
        if self.profile.is_some() {
            // Hold the stream for a few ms so the host queues the whole step before the GPU
            // starts: the events then time the kernels back to back, not the host's launch rate.
            kernels::spin_us(&self.gpu, 20_000)?;
            let mut marks = Vec::new();
            decode::enqueue(self, seq, splits, logits, None, Some(&mut marks))?;
            self.gpu.sync()?;
            let p = self.profile.as_mut().unwrap();
            p.steps += 1;
            for w in marks.windows(2) {
                let ms = w[0]
                    .1
                    .elapsed_ms(&w[1].1)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))? as f64;
                match p.phases.iter_mut().find(|(n, _)| *n == w[1].0) {
                    Some(e) => e.1 += ms,
                    None => p.phases.push((w[1].0, ms)),
                }
            }
            return Ok(());
        }
        if !self.use_graphs {
            return decode::enqueue(self, seq, splits, logits, None, None);
        }
        if let Some(i) = self
            .graphs
            .iter()
            .position(|(id, l, _)| *id == seq.id && *l == logits)
        {
            return self.graphs[i]
                .2
                 .0
                .launch()
                .map_err(|e| anyhow::anyhow!("CUDA graph launch failed: {e:?}"));
        }
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let st = self.gpu.stream.clone();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow::anyhow!("begin capture: {e:?}"))?;
        let enq = decode::enqueue(self, seq, splits, logits, None, None);
        let graph = st.end_capture(CUgraphInstantiate_flags(0));
        match (enq, graph) {
            (Ok(()), Ok(Some(g))) => {
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.remove(0);
                }
                g.launch()
                    .map_err(|e| anyhow::anyhow!("CUDA graph launch failed: {e:?}"))?;
                self.graphs.push((seq.id, logits, StepGraph(g)));
                Ok(())
            }
            (enq, graph) => {
                eprintln!(
                    "lily: CUDA graph capture failed ({:?} / {:?}); launching kernels directly",
                    enq.err(),
                    graph.err()
                );
                self.use_graphs = false;
                decode::enqueue(self, seq, splits, logits, None, None)
            }
        }
    }

    /// Test hook: runs one token and returns the residual stream after every layer and the
    /// logits (synchronous; for parity tests against the CPU backend).
    pub fn forward_traced(
        &mut self,
        seq: &mut Sequence,
        token: u32,
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
        if token as usize >= self.cfg.vocab_size {
            bail!("token id {token} is outside the vocabulary");
        }
        seq.check_room(1)?;
        let pos = seq.len();
        let mut trace = Vec::new();
        decode::step(
            self,
            seq.state_mut::<CudaSequence>(),
            token,
            pos,
            StepOut::Logits,
            Some(&mut trace),
        )?;
        let logits = self.scratch.read_logits(&self.gpu)?;
        seq.advance(1);
        Ok((trace, logits))
    }

    /// Test hook: one quantized matrix times `x` (`gain`: optional RMSNorm of x first), through
    /// the decode GEMV kernel.
    pub fn gemv_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        gain: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        if x.len() != q.cols {
            bail!(
                "gemv_host: x has {} values, matrix has {} columns",
                x.len(),
                q.cols
            );
        }
        let dq = weights::DevQ::upload(gpu, q)?;
        let y = gpu.zeros::<f32>(q.rows)?;
        let xd = gpu.upload(x)?;
        let gd = match gain {
            Some(g) => Some(gpu.upload(g)?),
            None => None,
        };
        let (w, s, b) = dq.ptrs(gpu);
        let desc = kernels::QMatDesc {
            w,
            s,
            b,
            y: context::ptr(&y, st),
            rows: q.rows as i32,
            bits: q.bits as i32,
            accumulate: 0,
            pad: 0,
        };
        let dd = gpu.upload(&[desc])?;
        let set = kernels::GemvSet {
            descs: context::ptr(&dd, st),
            count: 1,
            rows: q.rows,
            tiles: q.rows.div_ceil(16),
            all4: q.bits == 4,
        };
        let gp = gd.as_ref().map(|g| context::ptr(g, st)).unwrap_or(0);
        kernels::gemv(
            gpu,
            set,
            context::ptr(&xd, st),
            q.cols,
            gp,
            self.cfg.rms_norm_eps as f32,
            q.group,
            0,
        )?;
        let out = st.clone_dtoh(&y).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        Ok(out)
    }

    /// Test hook: the device argmax (ties -> lowest id) of `logits`.
    pub fn argmax_host(&self, logits: &[f32]) -> Result<u32> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        let l = gpu.upload(logits)?;
        let step = gpu.upload(&[0i32, 0i32])?;
        let part = gpu.zeros::<f32>(2 * kernels::ARGMAX_BLOCKS as usize + 1)?;
        kernels::argmax_next(
            gpu,
            context::ptr(&l, st),
            logits.len(),
            context::ptr(&step, st),
            context::ptr(&part, st),
        )?;
        let v = st.clone_dtoh(&step).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        Ok(v[0] as u32)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kv_bf16(&self) -> bool {
        self.kv_bf16
    }

    /// `true` stores K and V rounded to bf16, as the CPU backend does with the same setting.
    fn set_kv_bf16(&mut self, bf16: bool) {
        self.kv_bf16 = bf16;
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        let (free, total) = self.gpu.mem_info().ok()?;
        Some(((total - free) as u64, total as u64))
    }

    fn new_sequence(&self, max_seq: usize) -> Result<Sequence> {
        let st = CudaSequence::new(&self.gpu, &self.cfg, max_seq, self.kv_bf16)?;
        Ok(Sequence::new(max_seq, Box::new(st)))
    }

    fn forward(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let vocab = self.cfg.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary ({vocab} entries)");
        }
        seq.check_room(tokens.len())?;
        if tokens.len() > 1 && prefill::supported(&self.cfg) && !self.decode_forward {
            return prefill::forward(self, seq, tokens, wanted, self.prefill_chunk);
        }
        let mut out = Vec::new();
        // Single tokens, and shapes the prefill kernels do not cover, run the decode step per token.
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = seq.len();
            let last = i + 1 == tokens.len();
            let want_logits =
                matches!(wanted, LogitsWanted::All) || (last && wanted == LogitsWanted::Last);
            let st = seq.state_mut::<CudaSequence>();
            decode::upload_step(&self.gpu, st, tok, pos)?;
            let mode = if want_logits {
                StepOut::Logits
            } else {
                StepOut::None
            };
            self.run_step(st, mode)?;
            if want_logits {
                out.extend(self.scratch.read_logits(&self.gpu)?);
            }
            seq.advance(1);
        }
        Ok(out)
    }

    /// Greedy decode with the token kept on the device: each step's graph ends with
    /// `argmax_next`, which writes the next token and position into the step buffer, so step
    /// N+1 is queued right behind step N; the 8-byte step buffer is copied to a pinned host slot
    /// after each step (two slots, one event each) and step N's token is read only after step
    /// N+1 has been submitted.
    fn decode_greedy(
        &mut self,
        seq: &mut Sequence,
        first_token: u32,
        steps: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        if steps == 0 {
            return Ok(0);
        }
        if first_token as usize >= self.cfg.vocab_size {
            bail!("token id {first_token} is outside the vocabulary");
        }
        seq.check_room(steps)?;
        if self.readback.is_none() {
            let alloc = || -> Result<Readback> {
                // SAFETY: plain page-locked host memory; only read after its copy's event.
                let host = unsafe { self.gpu.ctx.alloc_pinned_with_flags::<i32>(2, 0) }
                    .map_err(|e| anyhow::anyhow!("pinned host allocation: {e:?}"))?;
                let done = self
                    .gpu
                    .ctx
                    .new_event(None)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                Ok(Readback { host, done })
            };
            self.readback = Some([alloc()?, alloc()?]);
        }
        let mut rb = self.readback.take().unwrap();
        let r = self.greedy_loop(seq, first_token, steps, on_token, &mut rb);
        self.readback = Some(rb);
        r
    }
}

impl CudaBackend {
    fn greedy_loop(
        &mut self,
        seq: &mut Sequence,
        first_token: u32,
        steps: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
        rb: &mut [Readback; 2],
    ) -> Result<usize> {
        let pos0 = seq.len();
        let submit = |b: &mut Self,
                      seq: &mut Sequence,
                      slot: &mut Readback|
         -> Result<()> {
            let st = seq.state_mut::<CudaSequence>();
            b.run_step(st, StepOut::Greedy)?;
            b.gpu
                .stream
                .memcpy_dtoh(&st.step, &mut slot.host)
                .map_err(|e| anyhow::anyhow!("token readback: {e:?}"))?;
            slot.done
                .record(&b.gpu.stream)
                .map_err(|e| anyhow::anyhow!("token readback: {e:?}"))
        };
        decode::upload_step(&self.gpu, seq.state_mut::<CudaSequence>(), first_token, pos0)?;
        let [s0, s1] = rb;
        submit(self, seq, s0)?;
        for i in 0..steps {
            // Queue step i + 1 (it feeds token i, still on the device) before reading token i.
            if i + 1 < steps {
                let slot = if i % 2 == 0 { &mut *s1 } else { &mut *s0 };
                submit(self, seq, slot)?;
            }
            let slot = if i % 2 == 0 { &*s0 } else { &*s1 };
            slot.done
                .synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA error during the forward pass: {e:?}"))?;
            let v = slot
                .host
                .as_slice()
                .map_err(|e| anyhow::anyhow!("CUDA error during the forward pass: {e:?}"))?;
            let (tok, next_pos) = (v[0], v[1]);
            seq.advance(1);
            if next_pos as usize != pos0 + i + 1 || tok < 0 || tok as usize >= self.cfg.vocab_size
            {
                bail!("device step buffer out of sync (token {tok}, position {next_pos})");
            }
            if !on_token(tok as u32) {
                if i + 1 < steps {
                    // Step i + 1 already fed this token.
                    self.gpu.sync()?;
                    seq.advance(1);
                }
                return Ok(i + 1);
            }
        }
        Ok(steps)
    }
}
