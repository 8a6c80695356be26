//! The model's layer structure, written once for the CUDA backend: embed, then per layer the
//! mixer (Gated DeltaNet or gated attention) added into the residual stream and the MoE added
//! into it. A [`Pass`] supplies the per-family launches for one token count: the decode step
//! (T = 1, decode.rs: norms fused into GEMVs, one CUDA graph) or a prefill chunk (T tokens,
//! prefill.rs: GEMMs, scans, flash attention). The final norm and lm_head are the caller's, since
//! which rows need logits depends on the call.
//!
//! The tokens are those of one sequence at consecutive positions (decode), runs of consecutive
//! positions of one or more sequences (a prefill chunk's segments), or one token of each
//! sequence of a batch (batched decode, batch.rs); the loop is the same, only the state addresses
//! differ ([`LayerStates`]: one sequence's buffers, each segment's, or the batch's per-row pointer
//! tables) and the mixer kernels' addressing.

use super::activations::Activations;
use super::attention::{AttnDims, AttnPtrs};
use super::device::{ptr, Gpu};
use super::gdn::{GdnDims, GdnPtrs};
use super::moe::MoeDims;
use super::qmatmul::{GemvSet, GemvSets, QMatDesc};
use super::state::{CudaSequence, LayerSlot};
use super::weights::{DevAttn, DevGdn, DevLayer, DevMixer, DevMoe, DevWeights};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

/// Shapes every pass reads: norms, quantisation group, and each layer family's dims.
#[derive(Clone, Copy, Debug)]
pub struct LayerDims {
    pub eps: f32,
    pub group: usize,
    pub gdn: GdnDims,
    pub attn: AttnDims,
    pub moe: MoeDims,
}

impl LayerDims {
    pub fn new(cfg: &ModelConfig, kv_bf16: bool, gdn_state_f16: bool) -> Self {
        LayerDims {
            eps: cfg.rms_norm_eps as f32,
            group: cfg.quant.group_size,
            gdn: GdnDims::new(cfg).with_state_f16(gdn_state_f16),
            attn: AttnDims::new(cfg, kv_bf16),
            moe: MoeDims::new(cfg),
        }
    }
}

/// Named points of a forward, for the profile and the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// After the phase of that name (summed over layers in the profile).
    Phase(&'static str),
    /// After layer `i`: the residual stream.
    Layer(usize),
}

/// What a forward records at its points: CUDA events for the phase profile, and/or a copy of the
/// residual stream after every layer (tests against the CPU reference; synchronises).
#[derive(Default)]
pub struct Probe {
    pub marks: Option<Vec<(&'static str, CudaEvent)>>,
    pub trace: Option<Vec<Vec<f32>>>,
}

impl Probe {
    pub fn profiling(on: bool) -> Self {
        Probe { marks: on.then(Vec::new), trace: None }
    }

    pub fn tracing() -> Self {
        Probe { marks: None, trace: Some(Vec::new()) }
    }

    /// Records `point`; `x` is the residual stream (`values` of it are live).
    pub fn at(&mut self, gpu: &Gpu, point: Point, x: &CudaSlice<f32>, values: usize) -> Result<()> {
        match point {
            Point::Phase(name) => {
                if let Some(t) = gpu.timeline() {
                    t.phase(name);
                }
                if let Some(m) = self.marks.as_mut() {
                    m.push((name, gpu.record_event()?));
                }
            }
            Point::Layer(_) => {
                if let Some(t) = self.trace.as_mut() {
                    let mut host = vec![0.0f32; values];
                    gpu.stream
                        .memcpy_dtoh(&x.slice(0..values), &mut host)
                        .map_err(|e| anyhow!("CUDA error: {e:?}"))?;
                    gpu.sync()?;
                    t.push(host);
                }
            }
        }
        Ok(())
    }

    /// Milliseconds per phase name between consecutive marks, in first-seen order (synchronises).
    pub fn phase_ms(&self, gpu: &Gpu) -> Result<Vec<(&'static str, f64)>> {
        let mut phases: Vec<(&'static str, f64)> = Vec::new();
        let Some(m) = &self.marks else {
            return Ok(phases);
        };
        gpu.sync()?;
        for w in m.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1).map_err(|e| anyhow!("{e:?}"))? as f64;
            match phases.iter_mut().find(|(n, _)| *n == w[1].0) {
                Some(e) => e.1 += ms,
                None => phases.push((w[1].0, ms)),
            }
        }
        Ok(phases)
    }
}

/// The per-family launches of the layer structure at one token count.
pub trait Pass {
    fn gpu(&self) -> &Gpu;
    /// The residual stream and how many of its values are live.
    fn residual(&self) -> (&CudaSlice<f32>, usize);
    /// Token embeddings into the residual stream.
    fn embed(&mut self, probe: &mut Probe) -> Result<()>;
    /// `x += GatedDeltaNet(norm(x))`, advancing the layer's conv ring and recurrent state.
    fn gdn(&mut self, li: usize, lw: &DevLayer, g: &DevGdn, ring: u64, state: u64, probe: &mut Probe) -> Result<()>;
    /// `x += GatedAttention(norm(x))`, appending to the layer's KV cache.
    fn attention(&mut self, li: usize, lw: &DevLayer, a: &DevAttn, kcache: u64, vcache: u64, probe: &mut Probe) -> Result<()>;
    /// `x += MoE(norm(x))`.
    fn moe(&mut self, li: usize, lw: &DevLayer, m: &DevMoe, probe: &mut Probe) -> Result<()>;

    /// Records a point of the profile / trace.
    fn point(&self, probe: &mut Probe, point: Point) -> Result<()> {
        let (x, values) = self.residual();
        probe.at(self.gpu(), point, x, values)
    }
}

