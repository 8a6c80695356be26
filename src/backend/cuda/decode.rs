//! The decode step (T = 1): scratch activations, the per-layer GEMV descriptor sets, and the
//! launch sequence. Per layer: GDN = in-proj GEMV (input norm fused) → gdn_step → out-proj GEMV
//! (+residual); attention = q|k|v GEMV → prep → split-KV → combine → o GEMV (+residual); then
//! MoE = router|shared-gate GEMV (post norm fused) → gate|up+SwiGLU (top-k in the prologue) →
//! down + combine + shared expert (+residual).

use super::context::{ptr, Gpu};
use super::kernels::{
    self, AttnDims, AttnPtrs, GdnDims, GdnPtrs, GemvSet, MoeDims, MoePtrs, QMatDesc,
};
use super::state::{CudaSequence, DevLayerState};
use super::weights::{DevMixer, DevQ, DevWeights};
use super::CudaBackend;
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaSlice;

/// What a decode step produces after the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOut {
    /// Nothing (prefill of a known prefix).
    None,
    /// Final norm + lm_head into `scratch.logits`.
    Logits,
    /// Logits, then `argmax_next`: the next token and position go into the step buffer.
    Greedy,
}

/// Most KV splits per head in decode attention (partials are sized for it).
pub const MAX_SPLITS: usize = 256;

/// Positions per split before another split is added.
const POS_PER_SPLIT: usize = 32;

pub struct LayerSets {
    pub mixer_in: GemvSet,
    pub mixer_out: GemvSet,
    pub router: GemvSet,
}

/// Activations of one decode step, owned by the backend (batch 1: one set suffices).
pub struct Scratch {
    pub x: CudaSlice<f32>,
    pub u: CudaSlice<f32>,
    pub qkv: CudaSlice<f32>,
    pub z: CudaSlice<f32>,
    pub gb: CudaSlice<f32>,
    pub ga: CudaSlice<f32>,
    pub gy: CudaSlice<f32>,
    pub qg: CudaSlice<f32>,
    pub kraw: CudaSlice<f32>,
    pub vraw: CudaSlice<f32>,
    pub q: CudaSlice<f32>,
    pub gate: CudaSlice<f32>,
    pub ao: CudaSlice<f32>,
    pub part_o: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
    pub rlog: CudaSlice<f32>,
    pub sgl: CudaSlice<f32>,
    pub top_ids: CudaSlice<i32>,
    pub top_w: CudaSlice<f32>,
    pub act: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    /// argmax_next's per-block (value, index) partials and its block ticket (zero between uses).
    pub argmax_part: CudaSlice<f32>,
    pub inv_freq: CudaSlice<f64>,
    pub descs: CudaSlice<QMatDesc>,
    pub layers: Vec<LayerSets>,
    pub head: GemvSet,
}

