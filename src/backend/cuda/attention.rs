//! Gated attention (kernels/attention.cu), the CUDA side of `cpu/attention.rs`: q/k RMSNorm +
//! partial RoPE + KV append, then split-KV decode (online-softmax partials streamed through a
//! cp.async ring, merged with the output gate) for one token, or causal flash attention over T
//! tokens (bf16 tensor cores, or f32 in the exact mode). The KV cache holds f32 or bf16; every
//! kernel has an instance per element type (`_bf16`).

use super::device::{segment_table, Arg, Gpu, TABLE_SEGS};
use super::registry::{Kernel, ATTENTION};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};

const ATTN_PREP: [Kernel; 2] = [Kernel::dependent(&ATTENTION, "attn_prep"), Kernel::dependent(&ATTENTION, "attn_prep_bf16")];
const ATTN_COMBINE: Kernel = Kernel::dependent(&ATTENTION, "attn_combine");
const ATTN_PREP_BATCH: [Kernel; 2] = [Kernel::dependent(&ATTENTION, "attn_prep_batch"), Kernel::dependent(&ATTENTION, "attn_prep_batch_bf16")];
const ATTN_COMBINE_BATCH: Kernel = Kernel::dependent(&ATTENTION, "attn_combine_batch");
const PF_ATTN_PREP: [Kernel; 2] = [Kernel::ordered(&ATTENTION, "pf_attn_prep"), Kernel::ordered(&ATTENTION, "pf_attn_prep_bf16")];
const PF_ATTN_PREP_Q16: Kernel = Kernel::ordered(&ATTENTION, "pf_attn_prep_q16");

/// Most KV splits per head in decode: 2 KV heads x 128 splits x 96 KiB of shared memory is about
/// one wave at two blocks per SM; each split streams its rows through the cp.async ring, so
/// longer splits cost bandwidth, not latency.
pub const MAX_SPLITS: usize = 128;

/// Positions per split before another split is added.
const POS_PER_SPLIT: usize = 32;

/// Splits of decode attention over a context of `len` positions (a captured step uses its
/// sequence's max-seq, so the graph serves every length).
pub fn splits_for(len: usize) -> usize {
    len.div_ceil(POS_PER_SPLIT).clamp(1, MAX_SPLITS)
}

#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    pub half_rot: usize,
    pub eps: f32,
    /// The sequence's KV cache holds bf16 instead of f32.
    pub kv_bf16: bool,
}

impl AttnDims {
    pub fn new(cfg: &ModelConfig, kv_bf16: bool) -> Self {
        AttnDims {
            nh: cfg.num_attention_heads,
            nkv: cfg.num_key_value_heads,
            hd: cfg.head_dim,
            half_rot: cfg.rotary_dim() / 2,
            eps: cfg.rms_norm_eps as f32,
            kv_bf16,
        }
    }
    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
    /// What the wgmma core multiplies q by before rounding it to bf16 (the scale in exp2 units,
    /// as `pf_attn_wg` computes it): `pf_attn_prep_q16` applies it for the core.
    pub fn q16_scale(&self) -> f32 {
        self.scale() * std::f32::consts::LOG2_E
    }
    fn prep_smem(&self) -> u32 {
        ((self.hd + 33) * 4) as u32
    }
}

/// The layer's weights and cache, and the activations it reads and writes.
#[derive(Clone, Copy, Debug)]
pub struct AttnPtrs {
    /// q|gate projection `[T][nh][2 * hd]`, raw k and v `[T][nkv * hd]`.
    pub qg: u64,
    pub kraw: u64,
    pub vraw: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub inv_freq: u64,
    /// Normed, rotated q and the gate, `[T][nh * hd]`.
    pub q: u64,
    pub gate: u64,
    pub kcache: u64,
    pub vcache: u64,
    /// Gated output `[T][nh * hd]`.
    pub out: u64,
}

fn kv_index(kv_bf16: bool) -> usize {
    kv_bf16 as usize
}

