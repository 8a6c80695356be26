//! Products with the MLX 4/8-bit weights (kernels/qmatmul.cu), the CUDA side of
//! `cpu/qmatmul.rs`: decode GEMVs over descriptor sets (one token, norm fused), prefill GEMMs
//! (T tokens: f32 tiles, bf16 tensor cores, or cuBLAS on dequantised weights; dense or grouped
//! per expert), and embedding rows.

use super::blas::Blas;
use super::device::{ptr, Arg, Gpu};
use super::ops;
use super::registry::{Kernel, QMATMUL};
use super::moe::{TCR_GROUPS, TCR_STAGE_BYTES};
use super::weights::DevQ;
use anyhow::{bail, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use std::cell::Cell;

const GEMV_Q: Kernel = Kernel::dependent(&QMATMUL, "gemv_q");
const GEMV_Q_SPLIT: Kernel = Kernel::dependent(&QMATMUL, "gemv_q_split");
const GEMV_TC: Kernel = Kernel::dependent(&QMATMUL, "gemv_tc");
const GEMV_TC_F: Kernel = Kernel::dependent(&QMATMUL, "gemv_tc_f");
const GEMV_TCB: Kernel = Kernel::dependent(&QMATMUL, "gemv_tcb");
const GEMV_TCB_F: Kernel = Kernel::dependent(&QMATMUL, "gemv_tcb_f");
const GEMV_TCB_W: Kernel = Kernel::dependent(&QMATMUL, "gemv_tcb_w");
const GEMV_TCB_WF: Kernel = Kernel::dependent(&QMATMUL, "gemv_tcb_wf");
const GEMV_TCQ: Kernel = Kernel::dependent(&QMATMUL, "gemv_tcq");
/// Threads of `gemv_tcb_w` (one block per SM).
const GEMV_TCB_W_THREADS: u32 = 512;
const STAGE_TCB: Kernel = Kernel::dependent(&QMATMUL, "stage_tcb");
const EMBED_Q: Kernel = Kernel::dependent(&QMATMUL, "embed_q");
const PF_GEMM: Kernel = Kernel::ordered(&QMATMUL, "pf_gemm");
const PF_GEMM_TC: Kernel = Kernel::ordered(&QMATMUL, "pf_gemm_tc");
const PF_GEMM_SKINNY: Kernel = Kernel::ordered(&QMATMUL, "pf_gemm_skinny");
/// `pf_few_tc_<bits>_<n-tiles per chunk>`, and the instances over A fragments staged once per
/// block (`pf_few_tc_s_*`, [`few_tc_staged_smem`]).
const PF_FEW_TC: [[Kernel; 2]; 2] = [
    [Kernel::ordered(&QMATMUL, "pf_few_tc_4_4"), Kernel::ordered(&QMATMUL, "pf_few_tc_4_8")],
    [Kernel::ordered(&QMATMUL, "pf_few_tc_8_4"), Kernel::ordered(&QMATMUL, "pf_few_tc_8_8")],
];
const PF_FEW_TC_S: [[Kernel; 2]; 2] = [
    [Kernel::ordered(&QMATMUL, "pf_few_tc_s_4_4"), Kernel::ordered(&QMATMUL, "pf_few_tc_s_4_8")],
    [Kernel::ordered(&QMATMUL, "pf_few_tc_s_8_4"), Kernel::ordered(&QMATMUL, "pf_few_tc_s_8_8")],
];
const PF_DEQUANT_BF16: Kernel = Kernel::ordered(&QMATMUL, "pf_dequant_bf16");
const PF_TO_BF16: Kernel = Kernel::ordered(&QMATMUL, "pf_to_bf16");
const PF_EMBED: Kernel = Kernel::ordered(&QMATMUL, "pf_embed");

// ---- decode: GEMV over descriptor sets ----

/// Threads per GEMV block (8 warps).
pub const GEMV_THREADS: u32 = 256;

/// Mirrors `struct QMat` in kernels/qmatmul.cu.
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

// SAFETY: plain-old-data with the C layout of `struct QMat`; all-zero bits are a valid value.
unsafe impl cudarc::driver::DeviceRepr for QMatDesc {}
unsafe impl cudarc::driver::ValidAsZeroBits for QMatDesc {}

/// A group of matrices sharing one input, stored contiguously in a descriptor buffer.
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
    /// The descriptors point at the matrices' fragment-order copies (`gemv_tcb_f`).
    pub frag: bool,
    /// Row-order sets whose matrices all have fragment-order copies: the address of the same
    /// descriptors pointing at the copies, which `gemv_tc_f` reads where the set runs on the
    /// tensor cores (`gemv_q` reads row order).
    pub frag_twin: Option<u64>,
}

impl QMatDesc {
    /// The descriptor of `q` writing (or with `accumulate`, adding) into `y`.
    pub fn new(gpu: &Gpu, q: &DevQ, y: u64, accumulate: bool) -> Self {
        let (w, s, b) = q.ptrs(gpu);
        QMatDesc { w, s, b, y, rows: q.rows as i32, bits: q.bits as i32, accumulate: accumulate as i32, pad: 0 }
    }
}

/// Where a set's descriptors are and what its matrices share.
struct SetEntry {
    first: usize,
    count: usize,
    rows: usize,
    tiles: usize,
    all4: bool,
    frag: bool,
    /// The set's first twin (index into `GemvSets::twins`).
    twin: Option<usize>,
}

/// Builds descriptor sets back to back in one list, then places them at a device address.
#[derive(Default)]
pub struct GemvSets {
    pub descs: Vec<QMatDesc>,
    sets: Vec<SetEntry>,
    /// Sets whose matrices all have fragment-order copies point at them (the batched decode's:
    /// `gemv_tcb_f`; the other GEMVs read row order).
    pub frag: bool,
    /// Without `frag`: the fragment-order twins of such sets' descriptors (`GemvSet::frag_twin`),
    /// stored after `descs` on the device.
    pub twins: Vec<QMatDesc>,
}

impl GemvSets {
    /// Appends a set of `(matrix, output, accumulate)`; returns its index.
    pub fn add(&mut self, gpu: &Gpu, list: &[(&DevQ, u64, bool)]) -> usize {
        let first = self.descs.len();
        let (mut rows, mut tiles, mut all4) = (0, 0, true);
        let copies = list.iter().all(|(q, _, _)| q.frag_copy.is_some());
        let frag = self.frag && copies;
        let twin = (!self.frag && copies).then_some(self.twins.len());
        for (q, y, acc) in list {
            debug_assert!(!q.frag, "the GEMVs take dense matrices, whose codes are in row order");
            let mut d = QMatDesc::new(gpu, q, *y, *acc);
            if let Some((w, _, _)) = q.frag_ptrs(gpu) {
                if frag {
                    d.w = w;
                } else if twin.is_some() {
                    self.twins.push(QMatDesc { w, ..d });
                }
            }
            self.descs.push(d);
            rows += q.rows;
            tiles += q.rows.div_ceil(16);
            all4 &= q.bits == 4;
        }
        self.sets.push(SetEntry { first, count: list.len(), rows, tiles, all4, frag, twin });
        self.sets.len() - 1
    }

    /// Every descriptor as the device holds them: `descs`, then `twins`.
    pub fn device_descs(&self) -> Vec<QMatDesc> {
        self.descs.iter().chain(&self.twins).copied().collect()
    }

    /// Set `i` with its descriptors at `base` (the device copy of `descs`).
    pub fn set(&self, i: usize, base: u64) -> GemvSet {
        let e = &self.sets[i];
        let at = |i: usize| base + (i * std::mem::size_of::<QMatDesc>()) as u64;
        GemvSet {
            descs: at(e.first),
            count: e.count,
            rows: e.rows,
            tiles: e.tiles,
            all4: e.all4,
            frag: e.frag,
            frag_twin: e.twin.map(|t| at(self.descs.len() + t)),
        }
    }
}

/// The decode GEMV kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKernel {
    /// `gemv_q`: CUDA cores, any bit width, two rows per warp at a time.
    Simt,
    /// `gemv_tc`: tensor cores with f32-exact products; 4-bit, group 64, whole 64-column groups.
    TensorCore,
}

/// The GEMV of a set: the tensor cores where they apply and the set is large enough to fill them
/// (`min_tiles`, [`super::options::GEMV_TC_MIN_TILES`]).
pub fn select_gemv(set: &GemvSet, cols: usize, group: usize, min_tiles: usize) -> GemvKernel {
    if set.all4 && group == 64 && cols.is_multiple_of(64) && set.tiles >= min_tiles {
        GemvKernel::TensorCore
    } else {
        GemvKernel::Simt
    }
}

