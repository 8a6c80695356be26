//! Gated DeltaNet (kernels/gdn.cu), the CUDA side of `cpu/gdn.rs`: the fused decode step (conv
//! ring, L2 norms, recurrent update, gated norm for one token) and the prefill pieces over T
//! tokens (causal conv with the ring's history, ring update, q/k L2 norms, the scan: the exact
//! recurrence with the state in registers, or the chunked form on the tensor cores; gated norm).

use super::device::{ptr, segment_table, Arg, Gpu, TABLE_SEGS};
use super::qmatmul::TcbStaging;
use super::registry::{Kernel, GDN, SMEM_OPTIN_LIMIT};
use crate::checkpoint::ModelConfig;
use anyhow::{bail, Result};

/// The state-reading kernels' two instances: (f32 state, f16 state).
const GDN_STEP: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step"), Kernel::dependent(&GDN, "gdn_step_f16")];
const GDN_STEP_BATCH: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step_batch"), Kernel::dependent(&GDN, "gdn_step_batch_f16")];
const GDN_STEP_PERSIST: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step_persist"), Kernel::dependent(&GDN, "gdn_step_persist_f16")];
/// `gdn_step`, `gdn_step_batch` and `gdn_step_persist` compiled for [`SHAPED_STEP_DIMS`].
const GDN_STEP_35B: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step_35b"), Kernel::dependent(&GDN, "gdn_step_35b_f16")];
const GDN_STEP_BATCH_35B: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step_batch_35b"), Kernel::dependent(&GDN, "gdn_step_batch_35b_f16")];
const GDN_STEP_PERSIST_35B: [Kernel; 2] = [Kernel::dependent(&GDN, "gdn_step_persist_35b"), Kernel::dependent(&GDN, "gdn_step_persist_35b_f16")];
/// The head shapes the `_35b` GDN steps have as constants (the 35B's; GDN_35B_DIMS in
/// kernels/gdn.cu): key heads, value heads, key dim, value dim, conv taps.
const SHAPED_STEP_DIMS: [usize; 5] = [16, 32, 128, 128, 4];
/// The block of `gdn_step_batch_35b(_f16)` (GDN_35B_BATCH_THREADS in kernels/gdn.cu): its passes'
/// threads, two value columns each, (dv / 2) * (dk / 32) at [`SHAPED_STEP_DIMS`].
const SHAPED_BATCH_THREADS: u32 = 256;

/// The decode steps' kernels: one sequence's, the batched per-item and persistent ones.
struct StepKernels {
    one: [Kernel; 2],
    per_item: [Kernel; 2],
    persist: [Kernel; 2],
    /// The per-item kernel's block (`None`: [`GdnDims::step_threads`], as the other two).
    per_item_threads: Option<u32>,
}

/// The general steps, or (`shaped`) the ones compiled for [`SHAPED_STEP_DIMS`]: the same values
/// either way.
fn step_kernels(shaped: bool) -> StepKernels {
    if shaped {
        StepKernels { one: GDN_STEP_35B, per_item: GDN_STEP_BATCH_35B, persist: GDN_STEP_PERSIST_35B, per_item_threads: Some(SHAPED_BATCH_THREADS) }
    } else {
        StepKernels { one: GDN_STEP, per_item: GDN_STEP_BATCH, persist: GDN_STEP_PERSIST, per_item_threads: None }
    }
}

/// The prefill conv's value channels and its q and k (with their L2 norms), writing f32 and
/// bf16 ([`GdnChunkScratch::inputs_bf16`]).
const PF_GDN_CONV: [Kernel; 2] = [Kernel::ordered(&GDN, "pf_gdn_conv"), Kernel::ordered(&GDN, "pf_gdn_conv_bf16")];
const PF_GDN_RING: Kernel = Kernel::ordered(&GDN, "pf_gdn_ring");
const PF_GDN_CONV_QK: [Kernel; 2] = [Kernel::ordered(&GDN, "pf_gdn_conv_qk"), Kernel::ordered(&GDN, "pf_gdn_conv_qk_bf16")];
/// The gated norm over z in f32 and in bf16 (the in-projection's z from cuBLAS).
const PF_GDN_NORM: [Kernel; 2] = [Kernel::ordered(&GDN, "pf_gdn_norm"), Kernel::ordered(&GDN, "pf_gdn_norm_bf16")];

/// Shape constants of a GDN layer.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
    /// Conv taps.
    pub kc: usize,
    /// Channels of the conv (q, k and v of every head).
    pub conv_dim: usize,
    pub eps: f32,
    /// The recurrent state is stored in f16 (`CudaOptions::gdn_state_f16`; the `_f16` kernels)
    /// instead of f32.
    pub state_f16: bool,
}

