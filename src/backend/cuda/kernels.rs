//! Launch wrappers: one function per kernel, argument lists in the order of the `extern "C"`
//! signatures in `kernels/*.cu`. Grid shapes are chosen here.

use super::context::{Arg, Gpu};
use anyhow::Result;

/// Threads per GEMV block (8 warps, one row per warp at a time).
pub const GEMV_THREADS: u32 = 256;

/// Mirrors `struct QMat` in kernels/gemv.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct QMatDesc {
    pub w: u64,
    pub s: u64,
    pub b: u64,
    pub y: u64,
    pub rows: i32,
    pub bits: i32,
    pub accumulate: i32,
    pub pad: i32,
}

/// A group of matrices sharing one input, stored contiguously in the descriptor buffer.
#[derive(Clone, Copy, Debug)]
pub struct GemvSet {
    /// Device address of the first descriptor.
    pub descs: u64,
    pub count: usize,
    pub rows: usize,
    /// 16-row tiles over the set (each matrix rounded up on its own): `gemv_tc`'s work.
    pub tiles: usize,
    /// Every matrix is 4-bit (the tensor-core GEMV applies; the 8-bit router does not).
    pub all4: bool,
}

/// `y_m (+)= W_m · norm(x)` for every matrix of the set (norm only when `gain` is non-zero);
/// block 0 also writes the normalised input to `xnorm_out` when non-zero.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    set: GemvSet,
    x: u64,
    cols: usize,
    gain: u64,
    eps: f32,
    group: usize,
    xnorm_out: u64,
) -> Result<()> {
    // Sets of few tiles (the out-projections) stay on gemv_q: 430.5 vs 426.8 tok/s at 4K with the
    // 128-tile out-projections on gemv_tc (16 warps of 256 columns per tile; 418.6 with 8 of
    // 512), H200 2026-11-29.
    if gpu.decode_tc
        && set.all4
        && group == 64
        && cols.is_multiple_of(64)
        && set.tiles >= gpu.gemv_tc_min_tiles()
    {
        return gemv_tc(gpu, set, x, cols, gain, eps, xnorm_out);
    }
    let warps = (GEMV_THREADS / 32) as usize;
    let smem = ((cols + cols / group + 33) * 4) as u32;
    // Each warp takes two rows per iteration (kernels/gemv.cu). At most one wave of resident
    // blocks: a second wave would repeat the activation prologue on the critical path, while
    // extra rows per warp are prefetched into L2 one iteration ahead.
    let per_sm = gemv_blocks_per_sm(gpu, "gemv_q", smem, 4)?;
    // Measurement knob: LILY_CUDA_GEMV_WAVES=n allows n waves of blocks (default 1).
    static WAVES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let waves = *WAVES.get_or_init(|| {
        std::env::var("LILY_CUDA_GEMV_WAVES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1usize)
            .max(1)
    });
    // Two rows per warp when the set fills the resident blocks that way; smaller sets (the
    // router, the out-projections) get one row per warp and twice the blocks, so more SMs have
    // loads in flight (ncu 2026-11-29: the 257-row router ran on 17 SMs, the 2048-row
    // out-projection at 8 warps per SM).
    let wave = gpu.sms as usize * per_sm * waves;
    let rows_per_warp = if set.rows.div_ceil(2 * warps) >= wave { 2 } else { 1 };
    let blocks = set
        .rows
        .div_ceil(rows_per_warp * warps)
        .min(wave)
        .max(1) as u32;
    gpu.launch(
        "gemv_q",
        (blocks, 1, 1),
        GEMV_THREADS,
        smem,
        &[
            &gemv_args(set, x, cols, gain, eps)[..],
            &[Arg::I(group as i32), Arg::P(xnorm_out)],
        ]
        .concat(),
    )
}

/// The launch arguments `gemv_q` and `gemv_tc` begin with: the set, the input and its norm.
fn gemv_args(set: GemvSet, x: u64, cols: usize, gain: u64, eps: f32) -> [Arg; 6] {
    [
        Arg::P(set.descs),
        Arg::I(set.count as i32),
        Arg::P(x),
        Arg::I(cols as i32),
        Arg::P(gain),
        Arg::F(eps),
    ]
}

/// Resident blocks per SM of a GEMV kernel with `smem` bytes of shared memory, 1 to 8
/// (`fallback` when the driver does not say).
fn gemv_blocks_per_sm(gpu: &Gpu, kernel: &str, smem: u32, fallback: u32) -> Result<usize> {
    Ok(gpu
        .func(kernel)?
        .occupancy_max_active_blocks_per_multiprocessor(GEMV_THREADS, smem as usize, None)
        .unwrap_or(fallback)
        .clamp(1, 8) as usize)
}

/// Shared memory of the tensor-core decode kernels: activation fragments and group sums of `n`
/// values, the reduction scratch, and 16 partial sums per warp (kernels/common.cuh, gemv.cu).
fn tc_smem(n: usize, warps: usize) -> u32 {
    ((n / 64 * (TCX_WORDS + 1) + 33 + warps * 16) * 4) as u32
}
/// Fragment words per 64-column group (TCX_WORDS in kernels/common.cuh).
const TCX_WORDS: usize = 96;
/// Groups of 64 columns per tensor-core work item (TC_NG in kernels/common.cuh).
const TC_NG: usize = 8;

/// `gemv` on the tensor cores (kernels/gemv.cu `gemv_tc`). Each 16-row tile is split into
/// `slices` warps of `kc` 512-column chunks: the fewest slices that still give about one wave
/// of warps (the lm_head needs none; GDN in-proj and q|k|v take 4).
fn gemv_tc(
    gpu: &Gpu,
    set: GemvSet,
    x: u64,
    cols: usize,
    gain: u64,
    eps: f32,
    xnorm_out: u64,
) -> Result<()> {
    let warps = (GEMV_THREADS / 32) as usize;
    let smem = tc_smem(cols, warps);
    let per_sm = gemv_blocks_per_sm(gpu, "gemv_tc", smem, 1)?;
    let wave_warps = gpu.sms as usize * per_sm * warps;
    let chunks = (cols / 64).div_ceil(TC_NG);
    // Slice counts that divide the chunks (1 always does); the most of them as the fallback.
    let allowed = || [1usize, 2, 4, 8].into_iter().filter(|s| chunks.is_multiple_of(*s));
    let slices = allowed()
        .find(|s| set.tiles * s >= wave_warps)
        .unwrap_or_else(|| allowed().next_back().unwrap_or(1));
    let kc = chunks / slices;
    let tiles_per_block = warps / slices;
    let blocks = set
        .tiles
        .div_ceil(tiles_per_block)
        .min(gpu.sms as usize * per_sm)
        .max(1) as u32;
    gpu.launch(
        "gemv_tc",
        (blocks, 1, 1),
        GEMV_THREADS,
        smem,
        &[
            &gemv_args(set, x, cols, gain, eps)[..],
            &[Arg::I(slices as i32), Arg::I(kc as i32), Arg::P(xnorm_out)],
        ]
        .concat(),
    )
}

#[allow(clippy::too_many_arguments)]
pub fn embed(
    gpu: &Gpu,
    w: (u64, u64, u64),
    step: u64,
    cols: usize,
    bits: usize,
    group: usize,
    x: u64,
) -> Result<()> {
    let blocks = cols.div_ceil(256) as u32;
    gpu.launch(
        "embed_q",
        (blocks, 1, 1),
        256,
        0,
        &[
            Arg::P(w.0),
            Arg::P(w.1),
            Arg::P(w.2),
            Arg::P(step),
            Arg::I(cols as i32),
            Arg::I(bits as i32),
            Arg::I(group as i32),
            Arg::P(x),
        ],
    )
}

/// Blocks of `argmax_next` (each reduces a slice; the last one to finish merges).
pub const ARGMAX_BLOCKS: u32 = 64;

/// Device argmax of `logits` into the step buffer (next token, position + 1). `part`: scratch of
/// `2 * ARGMAX_BLOCKS + 1` floats whose last word (the ticket) must be zero (the kernel leaves it
/// zero again).
pub fn argmax_next(gpu: &Gpu, logits: u64, n: usize, step: u64, part: u64) -> Result<()> {
    gpu.launch(
        "argmax_next",
        (ARGMAX_BLOCKS, 1, 1),
        1024,
        0,
        &[Arg::P(logits), Arg::I(n as i32), Arg::P(step), Arg::P(part)],
    )
}

/// Holds the stream for `us` microseconds (one block spinning; the profiler's queue filler).
pub fn spin_us(gpu: &Gpu, us: u32) -> Result<()> {
    gpu.launch(
        "argmax_next",
        (1, 1, 1),
        32,
        0,
        &[
            Arg::P(0),
            Arg::I(-(us.min(i32::MAX as u32) as i32)),
            Arg::P(0),
            Arg::P(0),
        ],
    )
}

/// Shape constants of the GDN step.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
    pub kc: usize,
    pub eps: f32,
}