impl Scratch {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, w: &DevWeights) -> Result<Self> {
        let f = |n: usize| gpu.zeros::<f32>(n);
        let inv: Vec<f64> =
            crate::backend::cpu::ops::rope_inv_freq(cfg.rotary_dim(), cfg.rope_theta);
        let mut s = Scratch {
            x: f(cfg.hidden_size)?,
            u: f(cfg.hidden_size)?,
            qkv: f(cfg.gdn_conv_dim())?,
            z: f(cfg.gdn_value_dim())?,
            gb: f(cfg.linear_num_value_heads)?,
            ga: f(cfg.linear_num_value_heads)?,
            gy: f(cfg.gdn_value_dim())?,
            qg: f(cfg.q_proj_rows())?,
            kraw: f(cfg.kv_dim())?,
            vraw: f(cfg.kv_dim())?,
            q: f(cfg.attn_inner())?,
            gate: f(cfg.attn_inner())?,
            ao: f(cfg.attn_inner())?,
            part_o: f(cfg.num_attention_heads * MAX_SPLITS * cfg.head_dim)?,
            part_ml: f(cfg.num_attention_heads * MAX_SPLITS * 2)?,
            rlog: f(cfg.num_experts)?,
            sgl: f(1)?,
            top_ids: gpu.zeros::<i32>(cfg.num_experts_per_tok)?,
            top_w: f(cfg.num_experts_per_tok)?,
            act: f(cfg.num_experts_per_tok * cfg.moe_intermediate_size
                + cfg.shared_expert_intermediate_size)?,
            logits: f(cfg.vocab_size)?,
            argmax_part: f(2 * kernels::ARGMAX_BLOCKS as usize + 1)?,
            inv_freq: gpu.upload(&inv)?,
            descs: gpu.zeros::<QMatDesc>(1)?,
            layers: Vec::new(),
            head: GemvSet {
                descs: 0,
                count: 0,
                rows: 0,
                tiles: 0,
                all4: false,
            },
        };
        // Descriptor sets: (matrix, output, accumulate) lists, laid out back to back.
        let st = &gpu.stream;
        let mut all: Vec<QMatDesc> = Vec::new();
        // (first, count, rows, 16-row tiles, all 4-bit)
        let mut sets: Vec<(usize, usize, usize, usize, bool)> = Vec::new();
        let mut add = |list: &[(&DevQ, u64, bool)]| {
            let first = all.len();
            let (mut rows, mut tiles, mut all4) = (0, 0, true);
            for (q, y, acc) in list {
                let (wp, sp, bp) = q.ptrs(gpu);
                all.push(QMatDesc {
                    w: wp,
                    s: sp,
                    b: bp,
                    y: *y,
                    rows: q.rows as i32,
                    bits: q.bits as i32,
                    accumulate: *acc as i32,
                    pad: 0,
                });
                rows += q.rows;
                tiles += q.rows.div_ceil(16);
                all4 &= q.bits == 4;
            }
            sets.push((first, list.len(), rows, tiles, all4));
        };
        let (x, qkv, z, gb, ga, gy) = (
            ptr(&s.x, st),
            ptr(&s.qkv, st),
            ptr(&s.z, st),
            ptr(&s.gb, st),
            ptr(&s.ga, st),
            ptr(&s.gy, st),
        );
        let (qg, kraw, vraw, ao, rlog, sgl) = (
            ptr(&s.qg, st),
            ptr(&s.kraw, st),
            ptr(&s.vraw, st),
            ptr(&s.ao, st),
            ptr(&s.rlog, st),
            ptr(&s.sgl, st),
        );
        let _ = gy;
        let _ = ao;
        for l in &w.layers {
            match &l.mixer {
                DevMixer::Gdn(g) => {
                    add(&[
                        (&g.in_qkv, qkv, false),
                        (&g.in_z, z, false),
                        (&g.in_b, gb, false),
                        (&g.in_a, ga, false),
                    ]);
                    add(&[(&g.out, x, true)]);
                }
                DevMixer::Attn(a) => {
                    add(&[(&a.q, qg, false), (&a.k, kraw, false), (&a.v, vraw, false)]);
                    add(&[(&a.o, x, true)]);
                }
            }
            add(&[
                (&l.moe.router, rlog, false),
                (&l.moe.shared_expert_gate, sgl, false),
            ]);
        }
        add(&[(&w.lm_head, ptr(&s.logits, st), false)]);
        s.descs = gpu.upload(&all)?;
        let base = ptr(&s.descs, st);
        let set = |i: usize| {
            let (first, count, rows, tiles, all4) = sets[i];
            GemvSet {
                descs: base + (first * std::mem::size_of::<QMatDesc>()) as u64,
                count,
                rows,
                tiles,
                all4,
            }
        };
        for i in 0..w.layers.len() {
            s.layers.push(LayerSets {
                mixer_in: set(3 * i),
                mixer_out: set(3 * i + 1),
                router: set(3 * i + 2),
            });
        }
        s.head = set(3 * w.layers.len());
        Ok(s)
    }

    /// Copies the logits to the host (synchronises the stream).
    pub fn read_logits(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        gpu.stream
            .clone_dtoh(&self.logits)
            .map_err(|e| anyhow!("CUDA error during the forward pass: {e:?}"))
    }
}

/// Most KV splits per head with the tiled split kernel: 2 KV heads x 128 splits x 96 KiB of
/// shared memory is about one wave at two blocks per SM; each split streams its rows through the
/// cp.async ring, so longer splits cost bandwidth, not latency.
pub const MAX_SPLITS_TILED: usize = 128;

