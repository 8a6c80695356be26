//! Weight upload: the MLX layout as stored (u32 code words, bf16 scales and biases), one device
//! allocation per tensor, plus the small f32 vectors. The routed experts' codes go in fragment
//! order where every kernel that reads them takes it (kernels/common.cuh `frag_word`: each 16-row
//! tile's codes permuted so that a warp loads a 64-column group as one coalesced 512-byte piece);
//! everything else keeps the stored row order, and the 4-bit projections, the lm_head and (with
//! fragment-order experts) the shared expert get a fragment-order copy beside it for the batched
//! decode's kernels (~0.9 GB on the 35B), until their other readers take fragment order too.

use super::device::{ptr, Gpu};
use crate::checkpoint::store::QuantTensor;
use crate::checkpoint::DType;
use crate::model::{MixerWeights, ModelWeights};
use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use rayon::prelude::*;

/// One quantized matrix on the device.
pub struct DevQ {
    pub w: CudaSlice<u32>,
    pub s: CudaSlice<u16>,
    pub b: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
    pub bits: usize,
    /// `w` holds the codes in fragment order (kernels/common.cuh `frag_word`), not row order.
    pub frag: bool,
    /// A fragment-order copy beside row-order `w`, for the kernels that read fragment order where
    /// others read this matrix in row order: the shared expert's (the expert kernels run it with
    /// the routed experts, the prefill as a dense product), the projections' and lm_head's (the
    /// batched decode's `gemv_tcb_f`; the one-sequence GEMVs and the prefill read row order).
    pub frag_copy: Option<CudaSlice<u32>>,
    /// The scales and biases in the stage order of the batched gate|up ring kernel
    /// (`moe_tcr_f`; [`stage_order_scales`]), beside the row-order `s` and `b` the other kernels
    /// read.
    pub stage_sb: Option<CudaSlice<u16>>,
    /// The rows dequantised to bf16 once, for the long prefill chunks' cuBLAS GEMMs, which
    /// otherwise dequantise them into a scratch every chunk ([`DevWeights::keep_dense_bf16`]).
    pub dense_bf16: Option<CudaSlice<u16>>,
}

/// Groups per stage of the batched gate|up ring kernel (TCR_GROUPS in kernels/common.cuh).
const STAGE_GROUPS: usize = 2;

/// Row-order bf16 scales and biases (`[rows][gpr]` each, `gpr` a multiple of `STAGE_GROUPS`) in
/// stage order, the rows padded with zeros to whole 16-row tiles: per tile and stage of
/// `STAGE_GROUPS` groups, per row of the tile its stage's scales, then its stage's biases (the
/// layout of a ring stage's scales in shared memory, so a stage's are one contiguous copy of
/// 16 * 2 * STAGE_GROUPS words).
pub fn stage_order_scales(s: &[u16], b: &[u16], rows: usize, gpr: usize) -> Vec<u16> {
    let stages = gpr / STAGE_GROUPS;
    let per_row = 2 * STAGE_GROUPS;
    let mut out = vec![0u16; rows.next_multiple_of(16) * gpr * 2];
    for r in 0..rows {
        for k in 0..stages {
            let at = (((r / 16) * stages + k) * 16 + r % 16) * per_row;
            let g = r * gpr + k * STAGE_GROUPS;
            out[at..at + STAGE_GROUPS].copy_from_slice(&s[g..g + STAGE_GROUPS]);
            out[at + STAGE_GROUPS..at + per_row].copy_from_slice(&b[g..g + STAGE_GROUPS]);
        }
    }
    out
}

/// `q`'s scales or biases (`bytes`) as bf16 (exact: MLX stores bf16; other float dtypes are
/// rounded to bf16 once here).
fn bf16_values(q: &QuantTensor, bytes: &[u8]) -> Vec<u16> {
    match q.scale_dtype {
        DType::BF16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
        dt => crate::checkpoint::store::to_f32(dt, bytes).into_iter().map(|v| half::bf16::from_f32(v).to_bits()).collect(),
    }
}