/// `gemv_q` geometry: (blocks, rows per warp). At most one wave of resident blocks (a second wave
/// would repeat the activation prologue on the critical path; extra rows per warp are prefetched
/// into L2 one iteration ahead). Two rows per warp when the set fills the wave that way; smaller
/// sets (router, out-projections) get one row per warp and twice the blocks, so more SMs have
/// loads in flight.
pub fn simt_geometry(rows: usize, sms: usize, blocks_per_sm: usize) -> (usize, usize) {
    let warps = (GEMV_THREADS / 32) as usize;
    let wave = sms * blocks_per_sm;
    let rows_per_warp = if rows.div_ceil(2 * warps) >= wave { 2 } else { 1 };
    (rows.div_ceil(rows_per_warp * warps).min(wave).max(1), rows_per_warp)
}

/// `gemv_q_split`'s parts per row for a set of `rows` rows of `cols` columns, 1 for `gemv_q`: a
/// set with fewer rows than half the warps of a wave (`wave_warps`; the router's 257 rows
/// against ~3,000 warps) splits each row over 4 or 2 warps, the most that divide the rows'
/// 16-byte chunks (`cols / 32` of them at 4 bits, twice that at 8) and still fit one wave.
pub fn simt_split(rows: usize, cols: usize, wave_warps: usize) -> usize {
    if rows == 0 || rows * 2 > wave_warps || !cols.is_multiple_of(32) {
        return 1;
    }
    [4usize, 2].into_iter().find(|&ks| (cols / 32).is_multiple_of(ks) && rows * ks <= wave_warps).unwrap_or(1)
}

/// Fragment words per 64-column group (TCX_WORDS in kernels/common.cuh).
const TCX_WORDS: usize = 96;
/// Groups of 64 columns per tensor-core work item (TC_NG in kernels/common.cuh).
pub const TC_NG: usize = 8;

/// Shared memory of the tensor-core decode kernels: activation fragments and group sums of `n`
/// values, the reduction scratch, and 16 partial sums per warp (kernels/common.cuh).
pub fn tc_smem(n: usize, warps: usize) -> u32 {
    ((n / 64 * (TCX_WORDS + 1) + 33 + warps * 16) * 4) as u32
}

/// `gemv_tc` geometry: (blocks, slices, chunks per slice). Each 16-row tile is split into
/// `slices` warps of `kc` 512-column chunks: the fewest slices (dividing the chunks) that still
/// give about one wave of warps, else the most.
pub fn tc_geometry(tiles: usize, cols: usize, sms: usize, blocks_per_sm: usize) -> (usize, usize, usize) {
    let warps = (GEMV_THREADS / 32) as usize;
    let wave_warps = sms * blocks_per_sm * warps;
    let chunks = (cols / 64).div_ceil(TC_NG);
    let allowed = || [1usize, 2, 4, 8].into_iter().filter(|s| chunks.is_multiple_of(*s));
    let slices = allowed().find(|s| tiles * s >= wave_warps).unwrap_or_else(|| allowed().next_back().unwrap_or(1));
    let blocks = tiles.div_ceil(warps / slices).min(sms * blocks_per_sm).max(1);
    (blocks, slices, chunks / slices)
}

/// Resident GEMV blocks per SM with `smem` bytes of shared memory, 1 to 8 (`fallback` when the
/// driver does not say).
pub(super) fn blocks_per_sm(gpu: &Gpu, k: Kernel, smem: u32, fallback: u32) -> Result<usize> {
    Ok(gpu
        .function(k, smem)?
        .occupancy_max_active_blocks_per_multiprocessor(GEMV_THREADS, smem as usize, None)
        .unwrap_or(fallback)
        .clamp(1, 8) as usize)
}

/// Input of a decode GEMV: `x` (`cols` values), RMSNorm'd with `gain` first when non-zero; block 0
/// also writes the normalised input to `xnorm_out` when non-zero.
#[derive(Clone, Copy, Debug)]
pub struct GemvInput {
    pub x: u64,
    pub cols: usize,
    pub gain: u64,
    pub eps: f32,
    pub xnorm_out: u64,
}

/// `y_m (+)= W_m · norm(x)` for every matrix of the set.
pub fn gemv(gpu: &Gpu, set: GemvSet, inp: GemvInput, group: usize, min_tiles: usize) -> Result<()> {
    let head = [
        Arg::P(set.descs),
        Arg::I(set.count as i32),
        Arg::P(inp.x),
        Arg::I(inp.cols as i32),
        Arg::P(inp.gain),
        Arg::F(inp.eps),
    ];
    let sms = gpu.sms as usize;
    match select_gemv(&set, inp.cols, group, min_tiles) {
        GemvKernel::TensorCore => {
            let smem = tc_smem(inp.cols, (GEMV_THREADS / 32) as usize);
            // The same geometry either way (the per-SM blocks of gemv_tc), so the same K slices.
            let per_sm = blocks_per_sm(gpu, GEMV_TC, smem, 1)?;
            let (blocks, slices, kc) = tc_geometry(set.tiles, inp.cols, sms, per_sm);
            let tail = [Arg::I(slices as i32), Arg::I(kc as i32), Arg::P(inp.xnorm_out)];
            let (k, head) = match set.frag_twin {
                Some(t) => (GEMV_TC_F, [&[Arg::P(t)], &head[1..]].concat()),
                None => (GEMV_TC, head.to_vec()),
            };
            gpu.launch(k, (blocks as u32, 1, 1), GEMV_THREADS, smem, &[&head[..], &tail].concat())
        }
        GemvKernel::Simt => {
            let smem = ((inp.cols + inp.cols / group + 33) * 4) as u32;
            let per_sm = blocks_per_sm(gpu, GEMV_Q, smem, 4)?;
            let warps = (GEMV_THREADS / 32) as usize;
            let tail = [Arg::I(group as i32), Arg::P(inp.xnorm_out)];
            match simt_split(set.rows, inp.cols, sms * per_sm * warps) {
                1 => {
                    let (blocks, _) = simt_geometry(set.rows, sms, per_sm);
                    gpu.launch(GEMV_Q, (blocks as u32, 1, 1), GEMV_THREADS, smem, &[&head[..], &tail].concat())
                }
                ks => {
                    // Each block: `warps / ks` rows, then the parts' sums (8 floats).
                    let blocks = set.rows.div_ceil(warps / ks);
                    let args = [&head[..], &tail, &[Arg::I(ks as i32)]].concat();
                    gpu.launch(GEMV_Q_SPLIT, (blocks as u32, 1, 1), GEMV_THREADS, smem + 8 * 4, &args)
                }
            }
        }
    }
}

/// The embedding row of the token in the step buffer (`step[0]`) into `x` (decode).
pub fn embed_row(gpu: &Gpu, e: &DevQ, group: usize, step: u64, x: u64) -> Result<()> {
    let (w, s, b) = e.ptrs(gpu);
    let args = [Arg::P(w), Arg::P(s), Arg::P(b), Arg::P(step), Arg::I(e.cols as i32), Arg::I(e.bits as i32), Arg::I(group as i32), Arg::P(x)];
    gpu.launch(EMBED_Q, (e.cols.div_ceil(256) as u32, 1, 1), 256, 0, &args)
}

/// The embedding rows of `n` token ids at `tokens` (every `ld`-th i32) into `x` `[n][cols]`
/// (prefill, batched decode).
pub fn embed_rows(gpu: &Gpu, e: &DevQ, group: usize, tokens: u64, ld: usize, n: usize, x: u64) -> Result<()> {
    let (w, s, b) = e.ptrs(gpu);
    let args = [Arg::P(w), Arg::P(s), Arg::P(b), Arg::P(tokens), Arg::I(ld as i32), Arg::I(e.cols as i32), Arg::I(e.bits as i32), Arg::I(group as i32), Arg::P(x)];
    gpu.launch(PF_EMBED, (e.cols.div_ceil(256) as u32, n as u32, 1), 256, 0, &args)
}

// ---- prefill: GEMM over T tokens ----

/// What a prefill GEMM multiplies: the first `rows` rows of a `cols`-column matrix of `bits`
/// (group `group`) by `tokens` token rows; `grouped` when the rows are per-expert slot lists.
#[derive(Clone, Copy, Debug)]
pub struct GemmShape {
    pub rows: usize,
    pub cols: usize,
    pub bits: usize,
    pub group: usize,
    pub tokens: usize,
    pub grouped: bool,
}

/// What the cuBLAS route can take: present when libcublas is loaded.
#[derive(Clone, Copy, Debug)]
pub struct BlasLimits {
    pub min_tokens: usize,
    /// Elements of dequantised weights the scratch holds.
    pub scratch: usize,
}

/// Kernels of a prefill GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmRoute {
    /// Dequantise the matrix once to bf16, multiply on cuBLAS: dense products over many tokens.
    Cublas,
    /// `pf_gemm_tc`: bf16 tensor cores on 128x64 tiles dequantised in shared memory.
    TensorCore,
    /// `pf_gemm`: f32 FMA tiles, exact to rounding against the CPU (the exact mode, odd widths).
    F32Tiles,
}

