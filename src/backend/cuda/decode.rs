//! The decode step (T = 1): per layer, GDN = in-proj GEMV (input norm fused) → gdn_step →
//! out-proj GEMV (+residual); attention = q|k|v GEMV → prep → split-KV → combine → o GEMV
//! (+residual); then MoE = router|shared-gate GEMV (post norm fused) → gate|up + SwiGLU (top-k in
//! the prologue) → down + combine + shared expert (+residual). Token and position come from the
//! sequence's device step buffer, so one captured CUDA graph replays every step.

use super::activations::{Activations, DecodeScratch};
use super::attention::{self, SplitPartials};
use super::device::{ptr, Gpu};
use super::forward::{self, LayerDims, Pass, Point, Probe};
use super::gdn;
use super::moe::{self, MoeKernels, MoePtrs};
use super::options::CudaOptions;
use super::qmatmul::{self, GemvInput, GemvSet, QMatDesc};
use super::sampling;
use super::state::CudaSequence;
use super::weights::{DevAttn, DevGdn, DevLayer, DevMoe, DevQ, DevWeights};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, CudaView};

/// What a decode step produces after the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOut {
    /// Nothing (prefill of a known prefix).
    None,
    /// Final norm + lm_head into the logits.
    Logits,
    /// Logits, then `argmax_next`: the next token and position go into the step buffer.
    Greedy,
    /// Logits, then the device sampler with the loaded parameters, into the step buffer.
    Sample,
    /// `Sample` for rows whose top-k is at most [`sampling::SMALL_K`]: the same token from one
    /// launch (`sample_small_k`).
    SampleSmallK,
}

/// The GEMV sets of one layer.
struct LayerSets {
    mixer_in: GemvSet,
    mixer_out: GemvSet,
    router: GemvSet,
}

/// Buffers of the decode step, owned by the backend, and the GEMV descriptor sets that point
/// into them.
pub struct Decoder {
    pub act: Activations,
    pub scratch: DecodeScratch,
    _descs: CudaSlice<QMatDesc>,
    layers: Vec<LayerSets>,
    head: GemvSet,
}

impl Decoder {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, w: &DevWeights) -> Result<Self> {
        let act = Activations::new(gpu, cfg, 1, 1)?;
        let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
        let sets = forward::model_sets(gpu, w, &act, false, |sets, l| {
            vec![sets.add(gpu, &[(&l.moe.router, p(&act.router), false), (&l.moe.shared_expert_gate, p(&act.sgl), false)])]
        })?;
        let layers = sets.layers.iter().map(|(i, o, more)| LayerSets { mixer_in: *i, mixer_out: *o, router: more[0] }).collect();
        Ok(Decoder { scratch: DecodeScratch::new(gpu, cfg)?, act, _descs: sets.descs, layers, head: sets.head })
    }

    /// Copies the logits to the host (synchronises the stream).
    pub fn read_logits(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        gpu.stream.clone_dtoh(&self.act.logits).map_err(|e| anyhow!("CUDA error during the forward pass: {e:?}"))
    }
}

/// Writes `[token, pos]` into the sequence's device step buffer (read by every kernel of the step).
pub fn upload_step(gpu: &Gpu, seq: &mut CudaSequence, token: u32, pos: usize) -> Result<()> {
    if pos >= seq.max_seq {
        bail!("position {pos} is past the sequence's max-seq {}", seq.max_seq);
    }
    gpu.stream.memcpy_htod(&[token as i32, pos as i32], &mut seq.step).map_err(|e| anyhow!("step upload: {e:?}"))
}

/// The decode launches of one step.
struct DecodePass<'a> {
    gpu: &'a Gpu,
    dec: &'a Decoder,
    w: &'a DevWeights,
    step: u64,
    splits: usize,
    dims: LayerDims,
    moe_kernels: MoeKernels,
    gemv_tc_min_tiles: usize,
}