/// Kernel instances per head dim (64, 128, 256) and KV cache element type (f32, bf16).
type Instances = [[&'static str; 2]; 3];
const SPLIT: Instances = [
    ["attn_split_64", "attn_split_64_bf16"],
    ["attn_split_128", "attn_split_128_bf16"],
    ["attn_split_256", "attn_split_256_bf16"],
];
const SPLIT_BATCH: Instances = [
    ["attn_split_batch_64", "attn_split_batch_64_bf16"],
    ["attn_split_batch_128", "attn_split_batch_128_bf16"],
    ["attn_split_batch_256", "attn_split_batch_256_bf16"],
];
/// bf16 cache only (the f32 column is never selected).
const SPLIT_TC_BATCH: Instances = [
    ["attn_split_tc_batch_64", "attn_split_tc_batch_64"],
    ["attn_split_tc_batch_128", "attn_split_tc_batch_128"],
    ["attn_split_tc_batch_256", "attn_split_tc_batch_256"],
];
const CHUNK_F32: Instances = [
    ["pf_attn_64", "pf_attn_64_bf16"],
    ["pf_attn_128", "pf_attn_128_bf16"],
    ["pf_attn_256", "pf_attn_256_bf16"],
];
const CHUNK_TC: Instances = [
    ["pf_attn_tc_64", "pf_attn_tc_64_bf16"],
    ["pf_attn_tc_128", "pf_attn_tc_128_bf16"],
    ["pf_attn_tc_256", "pf_attn_tc_256_bf16"],
];
/// bf16 cache only (the f32 column is never selected).
const CHUNK_WG: Instances = [["pf_attn_wg_64", "pf_attn_wg_64"], ["pf_attn_wg_128", "pf_attn_wg_128"], ["pf_attn_wg_256", "pf_attn_wg_256"]];
/// `pf_attn_wg` over `pf_attn_prep_q16`'s q, the gate read from the q|gate projection.
const CHUNK_WG_Q16: Instances = [["pf_attn_wg_q16_64", "pf_attn_wg_q16_64"], ["pf_attn_wg_q16_128", "pf_attn_wg_q16_128"], ["pf_attn_wg_q16_256", "pf_attn_wg_q16_256"]];

/// The instance of `table` for a head dim and cache element type.
fn instance(table: &Instances, hd: usize, kv_bf16: bool) -> Option<&'static str> {
    let i = [64, 128, 256].iter().position(|&d| d == hd)?;
    Some(table[i][kv_index(kv_bf16)])
}

/// The decode split kernel for a head dim and cache element type.
pub fn select_split(hd: usize, kv_bf16: bool) -> Option<Kernel> {
    Some(Kernel::dependent(&ATTENTION, instance(&SPLIT, hd, kv_bf16)?))
}

/// Dynamic shared memory of the split kernel: 3 f32 stages x (K + V) x 16 rows; a bf16 cache uses
/// the same bytes as twice the stages.
fn split_smem(hd: usize) -> u32 {
    (3 * 2 * 16 * hd * 4) as u32
}

/// Decode scratch: split partials (`MAX_SPLITS` per q head: output rows and (max, sum) pairs).
pub struct SplitPartials {
    pub o: u64,
    pub ml: u64,
}

/// One token (decode): norms + RoPE + KV append at the position in the step buffer.
pub fn prep(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, step: u64) -> Result<()> {
    let args = prep_args(d, p, Arg::P(step));
    gpu.launch(ATTN_PREP[kv_index(d.kv_bf16)], ((d.nh + d.nkv) as u32, 1, 1), d.hd as u32, d.prep_smem(), &args)
}

fn prep_args(d: &AttnDims, p: &AttnPtrs, at: Arg) -> Vec<Arg> {
    let mut args = prep_activations(p).to_vec();
    args.extend([Arg::P(p.kcache), Arg::P(p.vcache), at]);
    args.extend(prep_dims(d));
    args
}

/// The prep kernels' activations: the projections in, the norms' gains and the angles, q and the
/// gate out.
fn prep_activations(p: &AttnPtrs) -> [Arg; 8] {
    [Arg::P(p.qg), Arg::P(p.kraw), Arg::P(p.vraw), Arg::P(p.q_norm), Arg::P(p.k_norm), Arg::P(p.inv_freq), Arg::P(p.q), Arg::P(p.gate)]
}

/// The prep kernels' trailing shape arguments.
fn prep_dims(d: &AttnDims) -> [Arg; 5] {
    [Arg::I(d.nh as i32), Arg::I(d.nkv as i32), Arg::I(d.hd as i32), Arg::I(d.half_rot as i32), Arg::F(d.eps)]
}

/// Split-KV online-softmax partials (`splits` per KV head) over the positions up to the step's.
pub fn split(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, step: u64, splits: usize) -> Result<()> {
    let k = select_split(d.hd, d.kv_bf16).ok_or_else(|| anyhow!("attention head_dim {} has no decode kernel", d.hd))?;
    let args = split_args(d, p, part, step, splits);
    let group = d.nh / d.nkv;
    gpu.launch(k, (d.nkv as u32, splits as u32, 1), (group * 32) as u32, split_smem(d.hd), &args)
}

fn split_args(d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, step: u64, splits: usize) -> [Arg; 10] {
    [
        Arg::P(p.q),
        Arg::P(p.kcache),
        Arg::P(p.vcache),
        Arg::P(step),
        Arg::I(d.nh as i32),
        Arg::I(d.nkv as i32),
        Arg::I(splits as i32),
        Arg::F(d.scale()),
        Arg::P(part.o),
        Arg::P(part.ml),
    ]
}

/// Merge of the splits + sigmoid output gate (grid: q heads x 32-dim slices, 8 warps).
pub fn combine(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, splits: usize) -> Result<()> {
    let args = [Arg::P(part.o), Arg::P(part.ml), Arg::P(p.gate), Arg::I(splits as i32), Arg::I(d.hd as i32), Arg::P(p.out)];
    gpu.launch(ATTN_COMBINE, (d.nh as u32, (d.hd / 32) as u32, 1), 256, 0, &args)
}

/// Batched decode: [`prep`] for one token of each of `rows` sequences; `p.kcache` / `p.vcache`
/// are device tables of the rows' cache pointers, `steps` their `[token, position]` pairs.
pub fn prep_batch(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, steps: u64, rows: usize) -> Result<()> {
    let args = prep_args(d, p, Arg::P(steps));
    gpu.launch(ATTN_PREP_BATCH[kv_index(d.kv_bf16)], ((d.nh + d.nkv) as u32, rows as u32, 1), d.hd as u32, d.prep_smem(), &args)
}

/// The batched decode's split kernel: `attn_split_tc_batch_{hd}` (the q heads of a KV head as the
/// rows of one tensor-core tile) for a bf16 cache and at most 8 q heads per KV head, else
/// `attn_split_batch_{hd}[_bf16]` (a warp per q head on the CUDA cores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitBatch {
    TensorCore,
    CudaCore,
}