/// The two state addresses each layer's mixer takes: (conv ring, recurrent state) of a GDN layer,
/// (K cache, V cache) of an attention layer.
pub trait LayerStates {
    fn layer(&self, li: usize, mixer: &DevMixer, stream: &CudaStream) -> Result<(u64, u64)>;
}

/// One sequence: its own buffers.
impl LayerStates for CudaSequence {
    fn layer(&self, li: usize, mixer: &DevMixer, _st: &CudaStream) -> Result<(u64, u64)> {
        match (mixer, self.layer_slot(li)) {
            (DevMixer::Gdn(_), LayerSlot::Gdn { .. }) | (DevMixer::Attn(_), LayerSlot::Attn { .. }) => Ok(self.layer_ptrs(li)),
            _ => bail!("sequence state does not match the model's layer kinds (layer {li})"),
        }
    }
}

/// Runs every layer of the model over the pass's tokens, with the layers' state at `states`.
pub fn layers(pass: &mut impl Pass, w: &DevWeights, states: &impl LayerStates, probe: &mut Probe) -> Result<()> {
    pass.point(probe, Point::Phase("start"))?;
    pass.embed(probe)?;
    let st = pass.gpu().stream.clone();
    for (li, lw) in w.layers.iter().enumerate() {
        let (a, b) = states.layer(li, &lw.mixer, &st)?;
        match &lw.mixer {
            DevMixer::Gdn(g) => pass.gdn(li, lw, g, a, b, probe)?,
            DevMixer::Attn(at) => pass.attention(li, lw, at, a, b, probe)?,
        }
        pass.moe(li, lw, &lw.moe, probe)?;
        pass.point(probe, Point::Layer(li))?;
    }
    Ok(())
}

/// The GEMV sets of a layer's mixer over the activations `act`: the input projections (GDN
/// q|k|v, z, b, a; attention q|gate, k, v) and the output projection, added into the residual.
fn mixer_sets(gpu: &Gpu, sets: &mut GemvSets, mixer: &DevMixer, act: &Activations) -> (usize, usize) {
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    match mixer {
        DevMixer::Gdn(g) => (
            sets.add(gpu, &[(&g.in_qkv, p(&act.qkv), false), (&g.in_z, p(&act.z), false), (&g.in_b, p(&act.b), false), (&g.in_a, p(&act.a), false)]),
            sets.add(gpu, &[(&g.out, p(&act.x), true)]),
        ),
        DevMixer::Attn(a) => (
            sets.add(gpu, &[(&a.q, p(&act.qkv), false), (&a.k, p(&act.kraw), false), (&a.v, p(&act.vraw), false)]),
            sets.add(gpu, &[(&a.o, p(&act.x), true)]),
        ),
    }
}

/// Every layer's GEMV sets over some activations (the mixer's input and output sets, then the
/// layer's `extra` sets) and the lm_head's, their descriptors in one device buffer.
pub struct ModelSets {
    pub descs: CudaSlice<QMatDesc>,
    pub layers: Vec<(GemvSet, GemvSet, Vec<GemvSet>)>,
    pub head: GemvSet,
}

/// [`ModelSets`] over `act`; `extra` adds a layer's further sets and returns their indices.
/// `frag`: the sets point at the matrices' fragment-order copies where all have them (the
/// batched decode's `gemv_tcb_f`).
pub fn model_sets(gpu: &Gpu, w: &DevWeights, act: &Activations, frag: bool, mut extra: impl FnMut(&mut GemvSets, &DevLayer) -> Vec<usize>) -> Result<ModelSets> {
    let mut sets = GemvSets::default();
    sets.frag = frag;
    let ids: Vec<_> = w.layers.iter().map(|l| (mixer_sets(gpu, &mut sets, &l.mixer, act), extra(&mut sets, l))).collect();
    let head = sets.add(gpu, &[(&w.lm_head, ptr(&act.logits, &gpu.stream), false)]);
    let descs = gpu.upload(&sets.device_descs())?;
    let base = ptr(&descs, &gpu.stream);
    let layers = ids
        .into_iter()
        .map(|((i, o), more)| (sets.set(i, base), sets.set(o, base), more.into_iter().map(|m| sets.set(m, base)).collect()))
        .collect();
    Ok(ModelSets { descs, layers, head: sets.set(head, base) })
}

/// A GDN layer's pointers over the activations `a`, its weights and its state.
pub fn gdn_ptrs(gpu: &Gpu, a: &Activations, g: &DevGdn, ring: u64, state: u64) -> GdnPtrs {
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    GdnPtrs {
        qkv: p(&a.qkv),
        z: p(&a.z),
        b: p(&a.b),
        a: p(&a.a),
        ring,
        taps: p(&g.conv_taps),
        dt_bias: p(&g.dt_bias),
        neg_a: p(&g.neg_a),
        norm: p(&g.norm),
        state,
        y: p(&a.y),
    }
}

/// An attention layer's pointers over the activations `a`, its weights and its KV cache.
pub fn attn_ptrs(gpu: &Gpu, a: &Activations, at: &DevAttn, w: &DevWeights, kcache: u64, vcache: u64) -> AttnPtrs {
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    AttnPtrs {
        qg: p(&a.qkv),
        kraw: p(&a.kraw),
        vraw: p(&a.vraw),
        q_norm: p(&at.q_norm),
        k_norm: p(&at.k_norm),
        inv_freq: ptr(&w.inv_freq, &gpu.stream),
        q: p(&a.q),
        gate: p(&a.gate),
        kcache,
        vcache,
        out: p(&a.y),
    }
}