impl GdnDims {
    pub fn new(cfg: &ModelConfig) -> Self {
        GdnDims {
            nk: cfg.linear_num_key_heads,
            nv: cfg.linear_num_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
            kc: cfg.linear_conv_kernel_dim,
            conv_dim: cfg.gdn_conv_dim(),
            eps: cfg.rms_norm_eps as f32,
            state_f16: false,
        }
    }
    /// The same dims with the state stored in f16 (`f16`) or f32.
    pub fn with_state_f16(self, f16: bool) -> Self {
        GdnDims { state_f16: f16, ..self }
    }
    /// Bytes of one state entry.
    pub fn state_elem_bytes(&self) -> usize {
        if self.state_f16 {
            2
        } else {
            4
        }
    }
    /// Which instance of a state-reading kernel these dims launch.
    fn instance(&self, kernels: [Kernel; 2]) -> Kernel {
        kernels[self.state_f16 as usize]
    }
    /// Whether these are the head shapes the `_35b` GDN steps are compiled for.
    fn shaped_step(&self) -> bool {
        [self.nk, self.nv, self.dk, self.dv, self.kc] == SHAPED_STEP_DIMS
    }
    /// Threads of `gdn_step`: one per (value column, 32-key slice).
    fn step_threads(&self) -> u32 {
        (self.dv * (self.dk / 32)) as u32
    }
    fn step_smem(&self) -> u32 {
        ((2 * self.dk + self.dv + 2 * (self.dk / 32) * self.dv + 33) * 4) as u32
    }
    /// `gdn_step_batch` keeps the head's state slice in shared memory in front of the rest.
    fn step_batch_smem(&self) -> u32 {
        self.step_smem() + (self.dk * self.dv * self.state_elem_bytes()) as u32
    }
    /// `gdn_step_persist`: three stages of (state slice, the conv's history and inputs of the
    /// head's channels, z, four scalars), the rows' two pointers, the step's scratch, then the
    /// rows' positions.
    fn step_persist_smem(&self, rows: usize) -> u32 {
        self.step_smem() + ((PERSIST_STAGES * self.persist_stage_words() + 5 * rows) * 4) as u32
    }
    /// One stage of `gdn_step_persist` in f32 words (gdn_ps_stage in gdn.cu): the state slice, the
    /// conv's history and inputs, z, four scalars.
    fn persist_stage_words(&self) -> usize {
        self.dk * self.dv * self.state_elem_bytes() / 4 + self.kc * (2 * self.dk + self.dv) + self.dv + 4
    }
}

/// `gdn_step_persist`'s stages (GDN_PS_STAGES in kernels/gdn.cu).
const PERSIST_STAGES: usize = 3;
/// The most conv taps `gdn_step_persist` holds (its `tp[8]` registers; the model has 4).
const PERSIST_MAX_TAPS: usize = 8;

/// Whether `gdn_step_persist` takes a step of `rows` rows at these dims: its stages fit the
/// shared-memory opt-in, a block of at most 512 threads, the conv taps in its registers.
fn persist_fits(d: &GdnDims, rows: usize) -> bool {
    d.step_persist_smem(rows) <= SMEM_OPTIN_LIMIT && d.step_threads() <= 512 && d.kc <= PERSIST_MAX_TAPS
}

/// Whether the decode step takes these head dims (key dims in 32-lane slices, one block of at most
/// 1,024 threads per value head). The backend needs it.
pub fn step_supported(d: &GdnDims) -> bool {
    d.dk.is_multiple_of(32) && d.step_threads() <= 1024
}

/// Whether the prefill kernels take these head dims (a scan instance per key dim, value columns
/// in warps). Without them multi-token forwards run the decode step per token.
pub fn chunk_supported(d: &GdnDims) -> bool {
    select_scan(d).is_some() && d.dv.is_multiple_of(32) && d.dv <= 1024
}

/// The layer's weights and state, and the activations it reads and writes.
pub struct GdnPtrs {
    /// In-projection outputs: q|k|v, z, b, a.
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
    /// Gated-norm output (the out-projection's input).
    pub y: u64,
}

/// One token (decode): token and position in the step buffer.
pub fn step(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, step: u64) -> Result<()> {
    launch_step(gpu, d, p, step, d.shaped_step())
}

fn launch_step(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, step: u64, shaped: bool) -> Result<()> {
    gpu.launch(d.instance(step_kernels(shaped).one), (d.nv as u32, 1, 1), d.step_threads(), d.step_smem(), &step_args(d, p, step))
}

/// The one-sequence step on the general instance or (`shaped`) on the one compiled for the 35B's
/// head shapes, which these dims must then be: the two side by side in tests.
#[cfg(feature = "cuda-testing")]
pub fn step_with(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, step: u64, shaped: bool) -> Result<()> {
    check_shaped(d, shaped)?;
    launch_step(gpu, d, p, step, shaped)
}

#[cfg(feature = "cuda-testing")]
fn check_shaped(d: &GdnDims, shaped: bool) -> Result<()> {
    if shaped && !d.shaped_step() {
        bail!("the _35b GDN steps are compiled for head shapes {SHAPED_STEP_DIMS:?}, not these dims");
    }
    Ok(())
}

/// The batched step's kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepBatchKernel {
    /// `gdn_step_batch`: a block per (row, head) item, three blocks per SM at the 35B's dims (four
    /// with the f16 state).
    PerItem,
    /// `gdn_step_persist` on `blocks` blocks, each taking every `blocks`-th item and copying
    /// everything an item reads into shared memory two items ahead (one block per SM).
    Persist { blocks: usize },
}

/// The batched step's kernel for `items` (row, head) items on `sms` multiprocessors: the
/// persistent kernel while every item gets a block of its own (all of an item's loads in flight
/// at once, none of them on its arithmetic's path: +3% aggregate decode at 1 and 4 rows of the
/// 35B), `gdn_step_batch` beyond, where the persistent kernel's one block per SM computes its
/// items too slowly (-4% at 16 and 64 rows; docs/cuda.md, "Batched decode").
pub fn select_step_batch(items: usize, sms: usize) -> StepBatchKernel {
    if items <= sms {
        StepBatchKernel::Persist { blocks: items }
    } else {
        StepBatchKernel::PerItem
    }
}