pub fn select_split_batch(d: &AttnDims) -> SplitBatch {
    if d.kv_bf16 && d.nh / d.nkv <= 8 && instance(&SPLIT_TC_BATCH, d.hd, true).is_some() {
        SplitBatch::TensorCore
    } else {
        SplitBatch::CudaCore
    }
}

/// `attn_split_tc_batch`'s K/V stages and keys per stage (ATTN_TC_NS, ATTN_TC_TK in
/// kernels/attention.cu).
const SPLIT_TC_STAGES: usize = 3;
const SPLIT_TC_KEYS: usize = 32;

/// `attn_split_tc_batch`'s dynamic shared memory: the q tile (16 rows) and the stages of K and V
/// rows, bf16, rows padded by 8 elements.
fn split_tc_smem(hd: usize) -> u32 {
    ((16 + SPLIT_TC_STAGES * 2 * SPLIT_TC_KEYS) * (hd + 8) * 2) as u32
}

/// Batched decode: [`split`] per row over its own cache and length; partials `[rows][nh][splits]`.
#[allow(clippy::too_many_arguments)]
pub fn split_batch(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, steps: u64, splits: usize, rows: usize, kernel: SplitBatch) -> Result<()> {
    let args = split_args(d, p, part, steps, splits);
    let grid = (d.nkv as u32, splits as u32, rows as u32);
    if kernel == SplitBatch::TensorCore {
        let name = instance(&SPLIT_TC_BATCH, d.hd, true).ok_or_else(|| anyhow!("attention head_dim {} has no tensor-core decode kernel", d.hd))?;
        return gpu.launch(Kernel::dependent(&ATTENTION, name), grid, 128, split_tc_smem(d.hd), &args);
    }
    let name = instance(&SPLIT_BATCH, d.hd, d.kv_bf16).ok_or_else(|| anyhow!("attention head_dim {} has no decode kernel", d.hd))?;
    let group = d.nh / d.nkv;
    gpu.launch(Kernel::dependent(&ATTENTION, name), grid, (group * 32) as u32, split_smem(d.hd), &args)
}