fn cublas_takes(s: &GemmShape, blas: Option<BlasLimits>) -> bool {
    blas.is_some_and(|b| {
        !s.grouped
            && s.tokens >= b.min_tokens
            && s.rows * s.cols <= b.scratch
            && s.cols.is_multiple_of(8)
            && s.group.is_multiple_of(8)
    })
}

/// The tensor-core GEMM covers k-tiles of 64 columns with one scale per 32-column half tile.
fn tensor_core_takes(s: &GemmShape) -> bool {
    s.cols.is_multiple_of(64) && s.group.is_multiple_of(32) && (s.bits == 4 || s.bits == 8)
}

/// The route of one prefill GEMM: outside the exact mode, cuBLAS for dense products it takes,
/// else the tensor cores where the tiling fits, else the f32 tiles.
pub fn select_gemm(s: &GemmShape, exact: bool, blas: Option<BlasLimits>) -> GemmRoute {
    if exact {
        GemmRoute::F32Tiles
    } else if cublas_takes(s, blas) {
        GemmRoute::Cublas
    } else if tensor_core_takes(s) {
        GemmRoute::TensorCore
    } else {
        GemmRoute::F32Tiles
    }
}

/// Kernels of a few-row GEMM whose outputs pick experts and gates (router, shared-expert gate,
/// GDN b/a): f32-accurate whatever the mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FewRowRoute {
    /// `pf_few_tc_*`: the tensor cores with the codes as f16 offset + q and the activations split
    /// into two f16 terms (exact products, f32 sums), the products sharing an input in one launch
    /// (outside the exact mode, for inputs within f16's range).
    TensorCore,
    /// `pf_gemm_skinny`: one block per 8 tokens (the 128-row tiles of `pf_gemm` would leave most
    /// of the GPU idle).
    Skinny,
    /// `pf_gemm` when the activations of 8 tokens do not fit the skinny kernel's shared memory.
    F32Tiles,
}

/// Tokens per block of pf_gemm_skinny (PF_SK_T) and its dynamic shared memory limit.
const SKINNY_T: usize = 8;
const SKINNY_SMEM_MAX: usize = 160 * 1024;

fn skinny_smem(cols: usize, group: usize) -> usize {
    SKINNY_T * (cols + cols / group) * 4
}

/// Rows per block of pf_gemm_skinny: enough row blocks for about two blocks per SM over the
/// token blocks (a decode batch's few tokens), in multiples of 8 rows (one per warp), at most 256.
pub fn skinny_rows_per_block(rows: usize, token_blocks: usize, sms: usize) -> usize {
    let row_blocks = (2 * sms).div_ceil(token_blocks.max(1)).max(1);
    (rows.div_ceil(row_blocks).div_ceil(8) * 8).clamp(8, 256)
}

/// `pf_few_tc` takes whole 64-column groups of 4- or 8-bit codes.
fn few_tc_takes(s: &GemmShape) -> bool {
    s.group == 64 && s.cols.is_multiple_of(64) && (s.bits == 4 || s.bits == 8)
}

/// `inputs_f16`: the inputs are bounded within f16's range (`weights::norm_outputs_fit_f16`).
pub fn select_few_row(s: &GemmShape, exact: bool, inputs_f16: bool) -> FewRowRoute {
    if !exact && inputs_f16 && few_tc_takes(s) {
        FewRowRoute::TensorCore
    } else if skinny_smem(s.cols, s.group) <= SKINNY_SMEM_MAX && s.cols.is_multiple_of(32) && s.group.is_multiple_of(32) {
        FewRowRoute::Skinny
    } else {
        FewRowRoute::F32Tiles
    }
}

/// One few-row product: the first `rows` rows of `q` times the shared input into `y` (`ldy`
/// floats per token).
#[derive(Clone, Copy)]
pub struct FewRows<'q> {
    pub q: &'q DevQ,
    pub rows: usize,
    pub y: u64,
    pub ldy: usize,
}

/// Warps of a `pf_few_tc` block (FEW_WARPS in kernels/qmatmul.cu).
const FEW_WARPS: usize = 8;

/// The n-tiles of 8 rows in a `pf_few_tc` chunk: 4 when no product has more than 32 rows (GDN b
/// and a), else 8.
pub fn few_tc_tiles(rows: &[usize]) -> usize {
    if rows.iter().all(|&r| r <= 32) {
        4
    } else {
        8
    }
}

/// The `pf_few_tc` launches of products sharing one input, as indices into the list: (first,
/// second, one-row aux). One launch takes two products (each in its own 64-row chunks) and a
/// one-row product in the ones tile: router + shared-expert gate, GDN b + a; products of other
/// codes or widths run one per launch.
pub fn few_tc_launches(rows: &[usize], same_codes: bool) -> Vec<(usize, Option<usize>, Option<usize>)> {
    match rows {
        [_, 1] if same_codes => vec![(0, None, Some(1))],
        [_, _] if same_codes => vec![(0, Some(1), None)],
        _ => (0..rows.len()).map(|i| (i, None, None)).collect(),
    }
}

/// `pf_few_tc`'s block: (chunks per block, parts of the groups), a warp each, at most `FEW_WARPS`. With a
/// wave of token tiles a block takes every 64-row chunk of its 16 tokens (the tokens are read
/// from L2 once) and splits the groups in the warps left; with fewer tiles each block takes one
/// chunk and splits its groups over all its warps, so short prompts still fill the GPU.
pub fn few_tc_shape(chunks: usize, groups: usize, token_tiles: usize, sms: usize) -> (usize, usize) {
    let cpb = if token_tiles >= sms { chunks.clamp(1, FEW_WARPS) } else { 1 };
    (cpb, (FEW_WARPS / cpb).clamp(1, groups.max(1)))
}

/// Bytes of one group's A fragments of a 16-token tile (FEW_FRAG_BYTES in kernels/qmatmul.cu:
/// 4 steps x 2 terms x 32 lanes x 16 bytes) and of `pf_few_tc`'s static part sums.
const FEW_FRAG_BYTES: usize = 4 * 2 * 32 * 16;
const FEW_PART_SUMS_BYTES: usize = FEW_WARPS * (4 * 8 + 2) * 32 * 4;

/// The dynamic shared memory of `pf_few_tc_s_*` for blocks of `cpb` chunks over `groups` groups:
/// the token tile's A fragments of every group, split once for the block's chunks. `None` (the
/// kernels that split them in each warp) for blocks of one chunk, where no other warp would read
/// them, or more groups than an SM holds beside the part sums.
pub fn few_tc_staged_smem(cpb: usize, groups: usize) -> Option<u32> {
    let bytes = groups * FEW_FRAG_BYTES;
    (cpb > 1 && bytes + FEW_PART_SUMS_BYTES <= super::registry::SMEM_OPTIN_LIMIT as usize).then_some(bytes as u32)
}

/// A `FewMat` argument of `pf_few_tc` (codes, scales, biases, output, rows, output stride); zeros
/// for an absent one.
fn few_mat_arg(gpu: &Gpu, f: Option<&FewRows>) -> Arg {
    let mut w = [0u64; super::device::ARG_STRUCT_WORDS];
    if let Some(f) = f {
        let (c, s, b) = f.q.ptrs(gpu);
        w[..5].copy_from_slice(&[c, s, b, f.y, f.rows as u32 as u64 | (f.ldy as u32 as u64) << 32]);
    }
    Arg::S(Box::new(w))
}

/// One `pf_few_tc` launch over `ntok` tokens of `x`: `m0`'s chunks, then `m1`'s, `aux` (one row)
/// in the ones tile. The caller checks the shapes ([`few_tc_takes`], [`few_tc_launches`]).
fn few_tc(gpu: &Gpu, m0: &FewRows, m1: Option<&FewRows>, aux: Option<&FewRows>, x: u64, ntok: usize) -> Result<()> {
    row_order(m0.q)?;
    for f in m1.iter().chain(aux.iter()) {
        row_order(f.q)?;
        if f.q.bits != m0.q.bits || f.q.cols != m0.q.cols {
            bail!("products stacked in one few-row launch take the same codes and width");
        }
    }
    if aux.is_some_and(|a| a.rows != 1) {
        bail!("the few-row aux product is one row");
    }
    let cols = m0.q.cols;
    let nt = few_tc_tiles(&[m0.rows, m1.map_or(0, |m| m.rows)]);
    let chunks = m0.rows.div_ceil(8 * nt) + m1.map_or(0, |m| m.rows.div_ceil(8 * nt));
    let tiles = ntok.div_ceil(16);
    let (cpb, ks) = few_tc_shape(chunks, cols / 64, tiles, gpu.sms as usize);
    let staged = few_tc_staged_smem(cpb, cols / 64);
    let k = if staged.is_some() { PF_FEW_TC_S } else { PF_FEW_TC }[(m0.q.bits == 8) as usize][(nt == 8) as usize];
    let args = [
        Arg::P(x),
        Arg::I(ntok as i32),
        Arg::I(cols as i32),
        few_mat_arg(gpu, Some(m0)),
        few_mat_arg(gpu, m1),
        few_mat_arg(gpu, aux),
        Arg::I(cpb as i32),
        Arg::I(ks as i32),
    ];
    gpu.launch(k, (tiles as u32, chunks.div_ceil(cpb) as u32, 1), (32 * cpb * ks) as u32, staged.unwrap_or(0), &args)
}