/// One token of each of `rows` sequences (batched decode): `p.ring` and `p.state` are device
/// tables of the rows' ring and state pointers, `steps` their `[token, position]` pairs, the
/// activations row-major over the rows. With `staged` the outputs are also staged there for the
/// out-projection's batched GEMV, as `stage_tcb` without a gain would (see [`stages_output`]).
#[allow(clippy::too_many_arguments)]
pub fn step_batch(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, steps: u64, rows: usize, staged: Option<&TcbStaging>, kernel: StepBatchKernel) -> Result<()> {
    launch_batch(gpu, d, p, steps, rows, staged, kernel, d.shaped_step())
}

/// [`step_batch`] on the general instances or (`shaped`) the ones compiled for the 35B's head
/// shapes.
#[allow(clippy::too_many_arguments)]
fn launch_batch(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, steps: u64, rows: usize, staged: Option<&TcbStaging>, kernel: StepBatchKernel, shaped: bool) -> Result<()> {
    let mut args = batch_args(gpu, d, p, steps, rows, staged)?;
    if let StepBatchKernel::Persist { blocks } = kernel {
        if persist_fits(d, rows) {
            args.push(Arg::I(rows as i32));
            return gpu.launch(d.instance(step_kernels(shaped).persist), (blocks.clamp(1, rows * d.nv) as u32, 1, 1), d.step_threads(), d.step_persist_smem(rows), &args);
        }
    }
    launch_per_item(gpu, d, &step_kernels(shaped), rows, &args)
}

/// The batched steps' arguments: [`step_args`], then where the outputs are staged (null without).
fn batch_args(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, steps: u64, rows: usize, staged: Option<&TcbStaging>) -> Result<Vec<Arg>> {
    let mut args = step_args(d, p, steps);
    let s = &gpu.stream;
    match staged {
        Some(st) => {
            if !stages_output(d) || rows > st.rows || d.nv * d.dv > st.cols {
                bail!("the GDN step cannot stage {rows} x {} outputs into {} x {}", d.nv * d.dv, st.rows, st.cols);
            }
            args.extend([Arg::P(ptr(&st.frag, s)), Arg::P(ptr(&st.gsum, s))]);
        }
        None => args.extend([Arg::P(0), Arg::P(0)]),
    }
    Ok(args)
}

/// `kernels` (`gdn_step_batch` or its shaped instance) over `rows` rows with `args`.
fn launch_per_item(gpu: &Gpu, d: &GdnDims, kernels: &StepKernels, rows: usize, args: &[Arg]) -> Result<()> {
    let smem = d.step_batch_smem();
    if smem > SMEM_OPTIN_LIMIT {
        bail!("the batched GDN step keeps a {} x {} state slice in shared memory: {smem} bytes do not fit", d.dk, d.dv);
    }
    let threads = kernels.per_item_threads.unwrap_or_else(|| d.step_threads());
    gpu.launch(d.instance(kernels.per_item), (d.nv as u32, rows as u32, 1), threads, smem, args)
}

/// The batched step on `kernel`'s general instance or (`shaped`) on the one compiled for the
/// 35B's head shapes, which these dims must then be: the two side by side in tests.
#[cfg(feature = "cuda-testing")]
#[allow(clippy::too_many_arguments)]
pub fn step_batch_with(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, steps: u64, rows: usize, staged: Option<&TcbStaging>, kernel: StepBatchKernel, shaped: bool) -> Result<()> {
    check_shaped(d, shaped)?;
    launch_batch(gpu, d, p, steps, rows, staged, kernel, shaped)
}

/// Whether the batched step can stage its outputs itself: each head's outputs are whole 64-column
/// groups of the staged row.
pub fn stages_output(d: &GdnDims) -> bool {
    d.dv.is_multiple_of(64)
}

fn step_args(d: &GdnDims, p: &GdnPtrs, step: u64) -> Vec<Arg> {
    let (inputs, layer) = ([p.qkv, p.z, p.b, p.a], [p.ring, p.taps, p.dt_bias, p.neg_a, p.norm, p.state]);
    let mut args: Vec<Arg> = inputs.into_iter().chain(layer).chain([p.y, step]).map(Arg::P).collect();
    args.extend([d.nk, d.nv, d.dk, d.dv, d.kc].map(|v| Arg::I(v as i32)));
    args.push(Arg::F(d.eps));
    args
}

/// Prefill scratch of the layer: conv outputs `[T][conv_dim]`, normalised q and k, scan outputs,
/// the chunked scan's per-chunk products.
pub struct GdnChunkScratch {
    pub conv: u64,
    pub qn: u64,
    pub kn: u64,
    pub o: u64,
    pub chunked: ChunkedScratch,
    /// The conv's outputs (the scan's q, k and v) as bf16 rather than f32: only where every
    /// segment takes the chunked scan ([`scan_inputs_bf16`]).
    pub inputs_bf16: bool,
}

/// Tokens per chunk of the chunked scan (GC in gdn.cu), state columns per walk block (GCV) and
/// chunks of tiles in the walk's shared memory (GCW_STAGES).
const SCAN_CHUNK: usize = 64;
const SCAN_COLUMNS: usize = 32;
const WALK_STAGES: usize = 3;
/// Segments shorter than this run the exact scan also in the default mode: one chunk's setup
/// costs about what its tokens' exact steps do.
pub const CHUNKED_MIN_TOKENS: usize = 64;