/// Batched decode: [`combine`] per row.
pub fn combine_batch(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, splits: usize, rows: usize) -> Result<()> {
    let args = [Arg::P(part.o), Arg::P(part.ml), Arg::P(p.gate), Arg::I(splits as i32), Arg::I(d.hd as i32), Arg::P(p.out)];
    gpu.launch(ATTN_COMBINE_BATCH, (d.nh as u32, rows as u32, 1), 256, 0, &args)
}

/// One sequence's rows of a prefill chunk as its attention sees them: the layer's KV caches, the
/// first row `r0` of its `n` rows in the chunk, and the position `pos0` of that row.
#[derive(Clone, Copy, Debug)]
pub struct AttnSegment {
    pub kcache: u64,
    pub vcache: u64,
    pub r0: usize,
    pub n: usize,
    pub pos0: usize,
}

/// Segments per prefill attention launch (PF_ATTN_SEGS in kernels/attention.cu).
pub const PF_ATTN_SEGS: usize = TABLE_SEGS;

/// `struct AttnSegs`: the K caches, the V caches, the first rows, the row counts, the positions.
fn segs_arg(segs: &[AttnSegment]) -> Arg {
    segment_table(segs.iter().map(|s| ([s.kcache, s.vcache], [s.r0 as i32, s.n as i32, s.pos0 as i32])))
}

/// Prefill: norms + RoPE of the segments' tokens, K and V appended to each segment's cache. The
/// segments lie back to back in row order and share the KV element type `d.kv_bf16`; `p`'s
/// activations start at the chunk's first row (its caches are the segments').
///
/// `q16` ([`chunk_takes_q16`]): q goes out as the wgmma core's bf16 operand (scaled) in `p.q`'s
/// memory and the gate is not copied (the core reads it from `p.qg`).
pub fn prep_chunk(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, segs: &[AttnSegment], q16: bool) -> Result<()> {
    if segs.windows(2).any(|w| w[1].r0 != w[0].r0 + w[0].n) || segs.iter().any(|g| g.n == 0) {
        bail!("the prefill attention takes non-empty segments back to back");
    }
    if q16 && !d.kv_bf16 {
        bail!("the prefill attention's bf16 q is for the bf16 cache's wgmma core");
    }
    for group in segs.chunks(PF_ATTN_SEGS) {
        let rows = group.iter().map(|g| g.n).sum::<usize>();
        let mut args = vec![segs_arg(group), Arg::I(group.len() as i32)];
        let grid = (rows as u32, (d.nh + d.nkv) as u32, 1);
        if q16 {
            args.extend(prep_activations(p)[..7].iter().cloned());
            args.extend(prep_dims(d));
            args.push(Arg::F(d.q16_scale()));
            gpu.launch(PF_ATTN_PREP_Q16, grid, d.hd as u32, d.prep_smem(), &args)?;
        } else {
            args.extend(prep_activations(p));
            args.extend(prep_dims(d));
            gpu.launch(PF_ATTN_PREP[kv_index(d.kv_bf16)], grid, d.hd as u32, d.prep_smem(), &args)?;
        }
    }
    Ok(())
}

/// Whether a run of segments takes the prep's bf16 q and the gate read in place
/// ([`prep_chunk`]'s `q16`): every launch on the wgmma core, i.e. the bf16 cache, not the exact
/// mode, no segment splitting its keys.
pub fn chunk_takes_q16(gpu: &Gpu, d: &AttnDims, segs: &[AttnSegment], exact: bool) -> bool {
    d.kv_bf16 && !exact && !chunk_splits_keys(gpu, d, segs.iter().map(|s| (s.n, s.pos0)), exact) && select_chunk(d.hd, true, false, false).is_some_and(|k| k.q16.is_some())
}

/// Prefill attention kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkAttn {
    /// `pf_attn_wg_{hd}`: bf16 cache, warpgroup MMAs on 128-row blocks (two warpgroups share each
    /// K/V tile), the softmax overlapping the PV products.
    Wgmma,
    /// `pf_attn_tc_{hd}[_bf16]`: bf16 `mma.sync` on 64-row Q/K/V tiles: the f32 cache, and the
    /// launches whose keys are split over blocks (bound by the cache's bytes: two blocks per SM
    /// keep more of them in flight than one wgmma block).
    TensorCore,
    /// `pf_attn_{hd}`: f32, exact to rounding against the CPU (the exact mode).
    F32,
}