/// Whether a matrix in fragment order can have its scales and biases in stage order too: whole
/// stages and whole 16-row tiles (`moe_tcr` also checks that each expert's rows are, so no tile
/// spans two).
pub fn stage_scales_fit(t: &QuantTensor) -> bool {
    frag_shape(t.bits, t.group, t.cols) && t.cols.is_multiple_of(64 * STAGE_GROUPS) && t.rows.is_multiple_of(16)
}

/// Whether codes of this shape can go in fragment order: 4-bit, group 64, whole 64-column groups.
pub fn frag_shape(bits: usize, group: usize, cols: usize) -> bool {
    bits == 4 && group == 64 && cols.is_multiple_of(64)
}

/// Row-order 4-bit codes (`[rows][cols / 8]` words, `cols` a multiple of 64) in fragment order,
/// the rows padded with zeros to whole 16-row tiles: per tile and 64-column group G one block of
/// 128 words, lane l = 4g + t's four at 4l: words 8G + 2t and 8G + 2t + 1 of tile rows g and
/// g + 8 (kernels/common.cuh `frag_word` is the same map as an index formula).
pub fn fragment_order(words: &[u32], rows: usize, cols: usize) -> Vec<u32> {
    let (wpr, gpr) = (cols / 8, cols / 64);
    let mut out = vec![0u32; rows.div_ceil(16) * 16 * wpr];
    out.par_chunks_mut(128).enumerate().for_each(|(blk, o)| {
        let (tile, grp) = (blk / gpr, blk % gpr);
        for (i, v) in o.iter_mut().enumerate() {
            let (lane, k) = (i / 4, i % 4);
            let row = tile * 16 + lane / 4 + 8 * (k / 2);
            if row < rows {
                *v = words[row * wpr + 8 * grp + 2 * (lane % 4) + k % 2];
            }
        }
    });
    out
}

/// `q`'s codes in fragment order; a shape that cannot go in it ([`frag_shape`]) is an error.
fn frag_codes(q: &QuantTensor) -> Result<Vec<u32>> {
    if !frag_shape(q.bits, q.group, q.cols) {
        bail!("{}: {}-bit, group {}, {} columns cannot go in fragment order", q.name, q.bits, q.group, q.cols);
    }
    Ok(fragment_order(q.words(), q.rows, q.cols))
}

impl DevQ {
    /// `upload` with the codes in fragment order (rows padded to whole 16-row tiles; permuted
    /// on the host, so the device holds no second copy at any time); a shape that cannot
    /// ([`frag_shape`]) is an error. `stage_scales`: the scales and biases in stage order too
    /// ([`DevQ::stage_sb`]; a shape that cannot, [`stage_scales_fit`], is an error).
    pub fn upload_frag(gpu: &Gpu, q: &QuantTensor, stage_scales: bool) -> Result<Self> {
        Self::upload_codes(gpu, q, &frag_codes(q)?, true, stage_scales)
    }

    /// `upload` with a fragment-order copy of the codes beside the row-order ones
    /// ([`DevQ::frag_copy`]); `stage_scales` as in [`DevQ::upload_frag`].
    pub fn upload_with_frag_copy(gpu: &Gpu, q: &QuantTensor, stage_scales: bool) -> Result<Self> {
        let codes = frag_codes(q)?;
        let mut d = Self::upload_codes(gpu, q, q.words(), false, stage_scales)?;
        d.frag_copy = Some(gpu.upload(&codes)?);
        Ok(d)
    }

    /// The codes in fragment order with the scales and biases, where there are (`w` or the copy).
    pub fn frag_ptrs(&self, gpu: &Gpu) -> Option<(u64, u64, u64)> {
        let (w, s, b) = self.ptrs(gpu);
        match (&self.frag_copy, self.frag) {
            (_, true) => Some((w, s, b)),
            (Some(c), false) => Some((ptr(c, &gpu.stream), s, b)),
            (None, false) => None,
        }
    }

    pub fn upload(gpu: &Gpu, q: &QuantTensor) -> Result<Self> {
        Self::upload_codes(gpu, q, q.words(), false, false)
    }