/// Device pointers of the chunked scan's scratch for `chunks` chunks of every value head (one
/// launch's segments, chunk after chunk): U, W and M (bf16) and the decays' prefix sums G (f32)
/// per value head, q and k (bf16) per key head.
#[derive(Clone, Copy, Default)]
pub struct ChunkedScratch {
    pub u: u64,
    pub w: u64,
    pub q: u64,
    pub k: u64,
    pub m: u64,
    pub g: u64,
    pub chunks: usize,
}

impl ChunkedScratch {
    /// Chunks one launch of at most [`SCAN_SEGS`] segments of `tokens` in all may take (each
    /// segment's last chunk may be partial).
    pub fn chunks_for(tokens: usize) -> usize {
        tokens.div_ceil(SCAN_CHUNK) + SCAN_SEGS
    }

    /// Elements of u, w, q, k, m (u16) and g (f32) for `chunks` chunks.
    pub fn sizes(d: &GdnDims, chunks: usize) -> [usize; 6] {
        let rows = chunks * d.nv * SCAN_CHUNK;
        let key_rows = chunks * d.nk * SCAN_CHUNK;
        [rows * d.dv, rows * d.dk, key_rows * d.dk, key_rows * d.dk, rows * SCAN_CHUNK, rows]
    }
}

/// Sequences per conv launch (GDN_CONV_SEGS in kernels/gdn.cu).
pub const CONV_SEGS: usize = TABLE_SEGS;

/// One sequence's rows `r0..r0 + n` of a prefill chunk, at positions `pos0..`, with its conv ring.
#[derive(Clone, Copy, Debug)]
pub struct ConvSegment {
    pub ring: u64,
    pub r0: usize,
    pub n: usize,
    pub pos0: usize,
}

/// `struct ConvSegs`: the rings, the first rows, the positions.
fn conv_segs_arg(segs: &[ConvSegment]) -> Arg {
    segment_table(segs.iter().map(|s| ([s.ring], [s.r0 as i32, s.pos0 as i32])))
}

/// The prefill conv of every segment (rows back to back, in row order) of a chunk: the causal
/// conv + SiLU of q, k and v from `p.qkv` (the chunk's rows) and each segment's ring into the
/// scratch (q and k L2-normalised), then each ring advanced; up to [`CONV_SEGS`] segments per
/// launch.
pub fn conv(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, s: &GdnChunkScratch, segs: &[ConvSegment]) -> Result<()> {
    let (c, key_dim) = (d.conv_dim, d.nk * d.dk);
    if d.dk > 128 || !d.dk.is_multiple_of(4) || !c.is_multiple_of(4) {
        bail!("the prefill conv takes key heads of at most 128 channels in fours, not {}", d.dk);
    }
    if segs.windows(2).any(|w| w[1].r0 != w[0].r0 + w[0].n) || segs.iter().any(|g| g.n == 0) {
        bail!("the prefill conv takes non-empty segments back to back");
    }
    let (ci, kci, io) = (Arg::I(c as i32), Arg::I(d.kc as i32), s.inputs_bf16 as usize);
    let v_blocks = (c - 2 * key_dim).div_ceil(4 * 256) as u32;
    for group in segs.chunks(CONV_SEGS) {
        let rows = group.iter().map(|g| g.n).sum::<usize>();
        let (segs_arg, nseg, ti) = (conv_segs_arg(group), Arg::I(group.len() as i32), Arg::I(rows as i32));
        let args = [Arg::P(p.qkv), segs_arg.clone(), nseg.clone(), Arg::P(p.taps), ti.clone(), ci.clone(), kci.clone(), Arg::I(2 * key_dim as i32), Arg::P(s.conv)];
        gpu.launch(PF_GDN_CONV[io], (v_blocks, rows as u32, 1), 256, 0, &args)?;
        let args = [Arg::P(p.qkv), segs_arg.clone(), nseg.clone(), Arg::P(p.taps), ti.clone(), ci.clone(), kci.clone(), Arg::I(d.nk as i32), Arg::I(d.dk as i32), Arg::P(s.qn), Arg::P(s.kn)];
        gpu.launch(PF_GDN_CONV_QK[io], ((rows * d.nk).div_ceil(8) as u32, 1, 1), 256, 0, &args)?;
        let args = [Arg::P(p.qkv), segs_arg, nseg, ti, ci.clone(), kci.clone()];
        gpu.launch(PF_GDN_RING, (c.div_ceil(256) as u32, d.kc as u32, group.len() as u32), 256, 0, &args)?;
    }
    Ok(())
}

/// The scan instance for the key head dim and state element (the state of one column lives in
/// registers).
pub fn select_scan(d: &GdnDims) -> Option<Kernel> {
    let names = match d.dk {
        32 => ["pf_gdn_scan_32", "pf_gdn_scan_32_f16"],
        64 => ["pf_gdn_scan_64", "pf_gdn_scan_64_f16"],
        128 => ["pf_gdn_scan_128", "pf_gdn_scan_128_f16"],
        _ => return None,
    };
    Some(d.instance(names.map(|n| Kernel::ordered(&GDN, n))))
}

/// State columns per scan block: 4 warps x 32 lanes / lanes per column.
fn scan_block_columns(dk: usize) -> usize {
    4 * 32 / (dk / 16).clamp(2, 8)
}

/// Sequences per scan launch (GDN_SCAN_SEGS in kernels/gdn.cu).
pub const SCAN_SEGS: usize = TABLE_SEGS;