/// A prefill attention kernel and its launch shape.
#[derive(Clone, Copy, Debug)]
pub struct ChunkKernel {
    pub kernel: Kernel,
    pub threads: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    /// Query rows per block ((rows / group) tokens x the group's q heads of one KV head).
    pub rows: usize,
    /// The instance over `pf_attn_prep_q16`'s q (the wgmma core's).
    pub q16: Option<Kernel>,
}

/// The prefill attention kernel for a head dim, cache element type and mode, for a launch whose
/// keys are split over blocks ([`chunk_splits`] > 1) or not.
pub fn select_chunk(hd: usize, kv_bf16: bool, exact: bool, split: bool) -> Option<ChunkKernel> {
    let variant = match (exact, kv_bf16 && !split) {
        (true, _) => ChunkAttn::F32,
        (false, true) => ChunkAttn::Wgmma,
        (false, false) => ChunkAttn::TensorCore,
    };
    let (table, threads, rows, smem) = match variant {
        ChunkAttn::F32 => (&CHUNK_F32, 256, 64, (64 * hd + 32 * (hd + 4) + 32 * hd) * 4),
        // Q, K and V tiles of 64 rows in bf16 with 8 columns of padding.
        ChunkAttn::TensorCore => (&CHUNK_TC, 128, 64, 3 * 64 * (hd + 8) * 2),
        // Q of 128 rows, two stages each of 64-key K and V tiles, bf16, aligned to 1024 bytes.
        ChunkAttn::Wgmma => (&CHUNK_WG, 256, 128, (128 + 4 * 64) * hd * 2 + 1024),
    };
    let name = instance(table, hd, kv_bf16)?;
    let q16 = (variant == ChunkAttn::Wgmma).then(|| instance(&CHUNK_WG_Q16, hd, kv_bf16)).flatten().map(|n| Kernel::ordered(&ATTENTION, n));
    Some(ChunkKernel { kernel: Kernel::ordered(&ATTENTION, name), threads, smem: smem as u32, rows, q16 })
}

/// Whether the prefill kernels take this head layout: each block (or warpgroup, in the 128-row
/// wgmma blocks) holds 64 query rows of one KV head's group, whole tokens.
pub fn chunk_supported(nh: usize, nkv: usize) -> bool {
    nkv > 0 && nh.is_multiple_of(nkv) && nh >= nkv && 64 % (nh / nkv) == 0
}

/// Most key splits of the tensor-core prefill attention (the combine kernel merges up to 256).
const MAX_CHUNK_SPLITS: usize = 128;

/// Fewest keys a split of the prefill attention takes: shorter splits cost more in partials and
/// the combine than their extra blocks save.
const MIN_SPLIT_KEYS: usize = 512;

/// Key splits of the tensor-core prefill attention for `n` queries over `keys` cache positions
/// on `sms` SMs: a block holds 64 / group queries of one KV head and streams every key up to its
/// last query, so a few tokens over a long cache (a conversation's next turn) make a handful of
/// blocks that each read the whole cache. Split so the blocks fill the SMs about twice; 1 when
/// the query tiles fill them already.
pub fn chunk_splits(n: usize, nh: usize, nkv: usize, keys: usize, sms: usize) -> usize {
    let blocks = n.div_ceil(64 / (nh / nkv)) * nkv;
    if blocks >= sms {
        return 1;
    }
    (2 * sms).div_ceil(blocks).min(keys / MIN_SPLIT_KEYS).clamp(1, MAX_CHUNK_SPLITS)
}

/// The key splits of a segment of `n` rows from position `pos0` (1 in the exact mode).
fn segment_splits(gpu: &Gpu, d: &AttnDims, n: usize, pos0: usize, exact: bool) -> usize {
    if exact { 1 } else { chunk_splits(n, d.nh, d.nkv, pos0 + n, gpu.sms as usize) }
}

/// Whether any of the segments `(rows, first position)` splits its keys (their outputs then come
/// from the split combine, in f32).
pub fn chunk_splits_keys(gpu: &Gpu, d: &AttnDims, segs: impl IntoIterator<Item = (usize, usize)>, exact: bool) -> bool {
    segs.into_iter().any(|(n, pos0)| segment_splits(gpu, d, n, pos0, exact) > 1)
}