impl<'a> DecodePass<'a> {
    fn new(gpu: &'a Gpu, cfg: &ModelConfig, opts: &CudaOptions, w: &'a DevWeights, dec: &'a Decoder, seq: &CudaSequence, splits: usize) -> Self {
        let dims = LayerDims::new(cfg, seq.kv_bf16, seq.gdn_state_f16);
        DecodePass {
            gpu,
            dec,
            w,
            step: ptr(&seq.step, &gpu.stream),
            splits,
            dims,
            moe_kernels: moe::select(&dims.moe, opts.force_cuda_core_moe),
            gemv_tc_min_tiles: opts.gemv_tc_min_tiles,
        }
    }

    /// After the layers: final norm + lm_head (unless `out` is None), then the token choice.
    fn finish(&mut self, cfg: &ModelConfig, out: StepOut, probe: &mut Probe) -> Result<()> {
        let (gpu, dec, st) = (self.gpu, self.dec, &self.gpu.stream);
        if out != StepOut::None {
            self.gemv(dec.head, ptr(&dec.act.x, st), cfg.hidden_size, ptr(&self.w.final_norm, st), 0)?;
            self.point(probe, Point::Phase("lm_head"))?;
        }
        match out {
            StepOut::Greedy => {
                sampling::argmax_next(gpu, ptr(&dec.act.logits, st), cfg.vocab_size, self.step, ptr(&dec.scratch.argmax, st), 1)?;
                self.point(probe, Point::Phase("argmax"))?;
            }
            StepOut::Sample | StepOut::SampleSmallK => {
                let small = out == StepOut::SampleSmallK;
                sampling::sample_next(gpu, ptr(&dec.act.logits, st), cfg.vocab_size, self.step, &dec.scratch.sample, 1, small)?;
                self.point(probe, Point::Phase("sample"))?;
            }
            StepOut::None | StepOut::Logits => {}
        }
        Ok(())
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.gpu.stream)
    }

    fn gemv(&self, set: GemvSet, x: u64, cols: usize, gain: u64, xnorm_out: u64) -> Result<()> {
        let inp = GemvInput { x, cols, gain, eps: self.dims.eps, xnorm_out };
        qmatmul::gemv(self.gpu, set, inp, self.dims.group, self.gemv_tc_min_tiles)
    }
}