/// One sequence's rows `r0..r0 + n` of a chunk, scanned with its layer state `state`.
#[derive(Clone, Copy, Debug)]
pub struct ScanSegment {
    pub state: u64,
    pub r0: usize,
    pub n: usize,
}

/// The kernel's `ScanSegs`: the states, the first rows, the row counts.
fn scan_segs_arg(segs: &[ScanSegment]) -> Arg {
    segment_table(segs.iter().map(|s| ([s.state], [s.r0 as i32, s.n as i32])))
}

/// How a segment's GDN recurrence runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanPath {
    /// `pf_gdn_scan_*`: token by token, the state in registers (f32, as the CPU).
    Exact,
    /// `pf_gdn_chunk_prep_*` + `pf_gdn_chunk_walk_*`: 64-token chunks in the WY form on the
    /// tensor cores (bf16 operands, f32 state).
    Chunked,
}

/// Whether the chunked scan takes these head dims: key dims 64 or 128, value columns in blocks of
/// 32 (at most 256: the prep's shared memory), key heads shared by whole groups of value heads.
pub fn chunked_supported(d: &GdnDims) -> bool {
    matches!(d.dk, 64 | 128) && d.dv.is_multiple_of(SCAN_COLUMNS) && d.dv <= 256 && d.nk > 0 && d.nv.is_multiple_of(d.nk)
}

/// The path of a segment of `n` tokens: the chunked form outside the exact mode once it is long
/// enough, else the exact recurrence.
pub fn select_scan_path(d: &GdnDims, n: usize, exact: bool) -> ScanPath {
    if !exact && n >= CHUNKED_MIN_TOKENS && chunked_supported(d) {
        ScanPath::Chunked
    } else {
        ScanPath::Exact
    }
}

/// Whether the scan of `segs` takes its inputs in bf16: where every segment runs the chunked
/// form, whose products take q, k and v rounded to bf16 (the products' other operands, b e^G k
/// and b v, are then rounded from the bf16 values; the trained fixture bounds the difference,
/// docs/correctness.md). The exact recurrence keeps them f32.
pub fn scan_inputs_bf16(d: &GdnDims, segs: &[ScanSegment], exact: bool) -> bool {
    !segs.is_empty() && segs.iter().all(|g| select_scan_path(d, g.n, exact) == ScanPath::Chunked)
}

/// The recurrence over each segment's tokens for every value head, the segments side by side
/// ([`SCAN_SEGS`] per launch), each on the path `select_scan_path` picks for its length alone (so
/// a sequence's outputs do not depend on the segments beside it): reads q/k (normalised), v from
/// the conv output (row stride `conv_dim`), raw b/a at the segment's rows; updates its state;
/// writes `o` at its rows. `p` and `s` point at the chunk's first row. `mark` is called with
/// "gdn.prep" after each chunked group's prep launch (the profile's split of the scan phase).
pub fn scan(
    gpu: &Gpu,
    d: &GdnDims,
    p: &GdnPtrs,
    s: &GdnChunkScratch,
    segs: &[ScanSegment],
    exact: bool,
    mark: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let (chunked, short): (Vec<ScanSegment>, Vec<ScanSegment>) =
        segs.iter().partition(|g| select_scan_path(d, g.n, exact) == ScanPath::Chunked);
    if s.inputs_bf16 && !short.is_empty() {
        bail!("the exact GDN scan takes f32 inputs, not the bf16 ones of the chunked scan");
    }
    for group in chunked.chunks(SCAN_SEGS) {
        scan_chunked(gpu, d, p, s, group, &mut *mark)?;
    }
    for group in short.chunks(SCAN_SEGS) {
        scan_exact(gpu, d, p, s, group)?;
    }
    Ok(())
}

/// The exact recurrence (`pf_gdn_scan_*`) over up to [`SCAN_SEGS`] segments.
pub fn scan_exact(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, s: &GdnChunkScratch, group: &[ScanSegment]) -> Result<()> {
    let Some(k) = select_scan(d) else {
        bail!("GDN key head dim {} not supported by the prefill scan", d.dk);
    };
    if s.inputs_bf16 {
        bail!("the exact GDN scan takes f32 inputs");
    }
    let ptrs = [s.qn, s.kn, s.conv, p.b, p.a, p.dt_bias, p.neg_a];
    let mut args: Vec<Arg> = ptrs.into_iter().map(Arg::P).collect();
    args.extend([scan_segs_arg(group), Arg::P(s.o)]);
    args.extend([d.nk, d.nv, d.dv, d.conv_dim].map(|v| Arg::I(v as i32)));
    let grid = (d.nv as u32, d.dv.div_ceil(scan_block_columns(d.dk)) as u32, group.len() as u32);
    gpu.launch(k, grid, 128, 0, &args)
}

/// The chunked scan's prep instance for its inputs' element (no state) and the walk instance for
/// the state element.
fn chunked_kernels(d: &GdnDims, inputs_bf16: bool) -> Option<(Kernel, Kernel)> {
    let (preps, walks) = match d.dk {
        64 => (["pf_gdn_chunk_prep_64", "pf_gdn_chunk_prep_64_bf16"], ["pf_gdn_chunk_walk_64", "pf_gdn_chunk_walk_64_f16"]),
        128 => (["pf_gdn_chunk_prep_128", "pf_gdn_chunk_prep_128_bf16"], ["pf_gdn_chunk_walk_128", "pf_gdn_chunk_walk_128_f16"]),
        _ => return None,
    };
    Some((Kernel::ordered(&GDN, preps[inputs_bf16 as usize]), d.instance(walks.map(|n| Kernel::ordered(&GDN, n)))))
}