/// Partial rows (query token x split) [`chunk_splits`] can ask for at most, so one buffer of
/// `rows x nh x hd` (+ `x 2` for max and sum) serves every call.
pub fn chunk_split_rows(nh: usize, nkv: usize, sms: usize) -> usize {
    let qt = 64 / (nh / nkv);
    (1..=sms.div_ceil(nkv) * qt).map(|n| (n, chunk_splits(n, nh, nkv, usize::MAX, sms))).filter(|&(_, s)| s > 1).map(|(n, s)| n * s).max().unwrap_or(1)
}

/// Causal attention of each segment's queries over its cache (up to its last position), gated.
/// The segments share the KV element type `d.kv_bf16`; `p`'s activations start at the chunk's
/// first row. Up to [`PF_ATTN_SEGS`] segments go in one launch, so the short prompts of a burst
/// fill the SMs together (the bf16 cache on `pf_attn_wg`); a segment whose query blocks would
/// leave most SMs idle over a long cache ([`chunk_splits`] > 1) runs alone on `pf_attn_tc` with
/// its keys split over blocks, partials in `part` (room for [`chunk_split_rows`] rows) merged by
/// the decode's combine kernel.
/// `staged`: where the outputs go instead of `p.out`, as their out-projection's bf16 operand
/// (`Gemm::stage_input`); only where no segment splits its keys ([`chunk_splits_keys`]).
/// `q16`: q is `pf_attn_prep_q16`'s and the gate is read from `p.qg` ([`chunk_takes_q16`]).
#[allow(clippy::too_many_arguments)]
pub fn chunk(gpu: &Gpu, d: &AttnDims, p: &AttnPtrs, part: &SplitPartials, segs: &[AttnSegment], exact: bool, staged: Option<u64>, q16: bool) -> Result<()> {
    let select = |split| select_chunk(d.hd, d.kv_bf16, exact, split).ok_or_else(|| anyhow!("attention head_dim {} has no prefill kernel", d.hd));
    let splits_of = |s: &AttnSegment| segment_splits(gpu, d, s.n, s.pos0, exact);
    if staged.is_some() && (exact || chunk_splits_keys(gpu, d, segs.iter().map(|s| (s.n, s.pos0)), exact)) {
        bail!("the prefill attention stages its outputs in bf16 only on unsplit launches");
    }
    if q16 && !chunk_takes_q16(gpu, d, segs, exact) {
        bail!("the prefill attention reads a bf16 q only where every launch is on the wgmma core");
    }
    let launch = |group: &[AttnSegment], splits: usize| {
        let ck = select(splits > 1)?;
        let (kernel, gate) = match ck.q16.filter(|_| q16) {
            Some(k) => (k, p.qg),
            None => (ck.kernel, p.gate),
        };
        let qt = ck.rows / (d.nh / d.nkv);
        let blocks = group.iter().map(|g| g.n.div_ceil(qt)).sum::<usize>();
        let mut args = vec![
            segs_arg(group),
            Arg::I(group.len() as i32),
            Arg::P(p.q),
            Arg::P(gate),
            Arg::I(d.nh as i32),
            Arg::I(d.nkv as i32),
            Arg::F(d.scale()),
            Arg::P(p.out),
        ];
        if !exact {
            let keys = group[0].pos0 + group[0].n;
            args.extend([Arg::I((keys.div_ceil(64).div_ceil(splits) * 64) as i32), Arg::P(part.o), Arg::P(part.ml), Arg::P(staged.unwrap_or(0))]);
        }
        gpu.launch(kernel, (blocks as u32, d.nkv as u32, splits as u32), ck.threads, ck.smem, &args)
    };
    let (alone, together): (Vec<AttnSegment>, Vec<AttnSegment>) = segs.iter().partition(|s| splits_of(s) > 1);
    for group in together.chunks(PF_ATTN_SEGS) {
        launch(group, 1)?;
    }
    for s in &alone {
        let splits = splits_of(s);
        launch(std::slice::from_ref(s), splits)?;
        let rows = |base: u64| base + (s.r0 * d.nh * d.hd * 4) as u64;
        combine_batch(gpu, d, &AttnPtrs { gate: rows(p.gate), out: rows(p.out), ..*p }, part, splits, s.n)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_for_the_35b_and_tiny_shapes() {
        for (cfg, hd) in [(ModelConfig::qwen36_35b_a3b(), 256), (ModelConfig::tiny(), 64)] {
            assert_eq!(cfg.head_dim, hd);
            assert!(chunk_supported(cfg.num_attention_heads, cfg.num_key_value_heads));
            for bf16 in [false, true] {
                let sfx = if bf16 { "_bf16" } else { "" };
                assert_eq!(select_split(hd, bf16).unwrap().name, format!("attn_split_{hd}{sfx}"));
                let tc = select_chunk(hd, bf16, false, false).unwrap();
                let want = if bf16 { (format!("pf_attn_wg_{hd}"), 256, 128) } else { (format!("pf_attn_tc_{hd}"), 128, 64) };
                assert_eq!((tc.kernel.name.to_string(), tc.threads, tc.rows), want);
                let split = select_chunk(hd, bf16, false, true).unwrap();
                assert_eq!((split.kernel.name.to_string(), split.threads, split.rows), (format!("pf_attn_tc_{hd}{sfx}"), 128, 64));
                for split in [false, true] {
                    let f = select_chunk(hd, bf16, true, split).unwrap();
                    assert_eq!((f.kernel.name.to_string(), f.threads), (format!("pf_attn_{hd}{sfx}"), 256));
                }
            }
        }
        assert!(select_split(96, false).is_none() && select_chunk(96, true, true, false).is_none());
        // 35B, hd 256: 96 KiB for the split ring, 99 KiB of mma.sync tiles, 192 KiB of wgmma tiles.
        assert_eq!(split_smem(256), 98_304);
        assert_eq!(select_chunk(256, true, false, true).unwrap().smem, 101_376);
        assert_eq!(select_chunk(256, true, false, false).unwrap().smem, 197_632);
        assert!(!chunk_supported(12, 5) && !chunk_supported(3 * 128, 3));
    }

    #[test]
    fn prefill_attention_splits_keys_only_when_its_query_tiles_leave_sms_idle() {
        let (nh, nkv, sms) = (16, 2, 132);
        // A turn's 25 new tokens over 94K cached ones: 8 blocks, so 33 splits fill 264 slots.
        assert_eq!(chunk_splits(25, nh, nkv, 94_000, sms), 33);
        // Short caches are not split below 512 keys per split; long chunks are not split.
        assert_eq!(chunk_splits(25, nh, nkv, 1_500, sms), 2);
        assert_eq!(chunk_splits(25, nh, nkv, 900, sms), 1);
        assert_eq!(chunk_splits(2048, nh, nkv, 94_000, sms), 1);
        assert_eq!(chunk_splits(1, nh, nkv, 262_144, sms), 128);
        // The partial buffer covers every split call (520 queries x 3 splits is the most here).
        let rows = chunk_split_rows(nh, nkv, sms);
        assert_eq!(rows, 1560);
        for n in 1..3000 {
            let splits = chunk_splits(n, nh, nkv, 262_144, sms);
            assert!(splits == 1 || n * splits <= rows, "n = {n}");
        }
    }

    #[test]
    fn the_batched_split_is_on_the_tensor_cores_for_a_bf16_cache_of_up_to_8_heads_per_kv_head() {
        let d = |nh, nkv, hd, kv_bf16| AttnDims { nh, nkv, hd, kv_bf16, ..AttnDims::new(&crate::checkpoint::ModelConfig::qwen36_35b_a3b(), kv_bf16) };
        assert_eq!(select_split_batch(&d(16, 2, 256, true)), SplitBatch::TensorCore);
        assert_eq!(select_split_batch(&d(16, 2, 256, false)), SplitBatch::CudaCore);
        assert_eq!(select_split_batch(&d(32, 2, 128, true)), SplitBatch::CudaCore);
        assert_eq!(select_split_batch(&d(4, 2, 64, true)), SplitBatch::TensorCore);
        assert_eq!(select_split_batch(&d(8, 1, 96, true)), SplitBatch::CudaCore);
    }

    #[test]
    fn splits_grow_with_the_context_up_to_the_cap() {
        assert_eq!(splits_for(1), 1);
        assert_eq!(splits_for(33), 2);
        assert_eq!(splits_for(4096), 128);
        assert_eq!(splits_for(262_144), MAX_SPLITS);
    }
}