impl GdnDims {
    pub fn threads(&self) -> u32 {
        (self.dv * (self.dk / 32)) as u32
    }
    pub fn smem(&self) -> u32 {
        ((2 * self.dk + self.dv + 2 * (self.dk / 32) * self.dv + 33) * 4) as u32
    }
}

/// Pointers of one GDN step: inputs (qkv, z, b, a), weights (taps, dt_bias, neg_a, norm),
/// sequence state (ring, state), output y and the step buffer.
pub struct GdnPtrs {
    pub qkv: u64,
    pub z: u64,
    pub b: u64,
    pub a: u64,
    pub ring: u64,
    pub taps: u64,
    pub dt_bias: u64,
    pub neg_a: u64,
    pub norm: u64,
    pub state: u64,
    pub y: u64,
    pub step: u64,
}

pub fn gdn_step(gpu: &Gpu, d: GdnDims, p: &GdnPtrs) -> Result<()> {
    let args = [
        Arg::P(p.qkv),
        Arg::P(p.z),
        Arg::P(p.b),
        Arg::P(p.a),
        Arg::P(p.ring),
        Arg::P(p.taps),
        Arg::P(p.dt_bias),
        Arg::P(p.neg_a),
        Arg::P(p.norm),
        Arg::P(p.state),
        Arg::P(p.y),
        Arg::P(p.step),
        Arg::I(d.nk as i32),
        Arg::I(d.nv as i32),
        Arg::I(d.dk as i32),
        Arg::I(d.dv as i32),
        Arg::I(d.kc as i32),
        Arg::F(d.eps),
    ];
    gpu.launch("gdn_step", (d.nv as u32, 1, 1), d.threads(), d.smem(), &args)
}