/// Dynamic shared memory of pf_gdn_chunk_prep and pf_gdn_chunk_walk (gdn.cu).
fn chunked_smem(dk: usize, dv: usize) -> (u32, u32) {
    let c = SCAN_CHUNK;
    let (ldk, ldm, ldc) = (dk + 8, 72, 40);
    // q and k for the k.k / q.k products, then A (f32) and T in their place; b e^G k, b v; b, G.
    let region = (2 * 2 * c * ldk).max(4 * c * 68 + 2 * c * ldm);
    let prep = region + 2 * (c * ldk + c * (dv + 8)) + 4 * 2 * c;
    // WALK_STAGES chunks of W, q, k and M; S, D and the decayed D; as many chunks of U's columns
    // and of G.
    let st = WALK_STAGES;
    let walk = 2 * (st * (3 * c * ldk + c * ldm) + (dk + 2 * c + st * c) * ldc) + 4 * st * c;
    (prep as u32, walk as u32)
}

/// The chunked scan (see gdn.cu) over up to [`SCAN_SEGS`] segments: every chunk's products at
/// once, then the walk through each segment's chunks that carries its state; `mark("gdn.prep")`
/// between the two.
pub fn scan_chunked(
    gpu: &Gpu,
    d: &GdnDims,
    p: &GdnPtrs,
    s: &GdnChunkScratch,
    group: &[ScanSegment],
    mark: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let Some((prep, walk)) = chunked_kernels(d, s.inputs_bf16).filter(|_| chunked_supported(d)) else {
        bail!("GDN heads (key dim {}, value dim {}) not supported by the chunked scan", d.dk, d.dv);
    };
    let c = &s.chunked;
    let chunks: usize = group.iter().map(|g| g.n.div_ceil(SCAN_CHUNK)).sum();
    if chunks > c.chunks {
        bail!("the chunked GDN scan has scratch for {} chunks, the segments need {chunks}", c.chunks);
    }
    let longest = group.iter().map(|g| g.n).max().unwrap_or(0);
    let (prep_smem, walk_smem) = chunked_smem(d.dk, d.dv);
    let outs = [c.u, c.w, c.q, c.k, c.m, c.g].map(Arg::P);
    let mut args: Vec<Arg> = [s.qn, s.kn, s.conv, p.b, p.a, p.dt_bias, p.neg_a].into_iter().map(Arg::P).collect();
    args.push(scan_segs_arg(group));
    args.extend(outs.iter().cloned());
    args.extend([d.nk, d.nv, d.dv, d.conv_dim].map(|v| Arg::I(v as i32)));
    let grid = (longest.div_ceil(SCAN_CHUNK) as u32, d.nv as u32, group.len() as u32);
    gpu.launch(prep, grid, 128, prep_smem, &args)?;
    mark("gdn.prep")?;
    let mut args: Vec<Arg> = outs.into_iter().collect();
    args.extend([scan_segs_arg(group), Arg::P(s.o)]);
    args.extend([d.nk, d.nv, d.dv].map(|v| Arg::I(v as i32)));
    let grid = (d.nv as u32, (d.dv / SCAN_COLUMNS) as u32, group.len() as u32);
    gpu.launch(walk, grid, 256, walk_smem, &args)
}