/// Splits used for a context of `len` positions.
pub fn splits_for(gpu: &Gpu, len: usize) -> usize {
    let cap = if gpu.attn_tiled {
        MAX_SPLITS_TILED
    } else {
        MAX_SPLITS
    };
    len.div_ceil(POS_PER_SPLIT).clamp(1, cap)
}

/// Writes `[token, pos]` into the sequence's device step buffer (read by every kernel of the step).
pub fn upload_step(gpu: &Gpu, seq: &mut CudaSequence, token: u32, pos: usize) -> Result<()> {
    if pos >= seq.max_seq {
        bail!(
            "position {pos} is past the sequence's max-seq {}",
            seq.max_seq
        );
    }
    gpu.stream
        .memcpy_htod(&[token as i32, pos as i32], &mut seq.step)
        .map_err(|e| anyhow!("step upload: {e:?}"))
}

/// Enqueues one decode step for `token` at `pos` (direct launches).
pub fn step(
    b: &CudaBackend,
    seq: &mut CudaSequence,
    token: u32,
    pos: usize,
    logits: StepOut,
    trace: Option<&mut Vec<Vec<f32>>>,
) -> Result<()> {
    upload_step(&b.gpu, seq, token, pos)?;
    enqueue(b, seq, splits_for(&b.gpu, pos + 1), logits, trace, None)
}