impl Pass for DecodePass<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn residual(&self) -> (&CudaSlice<f32>, usize) {
        (&self.dec.act.x, self.w.embed.cols)
    }

    fn embed(&mut self, probe: &mut Probe) -> Result<()> {
        qmatmul::embed_row(self.gpu, &self.w.embed, self.dims.group, self.step, self.p(&self.dec.act.x))?;
        self.point(probe, Point::Phase("embed"))
    }

    fn gdn(&mut self, li: usize, lw: &DevLayer, g: &DevGdn, ring: u64, state: u64, probe: &mut Probe) -> Result<()> {
        let (a, sets) = (&self.dec.act, &self.dec.layers[li]);
        let h = self.w.embed.cols;
        self.gemv(sets.mixer_in, self.p(&a.x), h, self.p(&lw.input_norm), 0)?;
        self.point(probe, Point::Phase("gdn in_proj"))?;
        let p = forward::gdn_ptrs(self.gpu, a, g, ring, state);
        gdn::step(self.gpu, &self.dims.gdn, &p, self.step)?;
        self.point(probe, Point::Phase("gdn step"))?;
        self.gemv(sets.mixer_out, p.y, g.out.cols, 0, 0)?;
        self.point(probe, Point::Phase("gdn out_proj"))
    }

    fn attention(&mut self, li: usize, lw: &DevLayer, at: &DevAttn, kcache: u64, vcache: u64, probe: &mut Probe) -> Result<()> {
        let (a, sets, s) = (&self.dec.act, &self.dec.layers[li], &self.dec.scratch);
        let h = self.w.embed.cols;
        self.gemv(sets.mixer_in, self.p(&a.x), h, self.p(&lw.input_norm), 0)?;
        self.point(probe, Point::Phase("attn qkv_proj"))?;
        let d = self.dims.attn;
        let p = forward::attn_ptrs(self.gpu, a, at, self.w, kcache, vcache);
        let part = SplitPartials { o: self.p(&s.part_o), ml: self.p(&s.part_ml) };
        attention::prep(self.gpu, &d, &p, self.step)?;
        self.point(probe, Point::Phase("attn prep"))?;
        attention::split(self.gpu, &d, &p, &part, self.step, self.splits)?;
        self.point(probe, Point::Phase("attn split"))?;
        attention::combine(self.gpu, &d, &p, &part, self.splits)?;
        self.point(probe, Point::Phase("attn combine"))?;
        self.gemv(sets.mixer_out, p.out, at.o.cols, 0, 0)?;
        self.point(probe, Point::Phase("attn o_proj"))
    }

    fn moe(&mut self, li: usize, lw: &DevLayer, m: &DevMoe, probe: &mut Probe) -> Result<()> {
        let (a, sets, s) = (&self.dec.act, &self.dec.layers[li], &self.dec.scratch);
        let h = self.w.embed.cols;
        // Router + shared-expert gate with the post-attention norm fused; `u` keeps the normalised
        // input for the expert GEMVs.
        self.gemv(sets.router, self.p(&a.x), h, self.p(&lw.post_norm), self.p(&a.u))?;
        self.point(probe, Point::Phase("moe router"))?;
        // Fragment-order routed experts come with fragment-order copies of the shared expert.
        let frag = m.gate_exps.frag;
        let codes = |q: &DevQ| if frag { q.frag_ptrs(self.gpu).ok_or_else(|| anyhow!("no fragment-order copy of a shared expert matrix")) } else { Ok(q.ptrs(self.gpu)) };
        let p = MoePtrs {
            logits: self.p(&a.router),
            gate: codes(&m.gate_exps)?,
            up: codes(&m.up_exps)?,
            down: codes(&m.down_exps)?,
            sgate: codes(&m.shared_gate)?,
            sup: codes(&m.shared_up)?,
            sdown: codes(&m.shared_down)?,
            shared_gate_logit: self.p(&a.sgl),
            u: self.p(&a.u),
            act: self.p(&s.act),
            top_ids: self.p(&a.top_ids),
            top_w: self.p(&a.top_w),
            x: self.p(&a.x),
            frag,
        };
        moe::experts(self.gpu, &self.dims.moe, &p, self.moe_kernels)?;
        self.point(probe, Point::Phase("moe experts"))
    }
}

/// Enqueues the kernels of one decode step of `seq` (direct launches; the caller may capture them
/// into a graph: `splits` must then be fixed, the graph uses the split count of the sequence's
/// max-seq). With `out` the final norm and lm_head run too (logits in `dec.act.logits`), and the
/// device argmax for greedy steps.
#[allow(clippy::too_many_arguments)]
pub fn enqueue(gpu: &Gpu, cfg: &ModelConfig, opts: &CudaOptions, w: &DevWeights, dec: &Decoder, seq: &CudaSequence, splits: usize, out: StepOut, probe: &mut Probe) -> Result<()> {
    let mut pass = DecodePass::new(gpu, cfg, opts, w, dec, seq, splits);
    forward::layers(&mut pass, w, seq, probe)?;
    pass.finish(cfg, out, probe)
}

/// A decode step's end on a residual row computed elsewhere (`row`: the prefill's last row, f32
/// `hidden_size` values): the row goes into the decoder's residual, then the final norm, lm_head
/// and token choice (`out`) run as at the end of [`enqueue`], into `seq`'s step buffer, which
/// holds the token fed at that row and its position. So a prompt's first token comes from the
/// decode step's own head and choice kernels, without the step's layers.
#[allow(clippy::too_many_arguments)]
pub fn finish_from_row(gpu: &Gpu, cfg: &ModelConfig, opts: &CudaOptions, w: &DevWeights, dec: &mut Decoder, seq: &CudaSequence, row: &CudaView<f32>, out: StepOut) -> Result<()> {
    let mut x = dec.act.x.slice_mut(0..cfg.hidden_size);
    gpu.stream.memcpy_dtod(row, &mut x).map_err(|e| anyhow!("copying the prefill's last row: {e:?}"))?;
    DecodePass::new(gpu, cfg, opts, w, dec, seq, 1).finish(cfg, out, &mut Probe::default())
}