    /// `q` with `words` as its codes (`frag`: in fragment order, else `q`'s own row order), with
    /// its scales and biases in stage order too where `stage_scales`.
    fn upload_codes(gpu: &Gpu, q: &QuantTensor, words: &[u32], frag: bool, stage_scales: bool) -> Result<Self> {
        if q.bits != 4 && q.bits != 8 {
            bail!(
                "{}: {}-bit weights are not supported by the CUDA backend (4 or 8)",
                q.name,
                q.bits
            );
        }
        // The GEMV kernels load 16 bytes of codes per lane and stage activations in 32-float
        // swizzle blocks, so rows and groups must be multiples of 32 columns.
        if !q.cols.is_multiple_of(q.group) || !q.group.is_multiple_of(32) || !q.cols.is_multiple_of(32) {
            bail!(
                "{}: {} columns / group {} not supported by the CUDA backend",
                q.name,
                q.cols,
                q.group
            );
        }
        if stage_scales && !stage_scales_fit(q) {
            bail!("{}: no stage order for {} rows x {} columns in groups of {}", q.name, q.rows, q.cols, q.group);
        }
        let w = gpu.upload(words)?;
        // Scales and biases stay bf16 on the device.
        let (s, b) = (bf16_values(q, q.scales.as_bytes()), bf16_values(q, q.biases.as_bytes()));
        let stage_sb = if stage_scales { Some(gpu.upload(&stage_order_scales(&s, &b, q.rows, q.cols / 64))?) } else { None };
        Ok(DevQ {
            w,
            s: gpu.upload(&s)?,
            b: gpu.upload(&b)?,
            rows: q.rows,
            cols: q.cols,
            bits: q.bits,
            frag,
            frag_copy: None,
            stage_sb,
            dense_bf16: None,
        })
    }
    pub fn ptrs(&self, gpu: &Gpu) -> (u64, u64, u64) {
        (
            ptr(&self.w, &gpu.stream),
            ptr(&self.s, &gpu.stream),
            ptr(&self.b, &gpu.stream),
        )
    }
    pub fn bytes(&self) -> usize {
        (self.w.len() + self.frag_copy.as_ref().map_or(0, |c| c.len())) * 4 + (self.s.len() + self.b.len() + self.stage_sb.as_ref().map_or(0, |c| c.len())) * 2
    }
}

pub struct DevGdn {
    pub in_qkv: DevQ,
    pub in_z: DevQ,
    pub in_b: DevQ,
    pub in_a: DevQ,
    pub conv_taps: CudaSlice<f32>,
    pub dt_bias: CudaSlice<f32>,
    pub neg_a: CudaSlice<f32>,
    pub norm: CudaSlice<f32>,
    pub out: DevQ,
}

pub struct DevAttn {
    pub q: DevQ,
    pub k: DevQ,
    pub v: DevQ,
    pub o: DevQ,
    pub q_norm: CudaSlice<f32>,
    pub k_norm: CudaSlice<f32>,
}

pub enum DevMixer {
    Gdn(DevGdn),
    Attn(DevAttn),
}

pub struct DevMoe {
    pub router: DevQ,
    pub gate_exps: DevQ,
    pub up_exps: DevQ,
    pub down_exps: DevQ,
    pub shared_gate: DevQ,
    pub shared_up: DevQ,
    pub shared_down: DevQ,
    pub shared_expert_gate: DevQ,
}

pub struct DevLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
    pub mixer: DevMixer,
    pub moe: DevMoe,
}

pub struct DevWeights {
    pub embed: DevQ,
    pub layers: Vec<DevLayer>,
    pub final_norm: CudaSlice<f32>,
    pub lm_head: DevQ,
    /// RoPE inverse frequencies (f64, as the CPU reference computes them).
    pub inv_freq: CudaSlice<f64>,
    /// Every few-row product's input fits f16 (what `pf_few_tc` multiplies): see
    /// [`norm_outputs_fit_f16`].
    pub few_inputs_f16: bool,
}