/// Events recorded after each phase when profiling (LILY_CUDA_PROFILE=1).
pub type Marks = Vec<(&'static str, cudarc::driver::CudaEvent)>;

/// Enqueues the kernels of one decode step; token and position come from the device step buffer,
/// so the same launches can be captured once into a CUDA graph and replayed (`splits` must then
/// be fixed: the graph uses the split count of the sequence's max-seq). When `logits` is set the
/// final norm and the lm_head run too (results in `scratch.logits`).
pub fn enqueue(
    b: &CudaBackend,
    seq: &CudaSequence,
    splits: usize,
    out: StepOut,
    mut trace: Option<&mut Vec<Vec<f32>>>,
    mut marks: Option<&mut Marks>,
) -> Result<()> {
    let gpu = &b.gpu;
    let mut mark = |name: &'static str| -> Result<()> {
        if let Some(m) = marks.as_deref_mut() {
            m.push((name, gpu.record_event()?));
        }
        Ok(())
    };
    mark("start")?;
    let cfg = &b.cfg;
    let s = &b.scratch;
    let st = &gpu.stream;
    let step = ptr(&seq.step, st);
    let eps = cfg.rms_norm_eps as f32;
    let group = cfg.quant.group_size;
    let h = cfg.hidden_size;
    let x = ptr(&s.x, st);
    let u = ptr(&s.u, st);
    kernels::embed(gpu, b.w.embed.ptrs(gpu), step, h, b.w.embed.bits, group, x)?;
    mark("embed")?;
    let gd = GdnDims {
        nk: cfg.linear_num_key_heads,
        nv: cfg.linear_num_value_heads,
        dk: cfg.linear_key_head_dim,
        dv: cfg.linear_value_head_dim,
        kc: cfg.linear_conv_kernel_dim,
        eps,
    };
    let ad = AttnDims {
        nh: cfg.num_attention_heads,
        nkv: cfg.num_key_value_heads,
        hd: cfg.head_dim,
        half_rot: cfg.rotary_dim() / 2,
        eps,
        kv_bf16: seq.kv_bf16,
    };
    let md = MoeDims {
        e: cfg.num_experts,
        k: cfg.num_experts_per_tok,
        inter: cfg.moe_intermediate_size,
        sinter: cfg.shared_expert_intermediate_size,
        hidden: h,
        group,
        all4: false,
    };
    for (li, (lw, ls)) in b.w.layers.iter().zip(&s.layers).enumerate() {
        let lstate = &seq.layers[li];
        kernels::gemv(
            gpu,
            ls.mixer_in,
            x,
            h,
            ptr(&lw.input_norm, st),
            eps,
            group,
            0,
        )?;
        mark(if matches!(lw.mixer, DevMixer::Gdn(_)) {
            "gdn in_proj"
        } else {
            "attn qkv_proj"
        })?;
        match (&lw.mixer, lstate) {
            (DevMixer::Gdn(g), DevLayerState::Gdn { ring, state }) => {
                let p = GdnPtrs {
                    qkv: ptr(&s.qkv, st),
                    z: ptr(&s.z, st),
                    b: ptr(&s.gb, st),
                    a: ptr(&s.ga, st),
                    ring: ptr(ring, st),
                    taps: ptr(&g.conv_taps, st),
                    dt_bias: ptr(&g.dt_bias, st),
                    neg_a: ptr(&g.neg_a, st),
                    norm: ptr(&g.norm, st),
                    state: ptr(state, st),
                    y: ptr(&s.gy, st),
                    step,
                };
                kernels::gdn_step(gpu, gd, &p)?;
                mark("gdn step")?;
                kernels::gemv(
                    gpu,
                    ls.mixer_out,
                    ptr(&s.gy, st),
                    cfg.gdn_value_dim(),
                    0,
                    eps,
                    group,
                    0,
                )?;
                mark("gdn out_proj")?;
            }
            (DevMixer::Attn(a), DevLayerState::Attn { k, v }) => {
                let p = AttnPtrs {
                    qg: ptr(&s.qg, st),
                    kraw: ptr(&s.kraw, st),
                    vraw: ptr(&s.vraw, st),
                    q_norm: ptr(&a.q_norm, st),
                    k_norm: ptr(&a.k_norm, st),
                    inv_freq: ptr(&s.inv_freq, st),
                    q: ptr(&s.q, st),
                    gate: ptr(&s.gate, st),
                    kcache: ptr(k, st),
                    vcache: ptr(v, st),
                    step,
                    part_o: ptr(&s.part_o, st),
                    part_ml: ptr(&s.part_ml, st),
                    out: ptr(&s.ao, st),
                };
                kernels::attn_prep(gpu, ad, &p)?;
                mark("attn prep")?;
                kernels::attn_split(gpu, ad, &p, splits)?;
                mark("attn split")?;
                kernels::attn_combine(gpu, ad, &p, splits)?;
                mark("attn combine")?;
                kernels::gemv(
                    gpu,
                    ls.mixer_out,
                    ptr(&s.ao, st),
                    cfg.attn_inner(),
                    0,
                    eps,
                    group,
                    0,
                )?;
                mark("attn o_proj")?;
            }
            _ => bail!("sequence state does not match the model's layer kinds (layer {li})"),
        }
        // MoE: router + shared-expert gate with the post-attention norm fused; `u` keeps the
        // normalised input for the expert GEMVs.
        kernels::gemv(gpu, ls.router, x, h, ptr(&lw.post_norm, st), eps, group, u)?;
        mark("moe router")?;
        let m = &lw.moe;
        let md = MoeDims {
            all4: [
                &m.gate_exps,
                &m.up_exps,
                &m.down_exps,
                &m.shared_gate,
                &m.shared_up,
                &m.shared_down,
            ]
            .iter()
            .all(|q| q.bits == 4),
            ..md
        };
        let p = MoePtrs {
            logits: ptr(&s.rlog, st),
            gate: m.gate_exps.ptrs(gpu),
            up: m.up_exps.ptrs(gpu),
            down: m.down_exps.ptrs(gpu),
            sgate: m.shared_gate.ptrs(gpu),
            sup: m.shared_up.ptrs(gpu),
            sdown: m.shared_down.ptrs(gpu),
            shared_gate_logit: ptr(&s.sgl, st),
            u,
            act: ptr(&s.act, st),
            top_ids: ptr(&s.top_ids, st),
            top_w: ptr(&s.top_w, st),
            x,
        };
        kernels::moe(gpu, md, &p)?;
        mark("moe experts")?;
        if let Some(t) = trace.as_deref_mut() {
            // Debug/test only: the residual stream after this layer (synchronises).
            t.push(
                st.clone_dtoh(&s.x)
                    .map_err(|e| anyhow!("CUDA error: {e:?}"))?,
            );
        }
    }
    if out != StepOut::None {
        kernels::gemv(gpu, s.head, x, h, ptr(&b.w.final_norm, st), eps, group, 0)?;
        mark("lm_head")?;
    }
    if out == StepOut::Greedy {
        kernels::argmax_next(
            gpu,
            ptr(&s.logits, st),
            cfg.vocab_size,
            step,
            ptr(&s.argmax_part, st),
        )?;
        mark("argmax")?;
    }
    Ok(())
}