#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    pub half_rot: usize,
    pub eps: f32,
    /// The sequence's KV cache holds bf16 (the `_bf16` kernel instances) instead of f32.
    pub kv_bf16: bool,
}

/// Suffix of the attention kernel instances for a KV cache element type.
pub fn kv_suffix(kv_bf16: bool) -> &'static str {
    if kv_bf16 {
        "_bf16"
    } else {
        ""
    }
}

pub struct AttnPtrs {
    pub qg: u64,
    pub kraw: u64,
    pub vraw: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub inv_freq: u64,
    pub q: u64,
    pub gate: u64,
    pub kcache: u64,
    pub vcache: u64,
    pub step: u64,
    pub part_o: u64,
    pub part_ml: u64,
    pub out: u64,
}

/// Norms + RoPE + KV append, split-KV attention, combine with the output gate.
pub fn attention(gpu: &Gpu, d: AttnDims, p: &AttnPtrs, splits: usize) -> Result<()> {
    attn_prep(gpu, d, p)?;
    attn_split(gpu, d, p, splits)?;
    attn_combine(gpu, d, p, splits)
}

/// q/k RMSNorm + partial RoPE + KV append at the current position.
pub fn attn_prep(gpu: &Gpu, d: AttnDims, p: &AttnPtrs) -> Result<()> {
    gpu.launch(
        if d.kv_bf16 { "attn_prep_bf16" } else { "attn_prep" },
        ((d.nh + d.nkv) as u32, 1, 1),
        d.hd as u32,
        ((d.hd + 33) * 4) as u32,
        &[
            Arg::P(p.qg),
            Arg::P(p.kraw),
            Arg::P(p.vraw),
            Arg::P(p.q_norm),
            Arg::P(p.k_norm),
            Arg::P(p.inv_freq),
            Arg::P(p.q),
            Arg::P(p.gate),
            Arg::P(p.kcache),
            Arg::P(p.vcache),
            Arg::P(p.step),
            Arg::I(d.nh as i32),
            Arg::I(d.nkv as i32),
            Arg::I(d.hd as i32),
            Arg::I(d.half_rot as i32),
            Arg::F(d.eps),
        ],
    )
}

/// Dynamic shared memory of the tiled split kernel: ATTN_NS (3) f32 stages x (K + V) x ATTN_TP
/// (16) rows; a bf16 cache uses the same bytes as twice the stages (kernels/attention.cu).
pub fn attn_tiled_smem(hd: usize) -> u32 {
    (3 * 2 * 16 * hd * 4) as u32
}