/// Kernels of `silu(gate·x) * (up·x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluRoute {
    /// Two cuBLAS GEMMs, then `pf_swiglu`.
    Cublas,
    /// One `pf_gemm_tc` computing both products and the SwiGLU.
    FusedTensorCore,
    /// Two f32 GEMMs, then `pf_swiglu`.
    F32Split,
}

pub fn select_glu(gate: &GemmShape, up: &GemmShape, exact: bool, blas: Option<BlasLimits>) -> GluRoute {
    match (select_gemm(gate, exact, blas), select_gemm(up, exact, blas)) {
        (GemmRoute::Cublas, GemmRoute::Cublas) => GluRoute::Cublas,
        _ if !exact && tensor_core_takes(gate) && tensor_core_takes(up) && gate.bits == up.bits => GluRoute::FusedTensorCore,
        _ => GluRoute::F32Split,
    }
}

/// Per-expert token lists of a grouped GEMM (from the MoE routing kernels).
#[derive(Clone, Copy)]
pub struct Grouped {
    pub experts: usize,
    pub counts: u64,
    pub offsets: u64,
    pub list: u64,
    /// Slot index / xdiv = the input row (k for the gate|up products, 1 for down).
    pub xdiv: usize,
    /// pf_scan's (expert, first token) tile list and its capacity (tensor-core path).
    pub tiles: u64,
    pub max_tiles: usize,
}

/// pf_gemm_tc's double-buffered bf16 tiles: 2 x (128 rows + 64 tokens) x (64 + 8 padding).
const GEMM_TC_SMEM: usize = 2 * (128 + 64) * 72 * 2;

/// Scratch of the cuBLAS route: the dequantised weights of the current GEMM and the bf16 copies
/// of its input.
pub struct BlasScratch {
    /// bf16 weights, room for the largest dense matrix.
    pub wb: CudaSlice<u16>,
    /// bf16 copy of the normed hidden states (staged once per norm) and of any other input.
    pub ub: CudaSlice<u16>,
    pub xb: CudaSlice<u16>,
}

impl BlasScratch {
    /// Room for `dense` weight elements and `staged` / `input` activations.
    pub fn new(gpu: &Gpu, dense: usize, staged: usize, input: usize) -> Result<Self> {
        Ok(BlasScratch { wb: gpu.zeros(dense)?, ub: gpu.zeros(staged)?, xb: gpu.zeros(input)? })
    }
}

/// The cuBLAS route of one forward call: the library and the scratch its operands live in.
struct BlasRoute<'a> {
    blas: &'a Blas,
    min_tokens: usize,
    wb: (u64, usize),
    ub: (u64, usize),
    xb: (u64, usize),
    /// The f32 input (pointer, values) whose bf16 copy is in `ub` (see [`Gemm::stage_target`]).
    staged: Cell<Option<(u64, usize)>>,
    /// The f32 input whose bf16 copy its producer wrote into `xb` instead of the f32 values
    /// (see [`Gemm::stage_input`]), for the next GEMM that reads it.
    staged_input: Cell<Option<(u64, usize)>>,
}

impl BlasRoute<'_> {
    /// The bf16 copy of `x` (`len` values): the staged one, else converted into `xb`.
    fn bf16_input(&self, gpu: &Gpu, x: u64, len: usize) -> Result<u64> {
        if self.staged.get() == Some((x, len)) {
            return Ok(self.ub.0);
        }
        if takes_staged_input(self.staged_input.take(), x, len)? {
            return Ok(self.xb.0);
        }
        if len > self.xb.1 {
            bail!("cuBLAS input scratch too small ({len} > {})", self.xb.1);
        }
        to_bf16(gpu, x, self.xb.0, len)?;
        Ok(self.xb.0)
    }
}

/// Whether the bf16 copy staged in the input scratch (`staged`, see [`Gemm::stage_input`]) is that
/// of `x` (`len` values). Its f32 values were never written, so another input converted into the
/// same scratch first would leave its GEMM nothing to read: that is an error, not a reconversion.
fn takes_staged_input(staged: Option<(u64, usize)>, x: u64, len: usize) -> Result<bool> {
    match staged {
        None => Ok(false),
        Some(s) if s == (x, len) => Ok(true),
        Some((p, n)) => bail!("the bf16 copy staged for a GEMM input ({n} values at {p:#x}) would be overwritten by another input before its GEMM ran"),
    }
}

/// The prefill GEMM dispatcher of one forward call.
pub struct Gemm<'a> {
    gpu: &'a Gpu,
    group: usize,
    exact: bool,
    blas: Option<BlasRoute<'a>>,
    /// The few-row products' inputs fit f16 ([`Gemm::few_inputs_f16`]).
    few_f16: bool,
}