/// Largest |x| the few-row tensor-core products take: half f16's largest finite value, so that
/// rounding x to f16 never overflows.
pub const FEW_INPUT_MAX: f32 = 32768.0;

/// Whether every RMSNorm that feeds a few-row product (each layer's input and post-attention
/// norm: GDN b and a, router and shared-expert gate) stays within [`FEW_INPUT_MAX`]: an output
/// `x_i / rms(x) * g_i` is at most `sqrt(hidden) * |g_i|` in magnitude, since no element of a
/// vector exceeds `sqrt(n)` times its root mean square.
pub fn norm_outputs_fit_f16(mw: &ModelWeights) -> bool {
    let bound = (mw.config.hidden_size as f32).sqrt();
    let largest = |g: &[f32]| g.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    mw.layers.iter().all(|l| [&l.input_norm, &l.post_norm].into_iter().all(|g| largest(g) * bound <= FEW_INPUT_MAX))
}

impl DevWeights {
    /// Keeps the dense matrices the long prefill chunks multiply on cuBLAS (GDN in and out,
    /// attention q, k, v and o, the shared expert) dequantised to bf16 ([`DevQ::dense_bf16`]), so a
    /// chunk no longer dequantises ~3.5 GB of them first (the 35B: 2.8 GB kept), when they take at
    /// most an eighth of what `fraction` of the device leaves besides the weights (the rest stays
    /// for sequences); else nothing. Returns the bytes kept.
    pub fn keep_dense_bf16(&mut self, gpu: &Gpu, group: usize, fraction: f64) -> Result<usize> {
        let mut dense = self.dense_matrices();
        dense.retain(|q| !q.frag);
        let bytes: usize = dense.iter().map(|q| q.rows * q.cols * 2).sum();
        let (free, total) = gpu.mem_info()?;
        let room = ((total as f64 * fraction) as usize).saturating_sub(total - free);
        if bytes == 0 || bytes > room / 8 {
            return Ok(0);
        }
        for q in dense {
            q.dense_bf16 = Some(super::qmatmul::dense_bf16_copy(gpu, q, group)?);
        }
        Ok(bytes)
    }

    /// The dense matrices of every layer: GDN in and out, attention q, k, v and o, the shared
    /// expert (what the long prefill chunks multiply on cuBLAS).
    pub fn dense_matrices(&mut self) -> Vec<&mut DevQ> {
        let mut dense: Vec<&mut DevQ> = Vec::new();
        for l in self.layers.iter_mut() {
            match &mut l.mixer {
                DevMixer::Gdn(g) => dense.extend([&mut g.in_qkv, &mut g.in_z, &mut g.out]),
                DevMixer::Attn(a) => dense.extend([&mut a.q, &mut a.k, &mut a.v, &mut a.o]),
            }
            dense.extend([&mut l.moe.shared_gate, &mut l.moe.shared_up, &mut l.moe.shared_down]);
        }
        dense
    }