/// Split-KV online-softmax partials (`splits` per KV head).
pub fn attn_split(gpu: &Gpu, d: AttnDims, p: &AttnPtrs, splits: usize) -> Result<()> {
    let name = format!(
        "attn_split_{}{}{}",
        if gpu.attn_tiled { "" } else { "reg_" },
        d.hd,
        kv_suffix(d.kv_bf16)
    );
    let smem = if gpu.attn_tiled {
        attn_tiled_smem(d.hd)
    } else {
        0
    };
    let group = d.nh / d.nkv;
    gpu.launch(
        &name,
        (d.nkv as u32, splits as u32, 1),
        (group * 32) as u32,
        smem,
        &[
            Arg::P(p.q),
            Arg::P(p.kcache),
            Arg::P(p.vcache),
            Arg::P(p.step),
            Arg::I(d.nh as i32),
            Arg::I(d.nkv as i32),
            Arg::I(splits as i32),
            Arg::F(1.0 / (d.hd as f32).sqrt()),
            Arg::P(p.part_o),
            Arg::P(p.part_ml),
        ],
    )
}

/// Merge of the splits + sigmoid output gate (grid: q heads x 32-dim slices, 8 warps).
pub fn attn_combine(gpu: &Gpu, d: AttnDims, p: &AttnPtrs, splits: usize) -> Result<()> {
    gpu.launch(
        "attn_combine",
        (d.nh as u32, (d.hd / 32) as u32, 1),
        256,
        0,
        &[
            Arg::P(p.part_o),
            Arg::P(p.part_ml),
            Arg::P(p.gate),
            Arg::I(splits as i32),
            Arg::I(d.hd as i32),
            Arg::P(p.out),
        ],
    )
}

#[derive(Clone, Copy, Debug)]
pub struct MoeDims {
    pub e: usize,
    pub k: usize,
    pub inter: usize,
    pub sinter: usize,
    pub hidden: usize,
    pub group: usize,
    /// Every expert matrix (routed and shared) is 4-bit.
    pub all4: bool,
}

pub struct MoePtrs {
    pub logits: u64,
    pub gate: (u64, u64, u64),
    pub up: (u64, u64, u64),
    pub down: (u64, u64, u64),
    pub sgate: (u64, u64, u64),
    pub sup: (u64, u64, u64),
    pub sdown: (u64, u64, u64),
    pub shared_gate_logit: u64,
    pub u: u64,
    pub act: u64,
    pub top_ids: u64,
    pub top_w: u64,
    pub x: u64,
}

/// Whether the tensor-core MoE kernels take this model: 4-bit experts with group 64 (the loader
/// only accepts that), widths in whole groups, routed and shared experts of one width, and the
/// staged activations within the default 48 KiB of shared memory.
fn moe_tc_applies(gpu: &Gpu, d: &MoeDims) -> bool {
    let warps_down = d.k + 1;
    gpu.decode_tc
        && d.all4
        && d.group == 64
        && d.hidden.is_multiple_of(64)
        && d.inter.is_multiple_of(64)
        && d.inter == d.sinter
        && d.inter / 64 <= TC_NG
        && warps_down <= 32
        && tc_smem((d.k + 1) * d.inter, warps_down) as usize <= 48 * 1024
        && tc_smem(d.hidden, 8) as usize <= 48 * 1024
}

/// Arguments of `moe_gate_up` and `moe_gate_up_tc` (kernels/moe.cu): one list, with the
/// kernel's own tuning parameters (`group`, or `slices, kc`) after the input width.
fn gate_up_args(d: &MoeDims, p: &MoePtrs, tuning: &[Arg]) -> Vec<Arg> {
    let mut a = vec![
        Arg::P(p.logits),
        Arg::I(d.e as i32),
        Arg::I(d.k as i32),
        Arg::P(p.gate.0),
        Arg::P(p.gate.1),
        Arg::P(p.gate.2),
        Arg::P(p.up.0),
        Arg::P(p.up.1),
        Arg::P(p.up.2),
        Arg::I(d.inter as i32),
        Arg::P(p.sgate.0),
        Arg::P(p.sgate.1),
        Arg::P(p.sgate.2),
        Arg::P(p.sup.0),
        Arg::P(p.sup.1),
        Arg::P(p.sup.2),
        Arg::I(d.sinter as i32),
        Arg::P(p.u),
        Arg::I(d.hidden as i32),
    ];
    a.extend_from_slice(tuning);
    a.extend([
        Arg::P(p.act),
        Arg::P(p.top_ids),
        Arg::P(p.top_w),
        Arg::P(p.down.0),
        Arg::P(p.down.1),
        Arg::P(p.down.2),
        Arg::P(p.sdown.0),
        Arg::P(p.sdown.1),
        Arg::P(p.sdown.2),
        Arg::I(d.hidden as i32),
    ]);
    a
}