impl<'a> Gemm<'a> {
    /// `blas`: the library and its scratch when the cuBLAS route may be taken, with the fewest
    /// tokens for it.
    pub fn new(gpu: &'a Gpu, group: usize, exact: bool, blas: Option<(&'a Blas, &BlasScratch, usize)>) -> Self {
        let st: &CudaStream = &gpu.stream;
        let blas = blas.map(|(blas, s, min_tokens)| BlasRoute {
            blas,
            min_tokens,
            wb: (ptr(&s.wb, st), s.wb.len()),
            ub: (ptr(&s.ub, st), s.ub.len()),
            xb: (ptr(&s.xb, st), s.xb.len()),
            staged: Cell::new(None),
            staged_input: Cell::new(None),
        });
        Gemm { gpu, group, exact, blas, few_f16: false }
    }

    /// Declares the few-row products' inputs bounded within f16's range
    /// (`weights::norm_outputs_fit_f16`), which the tensor-core route needs.
    pub fn few_inputs_f16(self, fit: bool) -> Self {
        Gemm { few_f16: fit, ..self }
    }

    fn shape(&self, q: &DevQ, rows: usize, tokens: usize, grouped: bool) -> GemmShape {
        GemmShape { rows, cols: q.cols, bits: q.bits, group: self.group, tokens, grouped }
    }

    fn limits(&self, scratch: fn(&BlasRoute) -> usize) -> Option<BlasLimits> {
        self.blas.as_ref().map(|r| BlasLimits { min_tokens: r.min_tokens, scratch: scratch(r) })
    }

    /// The kernels `run` takes for this product.
    fn route(&self, q: &DevQ, rows: usize, ntok: usize, grouped: bool) -> GemmRoute {
        select_gemm(&self.shape(q, rows, ntok, grouped), self.exact, self.limits(|r| r.wb.1))
    }

    /// Where the producer of the input `x` (`ntok` x `q.cols`) of the next ungrouped `run` of `q`
    /// writes its bf16 copy instead of `x` itself, when that product runs on cuBLAS (which reads
    /// only the copy); `None`: `x` is needed in f32. That `run` must be the next cuBLAS GEMM with
    /// an input to convert (any other input would go into the same scratch: an error).
    pub fn stage_input(&self, q: &DevQ, rows: usize, x: u64, ntok: usize) -> Option<u64> {
        let r = self.blas.as_ref()?;
        let len = ntok * q.cols;
        (self.route(q, rows, ntok, false) == GemmRoute::Cublas && len <= r.xb.1).then(|| {
            r.staged_input.set(Some((x, len)));
            r.xb.0
        })
    }

    /// Where the norm writing the hidden states `u` (`ntok` x `cols`) also writes their bf16
    /// copy, which every cuBLAS GEMM reading `u` then takes until the next norm rewrites `u` (the
    /// next call); `None` (nothing staged) without cuBLAS or where its GEMMs do not run.
    pub fn stage_target(&self, u: u64, ntok: usize, cols: usize) -> Option<u64> {
        let r = self.blas.as_ref()?;
        r.staged.set(None);
        let len = ntok * cols;
        (ntok >= r.min_tokens && len <= r.ub.1).then(|| {
            r.staged.set(Some((u, len)));
            r.ub.0
        })
    }

    /// `q` (first `rows` rows) dequantised into a cuBLAS scratch.
    fn dequant(&self, q: &DevQ, rows: usize, k: Kernel, out: u64) -> Result<()> {
        dequant_rows(self.gpu, q, rows, self.group, k, out)
    }

    /// `y[t][0..rows] (+)= W · x[t]` for `ntok` tokens (grouped: per-expert slot lists).
    #[allow(clippy::too_many_arguments)]
    pub fn run(&self, q: &DevQ, rows: usize, x: u64, ntok: usize, y: u64, ldy: usize, accumulate: bool, grouped: Option<Grouped>) -> Result<()> {
        match self.route(q, rows, ntok, grouped.is_some()) {
            GemmRoute::Cublas => self.run_cublas(q, rows, x, ntok, y, ldy, accumulate, false),
            GemmRoute::TensorCore => gemm_tc(self.gpu, q, None, rows, self.group, x, ntok, y, ldy, accumulate, grouped),
            GemmRoute::F32Tiles => gemm_f32(self.gpu, q, rows, self.group, x, ntok, y, ldy, accumulate, grouped),
        }
    }

    /// `y = W · x` (not accumulated) as `run` does, but where the product runs on cuBLAS, `y` in
    /// bf16 (the f32 sums rounded once: half the bytes written, and read by the consumers);
    /// returns whether it did, i.e. the element type `y` holds.
    pub fn run_bf16_out(&self, q: &DevQ, rows: usize, x: u64, ntok: usize, y: u64, ldy: usize) -> Result<bool> {
        if self.route(q, rows, ntok, false) != GemmRoute::Cublas {
            self.run(q, rows, x, ntok, y, ldy, false, None)?;
            return Ok(false);
        }
        self.run_cublas(q, rows, x, ntok, y, ldy, false, true)?;
        Ok(true)
    }

    /// The product on cuBLAS: x staged or converted to bf16, W from its bf16 copy or dequantised
    /// now; y f32, or bf16 with `y_bf16`.
    #[allow(clippy::too_many_arguments)]
    fn run_cublas(&self, q: &DevQ, rows: usize, x: u64, ntok: usize, y: u64, ldy: usize, accumulate: bool, y_bf16: bool) -> Result<()> {
        let r = self.blas.as_ref().expect("selected only with cuBLAS");
        let xb = r.bf16_input(self.gpu, x, ntok * q.cols)?;
        // The weights kept in bf16 since loading (`DevQ::dense_bf16`), else dequantised now.
        let wb = match &q.dense_bf16 {
            Some(d) => ptr(d, &self.gpu.stream),
            None => {
                self.dequant(q, rows, PF_DEQUANT_BF16, r.wb.0)?;
                r.wb.0
            }
        };
        r.blas.gemm(wb, xb, y, (rows, q.cols, ntok, ldy), accumulate, y_bf16)
    }

    /// `y = W · x` f32-accurate whatever the mode for each few-row product of `outs` (router and
    /// shared-expert gate, GDN b and a), all of the same input `x` of `ntok` tokens.
    pub fn few_rows(&self, outs: &[FewRows], x: u64, ntok: usize) -> Result<()> {
        let tc = |f: &FewRows| select_few_row(&self.shape(f.q, f.rows, ntok, false), self.exact, self.few_f16) == FewRowRoute::TensorCore;
        if !outs.is_empty() && outs.iter().all(tc) {
            let rows: Vec<usize> = outs.iter().map(|f| f.rows).collect();
            let same = outs.iter().all(|f| f.q.bits == outs[0].q.bits && f.q.cols == outs[0].q.cols);
            for (a, b, aux) in few_tc_launches(&rows, same) {
                few_tc(self.gpu, &outs[a], b.map(|i| &outs[i]), aux.map(|i| &outs[i]), x, ntok)?;
            }
            return Ok(());
        }
        for f in outs {
            self.few_rows_cuda_cores(f, x, ntok)?;
        }
        Ok(())
    }

    /// One few-row product on the CUDA cores (the exact mode, shapes the tensor cores do not take).
    fn few_rows_cuda_cores(&self, f: &FewRows, x: u64, ntok: usize) -> Result<()> {
        let (q, rows, y, ldy) = (f.q, f.rows, f.y, f.ldy);
        match select_few_row(&self.shape(q, rows, ntok, false), true, false) {
            FewRowRoute::Skinny => {
                row_order(q)?;
                let rpb = skinny_rows_per_block(rows, ntok.div_ceil(SKINNY_T), self.gpu.sms as usize);
                let io = [Arg::P(x), Arg::I(ntok as i32), Arg::P(y), Arg::I(ldy as i32), Arg::I(rpb as i32)];
                let args = [&qmat_args(q, self.gpu, rows, self.group)[..], &io].concat();
                let grid = (ntok.div_ceil(SKINNY_T) as u32, rows.div_ceil(rpb) as u32, 1);
                self.gpu.launch(PF_GEMM_SKINNY, grid, 256, skinny_smem(q.cols, self.group) as u32, &args)
            }
            _ => gemm_f32(self.gpu, q, rows, self.group, x, ntok, y, ldy, false, None),
        }
    }

    /// `out = silu(gate·x) * (up·x)` over `slots` output rows (`tmp`: room for the up projection
    /// on the split routes).
    #[allow(clippy::too_many_arguments)]
    pub fn glu(&self, gate: &DevQ, up: &DevQ, rows: usize, x: u64, ntok: usize, out: u64, tmp: u64, slots: usize, grouped: Option<Grouped>) -> Result<()> {
        self.glu_then(gate, up, rows, x, ntok, out, tmp, slots, grouped, None)
    }

    /// [`Self::glu`] whose output the product `then` (its matrix and rows, over the same `ntok`
    /// rows) reads next: where that runs on cuBLAS (and the GLU's two products apart), the
    /// SwiGLU writes only its bf16 operand ([`Self::stage_input`]), not `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn glu_then(&self, gate: &DevQ, up: &DevQ, rows: usize, x: u64, ntok: usize, out: u64, tmp: u64, slots: usize, grouped: Option<Grouped>, then: Option<(&DevQ, usize)>) -> Result<()> {
        let g = self.shape(gate, rows, ntok, grouped.is_some());
        let u = self.shape(up, rows, ntok, grouped.is_some());
        match select_glu(&g, &u, self.exact, self.limits(|r| r.wb.1)) {
            GluRoute::FusedTensorCore => gemm_tc(self.gpu, gate, Some(up), rows, self.group, x, ntok, out, rows, false, grouped),
            GluRoute::Cublas | GluRoute::F32Split => {
                self.run(gate, rows, x, ntok, out, rows, false, grouped)?;
                self.run(up, rows, x, ntok, tmp, rows, false, grouped)?;
                // Staged only after both products took their inputs (the staging scratch is
                // the one their own inputs may be converted into).
                let staged = match then {
                    Some((q, q_rows)) if grouped.is_none() && slots == ntok && q.cols == rows => self.stage_input(q, q_rows, out, ntok),
                    _ => None,
                };
                ops::swiglu(self.gpu, out, tmp, slots * rows, staged)
            }
        }
    }
}

/// The first `rows` rows of row-order `q` dequantised by `k` (`pf_dequant_bf16` / `_f32`) to `out`.
fn dequant_rows(gpu: &Gpu, q: &DevQ, rows: usize, group: usize, k: Kernel, out: u64) -> Result<()> {
    row_order(q)?;
    let args = [&qmat_args(q, gpu, rows, group)[..], &[Arg::P(out)]].concat();
    gpu.launch(k, ((rows * q.cols / 8).div_ceil(256) as u32, 1, 1), 256, 0, &args)
}

/// `q` dequantised to bf16 as the cuBLAS route dequantises it per chunk (the same kernel, so the
/// same values): a copy kept beside the codes ([`DevQ::dense_bf16`]).
pub fn dense_bf16_copy(gpu: &Gpu, q: &DevQ, group: usize) -> Result<CudaSlice<u16>> {
    let out = gpu.zeros::<u16>(q.rows * q.cols)?;
    dequant_rows(gpu, q, q.rows, group, PF_DEQUANT_BF16, ptr(&out, &gpu.stream))?;
    Ok(out)
}

/// The leading arguments of every quantised-matrix prefill kernel (pf_gemm, pf_gemm_skinny,
/// pf_dequant_*): codes, scales, biases, bits, the first `rows` rows, columns, group size.
/// Only `pf_gemm` of them reads codes in fragment order (it takes a flag); the caller of the others
/// checks [`row_order`].
fn qmat_args(q: &DevQ, gpu: &Gpu, rows: usize, group: usize) -> [Arg; 7] {
    let (w, s, b) = q.ptrs(gpu);
    [Arg::P(w), Arg::P(s), Arg::P(b), Arg::I(q.bits as i32), Arg::I(rows as i32), Arg::I(q.cols as i32), Arg::I(group as i32)]
}