/// Gated RMSNorm of the scan outputs with z (bf16 with `z_bf16`) into `y`, or only into its bf16
/// copy at `staged` (`Gemm::stage_input`: the out-projection's cuBLAS operand).
pub fn gated_norm(gpu: &Gpu, d: &GdnDims, p: &GdnPtrs, s: &GdnChunkScratch, n: usize, z_bf16: bool, staged: Option<u64>) -> Result<()> {
    if d.dv > 128 || !d.dv.is_multiple_of(4) {
        bail!("the prefill gated norm takes value heads of at most 128 channels in fours, not {}", d.dv);
    }
    let args = [Arg::P(s.o), Arg::P(p.z), Arg::P(p.norm), Arg::P(p.y), Arg::P(staged.unwrap_or(0)), Arg::I(n as i32), Arg::I(d.nv as i32), Arg::I(d.dv as i32), Arg::F(d.eps)];
    gpu.launch(PF_GDN_NORM[z_bf16 as usize], ((n * d.nv).div_ceil(8) as u32, 1, 1), 256, 0, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batched_step_fits_three_blocks_per_sm_at_35b_dims() {
        let d = GdnDims::new(&crate::checkpoint::ModelConfig::qwen36_35b_a3b());
        // 228 KiB of shared memory per SM, 1 KiB of it reserved per block.
        assert!(3 * (d.step_batch_smem() + 1024) <= 228 * 1024, "{}", d.step_batch_smem());
        assert_eq!(d.step_threads(), 512);
    }

    #[test]
    fn the_batched_step_is_persistent_while_every_item_has_a_block() {
        assert_eq!(select_step_batch(32, 132), StepBatchKernel::Persist { blocks: 32 });
        assert_eq!(select_step_batch(132, 132), StepBatchKernel::Persist { blocks: 132 });
        assert_eq!(select_step_batch(133, 132), StepBatchKernel::PerItem);
        assert_eq!(select_step_batch(64 * 32, 132), StepBatchKernel::PerItem);
        // Three stages and the tables of the most rows a batch takes fit the opt-in limit.
        let d = GdnDims::new(&crate::checkpoint::ModelConfig::qwen36_35b_a3b());
        let most = d.step_persist_smem(super::super::batch::MAX_BATCH);
        assert!(most <= SMEM_OPTIN_LIMIT, "{most}");
        assert!(persist_fits(&d, super::super::batch::MAX_BATCH));
        // A conv wider than the kernel's tap registers stays on gdn_step_batch.
        assert!(!persist_fits(&GdnDims { kc: PERSIST_MAX_TAPS + 1, ..d }, 4));
    }

    #[test]
    fn scan_segments_pack_as_the_kernel_reads_them() {
        let segs: Vec<ScanSegment> = (0..3).map(|i| ScanSegment { state: 0x1000 + i as u64, r0: 10 * i, n: 7 + i }).collect();
        let Arg::S(w) = scan_segs_arg(&segs) else { panic!("not a struct argument") };
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        let int = |at: usize| i32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        for (i, s) in segs.iter().enumerate() {
            assert_eq!(w[i], s.state);
            // float* state[16] (128 bytes), int r0[16] (64), int n[16] (64).
            assert_eq!(int(128 + 4 * i), s.r0 as i32);
            assert_eq!(int(192 + 4 * i), s.n as i32);
        }
        assert_eq!(w[3..SCAN_SEGS], [0; SCAN_SEGS - 3]);
    }

    #[test]
    fn the_default_mode_scans_long_segments_in_chunks() {
        let big = GdnDims::new(&ModelConfig::qwen36_35b_a3b());
        let tiny = GdnDims::new(&ModelConfig::tiny());
        for d in [big, tiny] {
            assert!(chunked_supported(&d));
            assert_eq!(select_scan_path(&d, CHUNKED_MIN_TOKENS, false), ScanPath::Chunked);
            assert_eq!(select_scan_path(&d, 4096, false), ScanPath::Chunked);
            assert_eq!(select_scan_path(&d, CHUNKED_MIN_TOKENS - 1, false), ScanPath::Exact);
            assert_eq!(select_scan_path(&d, 4096, true), ScanPath::Exact);
        }
        // The scan's inputs in bf16 only where every segment is chunked (never in the exact mode),
        // with the prep's bf16 instance and the convs' bf16 outputs.
        let seg = |n| ScanSegment { state: 0, r0: 0, n };
        let segs = [seg(4096), seg(CHUNKED_MIN_TOKENS)];
        assert!(scan_inputs_bf16(&big, &segs, false));
        assert!(!scan_inputs_bf16(&big, &segs, true));
        assert!(!scan_inputs_bf16(&big, &[seg(4096), seg(CHUNKED_MIN_TOKENS - 1)], false));
        assert!(!scan_inputs_bf16(&big, &[], false));
        let (p64, p128) = (chunked_kernels(&tiny, true).unwrap().0, chunked_kernels(&big, true).unwrap().0);
        assert_eq!((p64.name, p128.name), ("pf_gdn_chunk_prep_64_bf16", "pf_gdn_chunk_prep_128_bf16"));
        for k in [PF_GDN_CONV, PF_GDN_CONV_QK].concat().into_iter().chain([p64, p128]) {
            assert!(GDN.kernels.contains(&k.name), "{}", k.name);
        }
        // Key dims without an instance, too many value columns for the prep's shared memory.
        assert_eq!(select_scan_path(&GdnDims { dk: 32, ..tiny }, 4096, false), ScanPath::Exact);
        assert_eq!(select_scan_path(&GdnDims { dk: 128, dv: 512, ..tiny }, 4096, false), ScanPath::Exact);
        assert_eq!(select_scan_path(&GdnDims { dv: 96 + 16, ..tiny }, 4096, false), ScanPath::Exact);
        // 16 segments of 4,096 tokens in all: at most one partial chunk each.
        assert_eq!(ChunkedScratch::chunks_for(4096), 64 + 16);
        let sizes = ChunkedScratch::sizes(&big, 80);
        assert_eq!(sizes, [80 * 32 * 64 * 128, 80 * 32 * 64 * 128, 80 * 16 * 64 * 128, 80 * 16 * 64 * 128, 80 * 32 * 64 * 64, 80 * 32 * 64]);
        // Shared memory within what a block may take (227 KB): the 35B's walk 220,928 bytes (one
        // block per SM), its prep 70,144 (three).
        let (prep, walk) = chunked_smem(128, 128);
        assert_eq!((prep, walk), (70_144, 220_928));
        assert!(prep <= SMEM_OPTIN_LIMIT && walk <= SMEM_OPTIN_LIMIT, "{prep} {walk}");
        assert!(chunked_smem(128, 256).0 <= SMEM_OPTIN_LIMIT);
    }

    #[test]
    fn segment_tables_pack_pointers_then_two_i32_arrays() {
        let seg = |ring, r0, n, pos0| ConvSegment { ring, r0, n, pos0 };
        let Arg::S(w) = conv_segs_arg(&[seg(0x1000, 0, 5, 7), seg(0x2000, 5, 3, 0), seg(0x3000, 8, 1, 9)]) else {
            panic!("a segment table is a struct argument");
        };
        assert_eq!(&w[..4], &[0x1000, 0x2000, 0x3000, 0]);
        // r0 = [0, 5, 8], pos0 = [7, 0, 9]: little-endian i32 pairs.
        assert_eq!(&w[16..18], &[5 << 32, 8]);
        assert_eq!(&w[24..26], &[7, 9]);
        let Arg::S(w) = scan_segs_arg(&[ScanSegment { state: 0x4000, r0: 3, n: 4 }]) else {
            panic!("a segment table is a struct argument");
        };
        assert_eq!((w[0], w[16], w[24]), (0x4000, 3, 4));
    }

    #[test]
    fn kernels_for_the_35b_and_tiny_shapes() {
        let big = GdnDims::new(&ModelConfig::qwen36_35b_a3b());
        assert!(step_supported(&big) && chunk_supported(&big));
        assert_eq!(select_scan(&big).unwrap().name, "pf_gdn_scan_128");
        assert_eq!(big.step_threads(), 512);
        assert_eq!(scan_block_columns(128), 16);
        let tiny = GdnDims::new(&ModelConfig::tiny());
        assert!(step_supported(&tiny) && chunk_supported(&tiny));
        assert_eq!(select_scan(&tiny).unwrap().name, "pf_gdn_scan_64");
        assert_eq!(scan_block_columns(64), 32);
        assert!(select_scan(&GdnDims { dk: 96, ..tiny }).is_none());
        assert!(step_supported(&GdnDims { dk: 96, ..tiny }));
        assert!(!chunk_supported(&GdnDims { dk: 96, ..tiny }));
        assert!(!step_supported(&GdnDims { dk: 128, dv: 512, ..tiny }));
    }

    #[test]
    fn the_35b_head_shapes_take_the_shaped_steps() {
        let big = GdnDims::new(&ModelConfig::qwen36_35b_a3b());
        assert!(big.shaped_step());
        // The constants are the 512 threads' shapes: one per (value column, 32-key slice).
        assert_eq!(big.step_threads(), 512);
        let (shaped, general) = (step_kernels(true), step_kernels(false));
        let f16 = big.with_state_f16(true);
        assert_eq!([shaped.one, shaped.per_item, shaped.persist].map(|k| f16.instance(k).name), ["gdn_step_35b_f16", "gdn_step_batch_35b_f16", "gdn_step_persist_35b_f16"]);
        assert_eq!([general.one, general.per_item, general.persist].map(|k| big.instance(k).name), ["gdn_step", "gdn_step_batch", "gdn_step_persist"]);
        // The shaped per-item step's block is its passes' threads, two value columns each; five
        // blocks of it fit an SM with the f16 slice (228 KiB, 1 KiB reserved per block).
        assert_eq!(shaped.per_item_threads, Some((big.dv / 2 * (big.dk / 32)) as u32));
        assert_eq!(general.per_item_threads, None);
        assert!(5 * (f16.step_batch_smem() + 1024) <= 228 * 1024, "{}", f16.step_batch_smem());
        // Any other shape takes the general kernels.
        assert!(!GdnDims::new(&ModelConfig::tiny()).shaped_step());
        for other in [GdnDims { kc: 3, ..big }, GdnDims { nv: 16, ..big }, GdnDims { nk: 32, ..big }, GdnDims { dv: 64, ..big }, GdnDims { dk: 64, ..big }] {
            assert!(!other.shaped_step(), "{other:?}");
        }
    }

    #[test]
    fn an_f16_state_launches_the_f16_instances_with_half_the_state_bytes() {
        let f32s = GdnDims::new(&ModelConfig::qwen36_35b_a3b());
        let f16s = f32s.with_state_f16(true);
        assert_eq!((f32s.state_elem_bytes(), f16s.state_elem_bytes()), (4, 2));
        for (k, name) in [(GDN_STEP, "gdn_step"), (GDN_STEP_BATCH, "gdn_step_batch"), (GDN_STEP_PERSIST, "gdn_step_persist")] {
            assert_eq!(f32s.instance(k).name, name);
            assert_eq!(f16s.instance(k).name, format!("{name}_f16"));
        }
        assert_eq!(select_scan(&f16s).unwrap().name, "pf_gdn_scan_128_f16");
        let ((p32, w32), (p16, w16)) = (chunked_kernels(&f32s, false).unwrap(), chunked_kernels(&f16s, false).unwrap());
        assert_eq!((p32.name, w32.name), ("pf_gdn_chunk_prep_128", "pf_gdn_chunk_walk_128"));
        assert_eq!((p16.name, w16.name), ("pf_gdn_chunk_prep_128", "pf_gdn_chunk_walk_128_f16"));
        // Every instance is in the module the backend compiles.
        for k in [GDN_STEP, GDN_STEP_35B, GDN_STEP_BATCH, GDN_STEP_BATCH_35B, GDN_STEP_PERSIST, GDN_STEP_PERSIST_35B].concat().into_iter().chain([w16, select_scan(&f16s).unwrap()]) {
            assert!(GDN.kernels.contains(&k.name), "{}", k.name);
        }
        // The batched steps' shared memory: the 128 x 128 slice is 64 KB in f32, 32 KB in f16;
        // a stage of the persistent step (16-byte aligned) 8,192 words smaller.
        assert_eq!(f32s.step_batch_smem() - f16s.step_batch_smem(), 128 * 128 * 2);
        assert_eq!(f32s.step_persist_smem(4) - f16s.step_persist_smem(4), (3 * 128 * 128 / 2 * 4) as u32);
        // Every stage starts 16-byte aligned (the cp.async copies into it), at both models' dims.
        let tiny16 = GdnDims::new(&ModelConfig::tiny()).with_state_f16(true);
        assert_eq!((f16s.persist_stage_words(), tiny16.persist_stage_words()), (9_860, 2_884));
        assert!(f16s.persist_stage_words().is_multiple_of(4) && tiny16.persist_stage_words().is_multiple_of(4));
    }
}