    /// Uploads everything; checks free memory first so a too-large model fails with one line.
    /// `frag_experts`: the routed experts' codes in fragment order and a fragment-order copy of
    /// the shared expert's (what the tensor-core expert kernels read; moe::fragment_order_experts).
    pub fn upload(gpu: &Gpu, mw: &ModelWeights, host_bytes: usize, frag_experts: bool) -> Result<Self> {
        let (free, total) = gpu.mem_info()?;
        // Weights, their fragment-order copies (below) and ~1 GiB for activations, kernels and
        // the context.
        let copies: usize = mw
            .layers
            .iter()
            .flat_map(|l| {
                let mixer: Vec<&QuantTensor> = match &l.mixer {
                    MixerWeights::Gdn(g) => vec![&g.in_qkv, &g.in_z, &g.in_b, &g.in_a, &g.out],
                    MixerWeights::Attention(a) => vec![&a.q, &a.k, &a.v, &a.o],
                };
                let shared = [&l.moe.shared_gate, &l.moe.shared_up, &l.moe.shared_down].into_iter().filter(move |_| frag_experts);
                mixer.into_iter().chain(shared)
            })
            .chain([&mw.lm_head])
            .filter(|t| frag_shape(t.bits, t.group, t.cols))
            .map(|t| t.rows.next_multiple_of(16) * t.cols / 2)
            .sum();
        // The gate|up matrices' stage-order scales and biases (below): 4 bytes per row and group.
        let stage_copies: usize = mw
            .layers
            .iter()
            .flat_map(|l| [&l.moe.gate_exps, &l.moe.up_exps, &l.moe.shared_gate, &l.moe.shared_up])
            .filter(|t| frag_experts && stage_scales_fit(t))
            .map(|t| t.rows.next_multiple_of(16) * (t.cols / 64) * 4)
            .sum();
        let needed = host_bytes + copies + stage_copies;
        if needed + (1 << 30) > free {
            bail!(
                "not enough GPU memory for the weights: {:.1} GiB needed, {:.1} GiB free of {:.1} GiB",
                needed as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            );
        }
        let q = |t: &QuantTensor| DevQ::upload(gpu, t);
        // Gate and up (`glu`, routed and shared): their scales and biases in stage order too, for
        // the batched decode's ring kernel over fragment-order codes (`moe_tcr_f`).
        let experts = |t: &QuantTensor, glu: bool| if frag_experts { DevQ::upload_frag(gpu, t, glu && stage_scales_fit(t)) } else { DevQ::upload(gpu, t) };
        let shared = |t: &QuantTensor, glu: bool| if frag_experts { DevQ::upload_with_frag_copy(gpu, t, glu && stage_scales_fit(t)) } else { DevQ::upload(gpu, t) };
        // The projections and the lm_head: row order for the one-sequence GEMVs and the prefill,
        // and a fragment-order copy for the batched decode's GEMV sets (`gemv_tcb_f`).
        let dense = |t: &QuantTensor| if frag_shape(t.bits, t.group, t.cols) { DevQ::upload_with_frag_copy(gpu, t, false) } else { DevQ::upload(gpu, t) };
        let f = |v: &[f32]| gpu.upload(v);
        let mut layers = Vec::with_capacity(mw.layers.len());
        for l in &mw.layers {
            let mixer = match &l.mixer {
                MixerWeights::Gdn(g) => DevMixer::Gdn(DevGdn {
                    in_qkv: dense(&g.in_qkv)?,
                    in_z: dense(&g.in_z)?,
                    in_b: dense(&g.in_b)?,
                    in_a: dense(&g.in_a)?,
                    conv_taps: f(&g.conv_taps)?,
                    dt_bias: f(&g.dt_bias)?,
                    neg_a: f(&g.neg_a)?,
                    norm: f(&g.norm)?,
                    out: dense(&g.out)?,
                }),
                MixerWeights::Attention(a) => DevMixer::Attn(DevAttn {
                    q: dense(&a.q)?,
                    k: dense(&a.k)?,
                    v: dense(&a.v)?,
                    o: dense(&a.o)?,
                    q_norm: f(&a.q_norm)?,
                    k_norm: f(&a.k_norm)?,
                }),
            };
            let m = &l.moe;
            for (t, want) in [
                (&m.gate_exps, 4),
                (&m.up_exps, 4),
                (&m.down_exps, 4),
                (&m.shared_gate, 4),
                (&m.shared_up, 4),
                (&m.shared_down, 4),
            ] {
                if t.bits != want {
                    bail!(
                        "{}: {}-bit, the CUDA MoE kernels expect {want}-bit experts",
                        t.name,
                        t.bits
                    );
                }
            }
            layers.push(DevLayer {
                input_norm: f(&l.input_norm)?,
                post_norm: f(&l.post_norm)?,
                mixer,
                moe: DevMoe {
                    router: q(&m.router)?,
                    gate_exps: experts(&m.gate_exps, true)?,
                    up_exps: experts(&m.up_exps, true)?,
                    down_exps: experts(&m.down_exps, false)?,
                    shared_gate: shared(&m.shared_gate, true)?,
                    shared_up: shared(&m.shared_up, true)?,
                    shared_down: shared(&m.shared_down, false)?,
                    shared_expert_gate: q(&m.shared_expert_gate)?,
                },
            });
        }
        Ok(DevWeights {
            embed: q(&mw.embed)?,
            layers,
            final_norm: f(&mw.final_norm)?,
            lm_head: dense(&mw.lm_head)?,
            inv_freq: gpu.upload(&crate::backend::cpu::ops::rope_inv_freq(
                mw.config.rotary_dim(),
                mw.config.rope_theta,
            ))?,
            few_inputs_f16: norm_outputs_fit_f16(mw),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{fragment_order, stage_order_scales};

    /// kernels/common.cuh `frag_word`, the device's index formula for the same order.
    fn frag_word(row: usize, wi: usize, cols: usize) -> usize {
        let gpr = cols >> 6;
        ((((row >> 4) * gpr + (wi >> 3)) * 32 + 4 * (row & 7) + ((wi & 7) >> 1)) << 2) + ((row >> 2) & 2) + (wi & 1)
    }

    #[test]
    fn fragment_order_is_the_kernels_index_map_padded_to_whole_tiles() {
        for (rows, cols) in [(32usize, 128usize), (4, 64), (40, 192)] {
            let wpr = cols / 8;
            let words: Vec<u32> = (0..rows * wpr).map(|i| i as u32 + 1).collect();
            let out = fragment_order(&words, rows, cols);
            assert_eq!(out.len(), rows.div_ceil(16) * 16 * wpr);
            let mut hit = vec![false; out.len()];
            for row in 0..rows {
                for wi in 0..wpr {
                    let at = frag_word(row, wi, cols);
                    assert_eq!(out[at], words[row * wpr + wi], "{rows} x {cols}: row {row} word {wi}");
                    hit[at] = true;
                }
            }
            // Everything else is the padding rows' zeros.
            assert!(out.iter().zip(&hit).all(|(v, h)| *h || *v == 0));
            // Lane 1 (g = 0, t = 1) of the first block: words 2 and 3 of rows 0 and 8.
            let row8 = |w: usize| if rows > 8 { words[8 * wpr + w] } else { 0 };
            assert_eq!(out[4..8], [words[2], words[3], row8(2), row8(3)]);
        }
    }

    /// tcr_issue's (kernels/common.cuh) byte offset of the stage holding group `grp` of tile row
    /// `row`'s block, plus the row's place in it: where its stage's scales and biases start.
    fn stage_byte(row: usize, grp: usize, gpr: usize) -> usize {
        (((row >> 4) * (gpr / 2) + grp / 2) * (16 * 2 * 4)) + (row & 15) * 8
    }

    #[test]
    fn stage_order_scales_are_the_ring_stages_layout_padded_to_whole_tiles() {
        for (rows, gpr) in [(32usize, 4usize), (20, 2), (48, 32)] {
            let s: Vec<u16> = (0..rows * gpr).map(|i| 1 + i as u16).collect();
            let b: Vec<u16> = (0..rows * gpr).map(|i| 30_000 + i as u16).collect();
            let out = stage_order_scales(&s, &b, rows, gpr);
            assert_eq!(out.len(), rows.div_ceil(16) * 16 * gpr * 2);
            let mut hit = vec![false; out.len()];
            for r in 0..rows {
                for g in 0..gpr {
                    // A stage row: the scales of its two groups, then their biases (bf16 words).
                    let at = stage_byte(r, g, gpr) / 2 + (g & 1);
                    assert_eq!(out[at], s[r * gpr + g], "{rows} x {gpr}: scale of row {r} group {g}");
                    assert_eq!(out[at + 2], b[r * gpr + g], "{rows} x {gpr}: bias of row {r} group {g}");
                    hit[at] = true;
                    hit[at + 2] = true;
                }
            }
            assert!(out.iter().zip(&hit).all(|(v, h)| *h || *v == 0), "padding rows are zeros");
        }
    }
}