/// An error unless `q`'s codes are in row order (what every prefill product but `pf_gemm` and the
/// expert kernels reads; the loader puts only experts in fragment order, see moe.rs).
fn row_order(q: &DevQ) -> Result<()> {
    if q.frag {
        bail!("{} x {} codes in fragment order reached a kernel that reads row order", q.rows, q.cols);
    }
    Ok(())
}

/// The input, output and per-expert list arguments both GEMM kernels take in this order.
#[allow(clippy::too_many_arguments)]
fn io_args(x: u64, ntok: usize, y: u64, ldy: usize, accumulate: bool, counts: u64, offsets: u64, list: u64) -> [Arg; 8] {
    [Arg::P(x), Arg::I(ntok as i32), Arg::P(y), Arg::I(ldy as i32), Arg::I(accumulate as i32), Arg::P(counts), Arg::P(offsets), Arg::P(list)]
}

/// `pf_gemm`. `ntok`: tokens (dense) or the most tokens any expert can have (grouped).
#[allow(clippy::too_many_arguments)]
fn gemm_f32(gpu: &Gpu, q: &DevQ, rows: usize, group: usize, x: u64, ntok: usize, y: u64, ldy: usize, accumulate: bool, grouped: Option<Grouped>) -> Result<()> {
    let (gz, counts, offsets, list, xdiv) = match grouped {
        Some(g) => (g.experts, g.counts, g.offsets, g.list, g.xdiv),
        None => (1, 0, 0, 0, 1),
    };
    let tail = [&io_args(x, ntok, y, ldy, accumulate, counts, offsets, list)[..], &[Arg::I(xdiv as i32), Arg::I(q.frag as i32)]].concat();
    let grid = (rows.div_ceil(128) as u32, ntok.div_ceil(64) as u32, gz as u32);
    gpu.launch(PF_GEMM, grid, 256, 0, &[&qmat_args(q, gpu, rows, group)[..], &tail[..]].concat())
}

/// `pf_gemm_tc`; with `up`, the fused `silu(W·x) * (Up·x)`. Grouped: per-expert tiles from
/// pf_scan. The two matrices' pointers interleave (w, s, b, w2, s2, b2), as the kernel takes them.
#[allow(clippy::too_many_arguments)]
fn gemm_tc(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, rows: usize, group: usize, x: u64, ntok: usize, y: u64, ldy: usize, accumulate: bool, grouped: Option<Grouped>) -> Result<()> {
    row_order(q)?;
    up.map(row_order).transpose()?;
    let (w, s, b) = q.ptrs(gpu);
    let (w2, s2, b2) = up.map(|u| u.ptrs(gpu)).unwrap_or((0, 0, 0));
    let (gy, counts, offsets, list, tiles, xdiv) = match grouped {
        Some(g) => (g.max_tiles, g.counts, g.offsets, g.list, g.tiles, g.xdiv),
        None => (ntok.div_ceil(64), 0, 0, 0, 0, 1),
    };
    let bm = if up.is_some() { 64 } else { 128 };
    let head = [Arg::P(w), Arg::P(s), Arg::P(b), Arg::P(w2), Arg::P(s2), Arg::P(b2), Arg::I(q.bits as i32), Arg::I(rows as i32), Arg::I(q.cols as i32), Arg::I(group as i32)];
    let io = io_args(x, ntok, y, ldy, accumulate, counts, offsets, list);
    let args = [&head[..], &io, &[Arg::P(tiles), Arg::I(xdiv as i32)]].concat();
    gpu.launch(PF_GEMM_TC, (rows.div_ceil(bm) as u32, gy as u32, 1), 256, GEMM_TC_SMEM as u32, &args)
}