/// Arguments of `moe_down` and `moe_down_tc`: one list; `third` is the shared expert's width
/// (`moe_down`) or the warps per expert (`moe_down_tc`), `tuning` goes before the output.
fn down_args(d: &MoeDims, p: &MoePtrs, third: Arg, tuning: &[Arg]) -> Vec<Arg> {
    let mut a = vec![
        Arg::P(p.act),
        Arg::P(p.top_ids),
        Arg::P(p.top_w),
        Arg::I(d.k as i32),
        Arg::I(d.inter as i32),
        third,
        Arg::P(p.down.0),
        Arg::P(p.down.1),
        Arg::P(p.down.2),
        Arg::P(p.sdown.0),
        Arg::P(p.sdown.1),
        Arg::P(p.sdown.2),
        Arg::P(p.shared_gate_logit),
        Arg::I(d.hidden as i32),
    ];
    a.extend_from_slice(tuning);
    a.push(Arg::P(p.x));
    a
}

/// Tensor-core MoE decode (kernels/moe.cu `moe_gate_up_tc`, `moe_down_tc`).
fn moe_tc(gpu: &Gpu, d: MoeDims, p: &MoePtrs) -> Result<()> {
    let chunks = (d.hidden / 64).div_ceil(TC_NG);
    let slices = [4usize, 2, 1]
        .into_iter()
        .find(|s| chunks.is_multiple_of(*s))
        .unwrap_or(1);
    let kc = chunks / slices;
    let warps = 2 * slices;
    gpu.launch(
        "moe_gate_up_tc",
        (d.inter.max(d.sinter).div_ceil(16) as u32, (d.k + 1) as u32, 1),
        (warps * 32) as u32,
        tc_smem(d.hidden, warps),
        &gate_up_args(&d, p, &[Arg::I(slices as i32), Arg::I(kc as i32)]),
    )?;
    // Each expert's down rows over two warps (LILY_CUDA_MOE_DOWN_SPLIT=1: one): 2,304 warps
    // instead of 1,152 for the 35B; 404.1 vs 398.9 tok/s decode at 4K on the H200 (2026-11-29).
    static SPLIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let split = *SPLIT.get_or_init(|| {
        std::env::var("LILY_CUDA_MOE_DOWN_SPLIT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|s| (1..=2).contains(s))
            .unwrap_or(2usize)
    });
    let warps = (d.k + 1) * split;
    gpu.launch(
        "moe_down_tc",
        (d.hidden.div_ceil(16) as u32, 1, 1),
        (warps * 32) as u32,
        tc_smem((d.k + 1) * d.inter, warps),
        &down_args(&d, p, Arg::I(split as i32), &[]),
    )
}

pub fn moe(gpu: &Gpu, d: MoeDims, p: &MoePtrs) -> Result<()> {
    if moe_tc_applies(gpu, &d) {
        return moe_tc(gpu, d, p);
    }
    // Measurement knob: LILY_CUDA_MOE_WARPS=4 runs both MoE kernels in blocks of 4 warps (twice
    // the blocks; ncu put them at ~17-24 warps per SM with 8). Must be 1..=32.
    static WARPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let warps = *WARPS.get_or_init(|| {
        std::env::var("LILY_CUDA_MOE_WARPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|w| (1..=32).contains(w))
            .unwrap_or(8usize)
    });
    let rows = d.inter.max(d.sinter);
    let smem = ((d.hidden + d.hidden / d.group + 33) * 4) as u32;
    gpu.launch(
        "moe_gate_up",
        (rows.div_ceil(2 * warps) as u32, (d.k + 1) as u32, 1),
        (warps * 32) as u32,
        smem,
        &gate_up_args(&d, p, &[Arg::I(d.group as i32)]),
    )?;
    let n_act = d.k * d.inter + d.sinter;
    let smem = ((n_act + n_act / d.group + 33) * 4) as u32;
    gpu.launch(
        "moe_down",
        (d.hidden.div_ceil(warps) as u32, 1, 1),
        (warps * 32) as u32,
        smem,
        &down_args(&d, p, Arg::I(d.sinter as i32), &[Arg::I(d.group as i32)]),
    )
}

// SAFETY: plain-old-data with the C layout of `struct QMat`; all-zero bits are a valid value.
unsafe impl cudarc::driver::DeviceRepr for QMatDesc {}
unsafe impl cudarc::driver::ValidAsZeroBits for QMatDesc {}