/// A batched step's activation staged for the tensor-core GEMVs (`stage_tcb`): bf16 fragments
/// and group sums of up to [`TcbStaging::rows`] rows of up to `cols` values.
pub struct TcbStaging {
    pub frag: CudaSlice<u32>,
    pub gsum: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl TcbStaging {
    pub fn new(gpu: &Gpu, rows: usize, cols: usize) -> Result<Self> {
        let rows = rows.div_ceil(16) * 16;
        Ok(TcbStaging { frag: gpu.zeros(rows * cols / 2)?, gsum: gpu.zeros(rows * cols.div_ceil(64))?, rows, cols })
    }
}

/// Stages `nrows` rows of `x` (`cols` values each) into `st`: RMSNorm'd with `gain` first when
/// non-zero, the f32 result also written to `u_out` when non-zero.
#[allow(clippy::too_many_arguments)]
pub fn stage_tcb(gpu: &Gpu, x: u64, cols: usize, nrows: usize, gain: u64, eps: f32, u_out: u64, st: &TcbStaging) -> Result<()> {
    stage_tcb_after(gpu, x, cols, nrows, gain, eps, u_out, st, None)
}

/// A MoE layer's output not yet added to the residual: `moe::combine`'s inputs (the routed
/// experts' down rows, the routing weights, k, the shared expert's rows and gate logits).
#[derive(Clone, Copy, Debug)]
pub struct PendingCombine {
    pub down: u64,
    pub top_w: u64,
    pub k: usize,
    pub shared: u64,
    /// `shared` holds bf16 (the shared expert's down product on cuBLAS with a bf16 output; only
    /// the combines over bf16 routed outputs take it).
    pub shared_bf16: bool,
    pub sgl: u64,
}

/// [`stage_tcb`] of the residual `x`, adding `combine` into it first (written back, the same bits
/// as `moe::combine`): one launch for the two.
#[allow(clippy::too_many_arguments)]
pub fn stage_tcb_after(gpu: &Gpu, x: u64, cols: usize, nrows: usize, gain: u64, eps: f32, u_out: u64, st: &TcbStaging, combine: Option<&PendingCombine>) -> Result<()> {
    if nrows > st.rows || cols > st.cols || !cols.is_multiple_of(64) {
        bail!("staging of {nrows} x {cols} values does not fit {} x {} (or is not whole 64-column groups)", st.rows, st.cols);
    }
    let s = &gpu.stream;
    let c = combine.copied().unwrap_or(PendingCombine { down: 0, top_w: 0, k: 0, shared: 0, shared_bf16: false, sgl: 0 });
    if c.shared_bf16 {
        bail!("the staging combine takes the shared expert's outputs in f32");
    }
    let args = [
        Arg::P(x),
        Arg::I(cols as i32),
        Arg::I(nrows as i32),
        Arg::P(gain),
        Arg::F(eps),
        Arg::P(u_out),
        Arg::P(ptr(&st.frag, s)),
        Arg::P(ptr(&st.gsum, s)),
        Arg::P(c.down),
        Arg::P(c.top_w),
        Arg::I(c.k as i32),
        Arg::P(c.shared),
        Arg::P(c.sgl),
    ];
    gpu.launch(STAGE_TCB, ((nrows.div_ceil(16) * 16) as u32, 1, 1), 256, 0, &args)
}

/// Tokens per block of `gemv_tcb`: 16 (two n8 tiles) while their fragments fit two blocks per SM,
/// else 8.
fn tcb_tokens(cols: usize) -> usize {
    if cols <= 2048 {
        TCB_TOK
    } else {
        TCB_TOK / 2
    }
}

/// How `gemv_tcb` blocks a step's `ntok` tokens over `cols` columns: (tokens per block, wide).
/// Where the 256-thread kernel's blocks take 8 tokens (4,096 columns) and the step has more than
/// 16, the 512-thread `gemv_tcb_w` takes 16 per block: its blocks are one per SM either way
/// (`tcb_row_blocks`), and each dequantised weight fragment then serves twice the tokens. At 16
/// tokens (one wide block) the 256-thread kernel's two token blocks are faster; 32 tokens per
/// wide block over 2,048 columns lost (four n8 tiles per warp spill at 128 registers).
fn tcb_blocking(cols: usize, ntok: usize) -> (usize, bool) {
    let tok = tcb_tokens(cols);
    if ntok > TCB_TOK && tok < TCB_TOK {
        (TCB_TOK, true)
    } else {
        (tok, false)
    }
}

/// Most tokens per `gemv_tcb` block: two n8 tiles (TCB_TOK in kernels/common.cuh).
const TCB_TOK: usize = 16;

/// `gemv_tcb`'s blocks per token block (grid.y): `tc_geometry`'s, but at most one per SM when the
/// step has several token blocks. Each block copies its tokens' fragments for the whole K, so
/// with several token blocks a wave of two per SM moves more bytes of fragments than of weights,
/// and half the blocks, each walking twice the tiles, are faster; with one token block the
/// second block per SM pays (docs/cuda.md, "Batched decode"). The K slicing (`slices`) is
/// unchanged, so every row's sums, and the logits, are bit-identical whatever the batch.
fn tcb_row_blocks(blocks: usize, sms: usize, ntok: usize, tok: usize) -> usize {
    if ntok > tok {
        blocks.min(sms)
    } else {
        blocks
    }
}

/// Fragment words per 64-column group and 8 tokens (TCB_WORDS in kernels/common.cuh).
pub const TCB_WORDS: usize = 256;

/// Dynamic shared memory of `gemv_tcb` over `cols` columns with `tok` tokens per block and
/// `threads` per block.
fn gemv_tcb_smem(cols: usize, tok: usize, threads: u32) -> u32 {
    let (gpr, warps) = (cols / 64, (threads / 32) as usize);
    ((tok / 8 * gpr * TCB_WORDS + tok * gpr + warps * 16 * tok) * 4) as u32
}

/// Whether a step of `ntok` tokens runs its fragment-order GEMV sets over `cols` columns on
/// `gemv_tcq` (each warp's weights streamed through a ring) rather than `gemv_tcb_f`: at most
/// `TCB_TOK` tokens (16 rows: +2.1% aggregate on an H200; 64 rows lost 1.3%, docs/cuda.md), and
/// whole ring stages of columns. Steps of more than 16 tokens run 4,096-column sets on the wide
/// kernel, which has no ring form.
fn tcb_ring(cols: usize, ntok: usize) -> bool {
    ntok <= TCB_TOK && cols.is_multiple_of(64 * TCR_GROUPS)
}

/// Shared memory of `gemv_tcq`'s weight rings (`threads` / 32 warps), beside `gemv_tcb_smem`'s.
fn gemv_ring_smem(threads: u32) -> u32 {
    (threads / 32) * (GEMV_RING_DEPTH * TCR_STAGE_BYTES) as u32
}

/// Stages per warp of `gemv_tcq`'s ring (GEMV_RING_DEPTH in kernels/qmatmul.cu).
const GEMV_RING_DEPTH: usize = 3;

/// `gemv_tcb`: `y_m[t] (+)= W_m · x[t]` for every matrix of `set` (4-bit, group 64) and the `ntok`
/// staged rows of `st` (`cols` values each); each output token-major with the matrix's rows
/// (batched decode).
pub fn gemv_tcb(gpu: &Gpu, set: GemvSet, st: &TcbStaging, cols: usize, ntok: usize) -> Result<()> {
    if !set.all4 || !cols.is_multiple_of(64) {
        bail!("the batched GEMV takes 4-bit matrices of whole 64-column groups");
    }
    // The tiles and K slices are the 256-thread kernel's at every token count (bit-identical
    // outputs whatever the batch); the wide kernel's warps take them two blocks' worth at a time,
    // and the ring kernel (`gemv_tcq`) the same tiles.
    let narrow_smem = gemv_tcb_smem(cols, tcb_tokens(cols), GEMV_THREADS);
    let per_sm = blocks_per_sm(gpu, if set.frag { GEMV_TCB_F } else { GEMV_TCB }, narrow_smem, 1)?;
    let (blocks, slices, kc) = tc_geometry(set.tiles, cols, gpu.sms as usize, per_sm);
    let (tok, wide) = tcb_blocking(cols, ntok);
    // A wide step has several token blocks (more than 16 tokens), so one block per SM here too.
    let blocks = tcb_row_blocks(blocks, gpu.sms as usize, ntok, tok);
    let ring = set.frag && tcb_ring(cols, ntok);
    let (k, threads) = match (wide, set.frag) {
        (false, false) => (GEMV_TCB, GEMV_THREADS),
        (false, true) if ring => (GEMV_TCQ, GEMV_THREADS),
        (false, true) => (GEMV_TCB_F, GEMV_THREADS),
        (true, false) => (GEMV_TCB_W, GEMV_TCB_W_THREADS),
        (true, true) => (GEMV_TCB_WF, GEMV_TCB_W_THREADS),
    };
    let smem = gemv_tcb_smem(cols, tok, threads) + if ring { gemv_ring_smem(threads) } else { 0 };
    let s = &gpu.stream;
    let args = [
        Arg::P(set.descs),
        Arg::I(set.count as i32),
        Arg::P(ptr(&st.frag, s)),
        Arg::P(ptr(&st.gsum, s)),
        Arg::I(cols as i32),
        Arg::I(ntok as i32),
        Arg::I(tok as i32),
        Arg::I(slices as i32),
        Arg::I(kc as i32),
    ];
    gpu.launch(k, (ntok.div_ceil(tok) as u32, blocks as u32, 1), threads, smem, &args)
}

/// `len` f32 values at `x` to bf16 at `y` (`len` a multiple of 4: rows of 64-column matrices).
fn to_bf16(gpu: &Gpu, x: u64, y: u64, len: usize) -> Result<()> {
    let n4 = len / 4;
    gpu.launch(PF_TO_BF16, (n4.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::P(x), Arg::P(y), Arg::I(n4 as i32)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ModelConfig;

    #[test]
    fn a_staged_input_serves_its_own_gemm_and_no_other() {
        assert!(!takes_staged_input(None, 0x1000, 64).unwrap());
        assert!(takes_staged_input(Some((0x1000, 64)), 0x1000, 64).unwrap());
        let err = takes_staged_input(Some((0x1000, 64)), 0x2000, 64).unwrap_err().to_string();
        assert!(err.contains("would be overwritten"), "{err}");
        assert!(takes_staged_input(Some((0x1000, 64)), 0x1000, 32).is_err());
    }

    #[test]
    fn batched_gemv_blocks_drop_to_one_per_sm_only_with_several_token_blocks() {
        assert_eq!(tcb_row_blocks(264, 132, 16, 16), 264);
        assert_eq!(tcb_row_blocks(264, 132, 17, 16), 132);
        assert_eq!(tcb_row_blocks(264, 132, 16, 8), 132);
        assert_eq!(tcb_row_blocks(96, 132, 64, 16), 96);
    }

    fn set(rows: &[usize], all4: bool) -> GemvSet {
        GemvSet { descs: 0, count: rows.len(), rows: rows.iter().sum(), tiles: rows.iter().map(|r| r.div_ceil(16)).sum(), all4, frag: false, frag_twin: None }
    }

    #[test]
    fn gemv_choice_for_the_35b_and_tiny_sets() {
        let min = crate::backend::cuda::options::GEMV_TC_MIN_TILES;
        for (cfg, big) in [(ModelConfig::qwen36_35b_a3b(), true), (ModelConfig::tiny(), false)] {
            let h = cfg.hidden_size;
            let gdn_in = set(&[cfg.gdn_conv_dim(), cfg.gdn_value_dim(), cfg.linear_num_value_heads, cfg.linear_num_value_heads], true);
            let out = set(&[h], true);
            // The router is 8-bit: always the CUDA-core kernel.
            let router = set(&[cfg.num_experts, 1], false);
            let head = set(&[cfg.vocab_size], true);
            assert_eq!(select_gemv(&router, h, 64, 0), GemvKernel::Simt);
            assert_eq!(select_gemv(&head, h, 64, min), GemvKernel::TensorCore);
            let want = if big { GemvKernel::TensorCore } else { GemvKernel::Simt };
            assert_eq!(select_gemv(&out, cfg.gdn_value_dim(), 64, min), want);
            assert_eq!(select_gemv(&gdn_in, h, 64, min), want);
            // Tests put every 4-bit set on the tensor cores.
            assert_eq!(select_gemv(&out, cfg.gdn_value_dim(), 64, 0), GemvKernel::TensorCore);
            assert_eq!(select_gemv(&out, 96, 64, 0), GemvKernel::Simt);
        }
    }

    #[test]
    fn gemv_geometry_stays_within_one_wave() {
        // 35B lm_head: 248,320 rows over 132 SMs.
        let (blocks, slices, kc) = tc_geometry(248_320 / 16, 2048, 132, 2);
        assert_eq!((blocks, slices, kc), (264, 1, 4));
        // 35B GDN in-projection: 12,352 rows, few tiles per warp: split the 2,048 columns.
        let tiles = (8192 + 4096 + 32 + 32) / 16;
        let (_, slices, kc) = tc_geometry(tiles, 2048, 132, 2);
        assert_eq!(slices * kc, 4);
        assert!(slices > 1);
        // Router: 257 rows, one row per warp.
        assert_eq!(simt_geometry(257, 132, 4), (33, 1));
        // The 35B router set (257 rows of 2,048 columns) splits each row over 4 warps: 129
        // blocks; a set with a row for half a wave's warps or more does not split.
        assert_eq!(simt_split(257, 2048, 132 * 3 * 8), 4);
        assert_eq!(simt_split(2048, 4096, 132 * 3 * 8), 1);
        assert_eq!(simt_split(1000, 2048, 132 * 3 * 8), 2);
        assert_eq!(simt_split(257, 96, 132 * 3 * 8), 1); // 3 chunks of 32 columns
        assert_eq!(simt_split(257, 80, 132 * 3 * 8), 1); // not whole chunks
        assert_eq!(simt_split(0, 2048, 132 * 3 * 8), 1); // gemv_q's geometry keeps one block
        assert_eq!(simt_geometry(1_000_000, 132, 4), (528, 2));
    }

    fn shape(rows: usize, cols: usize, tokens: usize, grouped: bool) -> GemmShape {
        GemmShape { rows, cols, bits: 4, group: 64, tokens, grouped }
    }

    #[test]
    fn gemm_routes() {
        let blas = Some(BlasLimits { min_tokens: 128, scratch: 8192 * 2048 });
        let dense = shape(8192, 2048, 4096, false);
        assert_eq!(select_gemm(&dense, false, blas), GemmRoute::Cublas);
        assert_eq!(select_gemm(&dense, false, None), GemmRoute::TensorCore);
        assert_eq!(select_gemm(&dense, true, blas), GemmRoute::F32Tiles);
        assert_eq!(select_gemm(&shape(8192, 2048, 64, false), false, blas), GemmRoute::TensorCore);
        assert_eq!(select_gemm(&shape(512, 2048, 4096, true), false, blas), GemmRoute::TensorCore);
        assert_eq!(select_gemm(&shape(64, 96, 4096, false), false, None), GemmRoute::F32Tiles);
        // The lm_head never fits the scratch.
        assert_eq!(select_gemm(&shape(248_320, 2048, 4096, false), false, blas), GemmRoute::TensorCore);
        let few = GemmShape { bits: 8, ..shape(256, 2048, 4096, false) };
        assert_eq!(select_few_row(&few, false, true), FewRowRoute::TensorCore);
        assert_eq!(select_few_row(&shape(32, 2048, 7, false), false, true), FewRowRoute::TensorCore);
        assert_eq!(select_few_row(&few, true, true), FewRowRoute::Skinny);
        // Inputs that may leave f16's range, odd widths or codes: the CUDA cores.
        assert_eq!(select_few_row(&few, false, false), FewRowRoute::Skinny);
        assert_eq!(select_few_row(&shape(256, 96, 16, false), false, true), FewRowRoute::Skinny);
        assert_eq!(select_few_row(&GemmShape { bits: 6, ..few }, false, true), FewRowRoute::Skinny);
        assert_eq!(select_few_row(&shape(256, 8192 + 64, 16, false), true, true), FewRowRoute::F32Tiles);
        let (g, u) = (shape(512, 2048, 4096, false), shape(512, 2048, 4096, false));
        assert_eq!(select_glu(&g, &u, false, blas), GluRoute::Cublas);
        assert_eq!(select_glu(&g, &u, false, None), GluRoute::FusedTensorCore);
        assert_eq!(select_glu(&g, &u, true, blas), GluRoute::F32Split);
        let grouped = shape(512, 2048, 4096, true);
        assert_eq!(select_glu(&grouped, &grouped, false, blas), GluRoute::FusedTensorCore);
    }

    #[test]
    fn few_row_products_share_launches_where_the_stack_allows() {
        // Router (256 rows) + shared-expert gate (1): one launch, the gate in the ones tile.
        assert_eq!(few_tc_launches(&[256, 1], true), vec![(0, None, Some(1))]);
        // GDN b + a (32 + 32): each in its own chunk of one launch.
        assert_eq!(few_tc_launches(&[32, 32], true), vec![(0, Some(1), None)]);
        assert_eq!(few_tc_launches(&[12, 70], true), vec![(0, Some(1), None)]);
        // Other codes, or more products: one launch each.
        assert_eq!(few_tc_launches(&[32, 32], false), vec![(0, None, None), (1, None, None)]);
        assert_eq!(few_tc_launches(&[8, 8, 8], true).len(), 3);
        assert_eq!(few_tc_launches(&[5], true), vec![(0, None, None)]);
        // Chunks of 64 rows for the router, 32 for GDN b and a.
        assert_eq!(few_tc_tiles(&[256, 0]), 8);
        assert_eq!(few_tc_tiles(&[32, 32]), 4);
        assert_eq!(few_tc_tiles(&[8, 0]), 4);
    }

    #[test]
    fn few_row_blocks_fill_the_gpu_for_short_prompts() {
        // 35B router (4 chunks of 64 rows, 32 groups) at 4,096 tokens (256 tiles on 132 SMs): a
        // block per 16 tokens with all chunks, the groups in two parts.
        assert_eq!(few_tc_shape(4, 32, 256, 132), (4, 2));
        // At 700 tokens (44 tiles): one chunk per block, the groups in eight parts.
        assert_eq!(few_tc_shape(4, 32, 44, 132), (1, 8));
        // GDN b|a (one chunk): eight parts either way; the tiny model's two groups: two parts.
        assert_eq!(few_tc_shape(1, 32, 256, 132), (1, 8));
        assert_eq!(few_tc_shape(1, 2, 3, 132), (1, 2));
        // More chunks than warps: eight per block, no split.
        assert_eq!(few_tc_shape(20, 32, 500, 132), (8, 1));
        // The A fragments staged once per block where several chunks read them: the 35B router's
        // 32 groups in 128 KB; not for one chunk, nor past the SM's shared memory.
        assert_eq!(few_tc_staged_smem(4, 32), Some(131_072));
        assert_eq!(few_tc_staged_smem(1, 32), None);
        assert_eq!(few_tc_staged_smem(2, 48), Some(196_608));
        assert_eq!(few_tc_staged_smem(2, 49), None);
        for k in PF_FEW_TC_S.concat() {
            assert!(QMATMUL.kernels.contains(&k.name), "{}", k.name);
        }
    }

    #[test]
    fn batched_gemv_blocks_fit_two_per_sm_and_wide_ones_one() {
        // 35B inputs: hidden 2,048 (16 tokens per block), GDN value / attention inner 4,096 (8),
        // expert and shared-expert widths 512; the wide kernel's blocks 16 tokens.
        // The narrow blocks with the weight rings of `gemv_tcq` too.
        for cols in [2048, 4096, 512] {
            let narrow = gemv_tcb_smem(cols, tcb_tokens(cols), GEMV_THREADS) + gemv_ring_smem(GEMV_THREADS);
            assert!(narrow <= 113 * 1024, "{cols}: {narrow}");
            let wide = gemv_tcb_smem(cols, TCB_TOK, GEMV_TCB_W_THREADS);
            assert!(wide <= super::super::registry::SMEM_OPTIN_LIMIT, "{cols}: {wide}");
        }
        assert_eq!(tcb_tokens(2048), 16);
        assert_eq!(tcb_tokens(4096), 8);
        // Blocks of 8 tokens and more than 16 in the step: the wide kernel, 16 each; else the
        // 256-thread kernel.
        assert_eq!(tcb_blocking(2048, 16), (16, false));
        assert_eq!(tcb_blocking(2048, 17), (16, false));
        assert_eq!(tcb_blocking(2048, 128), (16, false));
        assert_eq!(tcb_blocking(4096, 8), (8, false));
        assert_eq!(tcb_blocking(4096, 16), (8, false));
        assert_eq!(tcb_blocking(4096, 17), (16, true));
        assert_eq!(tcb_blocking(4096, 128), (16, true));
        // The ring up to 16 tokens (never a wide step), over whole stages of columns.
        for ntok in 1..=128 {
            assert_eq!(tcb_ring(2048, ntok), ntok <= 16, "{ntok}");
            if tcb_ring(4096, ntok) {
                assert_eq!(tcb_blocking(4096, ntok).1, false, "{ntok}");
            }
        }
        assert!(tcb_ring(128, 16) && !tcb_ring(64, 1) && !tcb_ring(192, 1));
        // Wide steps have several token blocks: one block per SM by `tcb_row_blocks`.
        for ntok in 1..=128 {
            if let (tok, true) = tcb_blocking(4096, ntok) {
                assert_eq!(tcb_row_blocks(264, 132, ntok, tok), 132, "{ntok}");
            }
        }
    }

    #[test]
    fn skinny_blocks_spread_few_tokens() {
        // 35B router (256 rows) for a batch of 16: 8-row blocks; a 4,096-token prefill chunk
        // keeps one block per 256 rows.
        assert_eq!(skinny_rows_per_block(256, 2, 132), 8);
        assert_eq!(skinny_rows_per_block(256, 512, 132), 256);
        assert_eq!(skinny_rows_per_block(32, 512, 132), 32);
        assert_eq!(skinny_rows_per_block(1, 1, 132), 8);
        assert_eq!(skinny_rows_per_block(100_000, 1, 132), 256);
    }
}
