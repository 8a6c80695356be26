//! Mixture of experts (kernels/moe.cu), the CUDA side of `cpu/moe.rs`. Decode (one token): the
//! gate|up kernel picks the top-k experts in its prologue and applies SwiGLU, the down kernel
//! combines the weighted experts and the gated shared expert into the residual. Prefill (T
//! tokens): GPU top-k with per-expert counts, a scan into slot offsets and (expert, 64-token)
//! tiles, a scatter into per-expert slot lists (no host synchronisation), then grouped GEMMs
//! (qmatmul.rs) and the weighted combine.

use super::activations::{Activations, ChunkScratch};
use super::device::{ptr, Arg, Gpu, ARG_STRUCT_WORDS};
use super::ops;
use super::qmatmul::{tc_smem, FewRows, Gemm, Grouped, PendingCombine, TcbStaging, GEMV_THREADS, TCB_WORDS, TC_NG};
use super::weights::{DevMoe, DevQ};
use super::registry::{Kernel, MOE};
use crate::checkpoint::ModelConfig;
use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;

const MOE_GATE_UP: Kernel = Kernel::dependent(&MOE, "moe_gate_up");
const MOE_DOWN: Kernel = Kernel::dependent(&MOE, "moe_down");
const MOE_GATE_UP_TC: Kernel = Kernel::dependent(&MOE, "moe_gate_up_tc");
const MOE_DOWN_TC: Kernel = Kernel::dependent(&MOE, "moe_down_tc");
const MOE_GATE_UP_TC_F: Kernel = Kernel::dependent(&MOE, "moe_gate_up_tc_f");
const MOE_DOWN_TC_F: Kernel = Kernel::dependent(&MOE, "moe_down_tc_f");
const PF_ROUTE: Kernel = Kernel::ordered(&MOE, "pf_route");
const PF_SCAN: Kernel = Kernel::ordered(&MOE, "pf_scan");
const PF_SCATTER: Kernel = Kernel::ordered(&MOE, "pf_scatter");
const PF_MOE_COMBINE: Kernel = Kernel::ordered(&MOE, "pf_moe_combine");
/// The combines over bf16 routed outputs: [the shared expert's outputs f32, bf16].
const PF_MOE_COMBINE_BF16: [Kernel; 2] = [Kernel::ordered(&MOE, "pf_moe_combine_bf16"), Kernel::ordered(&MOE, "pf_moe_combine_bf16_sh16")];
const PF_MOE_COMBINE_NORM_BF16: [Kernel; 2] =
    [Kernel::ordered(&MOE, "pf_moe_combine_norm_bf16"), Kernel::ordered(&MOE, "pf_moe_combine_norm_bf16_sh16")];
const MOE_TCB: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcb");
const MOE_TCP: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcp");
const MOE_TCR: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcr");
const MOE_TCB_F: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcb_f");
const MOE_TCP_F: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcp_f");
const MOE_TCR_F: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcr_f");
const MOE_TCQ_F: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcq_f");
/// `moe_tcr_f` compiled for the 35B's gate|up shapes (512 rows of 2,048 columns per expert).
const MOE_TCR_F_35B: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcr_f_35b");
/// `moe_tcq_f` compiled for the 35B's down shapes (2,048 rows of 512 columns per expert).
const MOE_TCQ_F_35B: Kernel = Kernel::ordered_stamping(&MOE, "moe_tcq_f_35b");
const STAGE_WG: Kernel = Kernel::ordered(&MOE, "stage_wg");
const PF_MOE_WG_GLU: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_glu");
const PF_MOE_WG_GLU_F: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_glu_f");
const PF_MOE_WG_GLU_MC: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_glu_mc");
const PF_MOE_WG_DOWN_RES: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_down_res");
const PF_MOE_WG_DOWN_RES_F: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_down_res_f");
const PF_MOE_WG_GLU_N: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_glu_n");
const PF_MOE_WG_GLU_N_F: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_glu_n_f");
const PF_MOE_WG_DOWN_RES_N: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_down_res_n");
const PF_MOE_WG_DOWN_RES_N_F: Kernel = Kernel::ordered(&MOE, "pf_moe_wg_down_res_n_f");
const MOE_ROUTE_BATCH_1: Kernel = Kernel::dependent(&MOE, "moe_route_batch_1");
const MOE_ROUTE_BATCH_4: Kernel = Kernel::dependent(&MOE, "moe_route_batch_4");
/// The two compiled for [`SHAPED_ROUTE`].
const MOE_ROUTE_BATCH_1_35B: Kernel = Kernel::dependent(&MOE, "moe_route_batch_1_35b");
const MOE_ROUTE_BATCH_4_35B: Kernel = Kernel::dependent(&MOE, "moe_route_batch_4_35b");
/// The routing shapes `moe_route_batch_*_35b` have as constants (the 35B's): hidden size, group,
/// router bits, shared-expert gate bits, experts, top k.
const SHAPED_ROUTE: [usize; 6] = [2048, 64, 8, 8, 256, 8];

#[derive(Clone, Copy, Debug)]
pub struct MoeDims {
    pub e: usize,
    pub k: usize,
    pub inter: usize,
    pub sinter: usize,
    pub hidden: usize,
    pub group: usize,
}

impl MoeDims {
    pub fn new(cfg: &ModelConfig) -> Self {
        MoeDims {
            e: cfg.num_experts,
            k: cfg.num_experts_per_tok,
            inter: cfg.moe_intermediate_size,
            sinter: cfg.shared_expert_intermediate_size,
            hidden: cfg.hidden_size,
            group: cfg.quant.group_size,
        }
    }
}

/// The decode expert kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKernels {
    /// `moe_gate_up_tc` + `moe_down_tc`: tensor cores with f32-exact products.
    TensorCore,
    /// `moe_gate_up` + `moe_down`: CUDA cores, for shapes the tensor-core kernels do not take.
    CudaCore,
}

/// The tensor-core kernels take 4-bit experts with group 64 (the loader only accepts that),
/// widths in whole groups, routed and shared experts of one width, and staged activations within
/// the default 48 KiB of shared memory. `force_cuda_core`: tests.
pub fn select(d: &MoeDims, force_cuda_core: bool) -> MoeKernels {
    // `moe_down_tc`'s block as `experts` launches it: DOWN_TC_SPLIT warps per expert.
    let warps_down = (d.k + 1) * DOWN_TC_SPLIT;
    let tc = d.group == 64
        && d.hidden.is_multiple_of(64)
        && d.inter.is_multiple_of(64)
        && d.inter == d.sinter
        && d.inter / 64 <= TC_NG
        && warps_down <= 32
        && tc_smem((d.k + 1) * d.inter, warps_down) as usize <= 48 * 1024
        && tc_smem(d.hidden, 8) as usize <= 48 * 1024;
    if tc && !force_cuda_core {
        MoeKernels::TensorCore
    } else {
        MoeKernels::CudaCore
    }
}

/// Whether the routed experts' codes go in fragment order (kernels/common.cuh `frag_word`; one
/// coalesced 16-byte load per lane and 64-column group where row order takes two 8-byte loads
/// over 16 rows): when the decode runs the tensor-core expert kernels, every kernel that reads
/// the experts has a fragment-order instance (`*_f`: the decode, batched-decode and staged or
/// wgmma prefill products) or takes either order (`pf_gemm`, the exact mode's). The CUDA-core
/// decode kernels read row order. The shared expert then gets a fragment-order copy for the
/// kernels that run it beside the routed ones; the prefill's dense products read its row order.
pub fn fragment_order_experts(d: &MoeDims, force_cuda_core: bool) -> bool {
    select(d, force_cuda_core) == MoeKernels::TensorCore
}

/// A 4-bit matrix: codes, scales, biases.
pub type QPtrs = (u64, u64, u64);

/// The layer's expert weights and the activations of one decode step.
pub struct MoePtrs {
    /// Router logits (the gate|up prologue picks the top-k from them).
    pub logits: u64,
    pub gate: QPtrs,
    pub up: QPtrs,
    pub down: QPtrs,
    pub sgate: QPtrs,
    pub sup: QPtrs,
    pub sdown: QPtrs,
    pub shared_gate_logit: u64,
    /// Normalised input.
    pub u: u64,
    /// SwiGLU outputs of the k experts and the shared expert.
    pub act: u64,
    pub top_ids: u64,
    pub top_w: u64,
    /// The residual stream the combine adds into.
    pub x: u64,
    /// Every expert matrix's codes above are in fragment order (`*_f` kernels).
    pub frag: bool,
}

fn q(p: QPtrs) -> [Arg; 3] {
    [Arg::P(p.0), Arg::P(p.1), Arg::P(p.2)]
}

/// Arguments of both gate|up kernels: one list, with the kernel's own tuning parameters
/// (`group`, or `slices, kc`) after the input width.
fn gate_up_args(d: &MoeDims, p: &MoePtrs, tuning: &[Arg]) -> Vec<Arg> {
    let mut a = vec![Arg::P(p.logits), Arg::I(d.e as i32), Arg::I(d.k as i32)];
    a.extend(q(p.gate));
    a.extend(q(p.up));
    a.push(Arg::I(d.inter as i32));
    a.extend(q(p.sgate));
    a.extend(q(p.sup));
    a.extend([Arg::I(d.sinter as i32), Arg::P(p.u), Arg::I(d.hidden as i32)]);
    a.extend_from_slice(tuning);
    a.extend([Arg::P(p.act), Arg::P(p.top_ids), Arg::P(p.top_w)]);
    a.extend(q(p.down));
    a.extend(q(p.sdown));
    a.push(Arg::I(d.hidden as i32));
    a
}

/// The down products' weights, the shared expert's gate and the residual stream, after each down
/// kernel's own leading arguments; `tuning` goes before the output.
fn down_tail(d: &MoeDims, p: &MoePtrs, tuning: &[Arg]) -> Vec<Arg> {
    let mut a = q(p.down).to_vec();
    a.extend(q(p.sdown));
    a.extend([Arg::P(p.shared_gate_logit), Arg::I(d.hidden as i32)]);
    a.extend_from_slice(tuning);
    a.push(Arg::P(p.x));
    a
}

/// Warps per expert's down rows in `moe_down_tc`: two give twice the warps in flight.
const DOWN_TC_SPLIT: usize = 2;
/// Warps per block of the CUDA-core kernels.
const CUDA_CORE_WARPS: usize = 8;

/// Routed + shared experts of one token, added into the residual.
pub fn experts(gpu: &Gpu, d: &MoeDims, p: &MoePtrs, kernels: MoeKernels) -> Result<()> {
    if p.frag && kernels != MoeKernels::TensorCore {
        bail!("the CUDA-core expert kernels read row-order codes, the experts are in fragment order");
    }
    let (gate_up, down) = if p.frag { (MOE_GATE_UP_TC_F, MOE_DOWN_TC_F) } else { (MOE_GATE_UP_TC, MOE_DOWN_TC) };
    match kernels {
        MoeKernels::TensorCore => {
            let chunks = (d.hidden / 64).div_ceil(TC_NG);
            let slices = [4usize, 2, 1].into_iter().find(|s| chunks.is_multiple_of(*s)).unwrap_or(1);
            let warps = 2 * slices;
            let grid = (d.inter.max(d.sinter).div_ceil(16) as u32, (d.k + 1) as u32, 1);
            let tuning = [Arg::I(slices as i32), Arg::I((chunks / slices) as i32)];
            gpu.launch(gate_up, grid, (warps * 32) as u32, tc_smem(d.hidden, warps), &gate_up_args(d, p, &tuning))?;
            let warps = (d.k + 1) * DOWN_TC_SPLIT;
            // The router's logits (the block routes the token itself, before its wait), then the
            // SwiGLU outputs.
            let head = [Arg::P(p.logits), Arg::I(d.e as i32), Arg::P(p.act), Arg::I(d.k as i32), Arg::I(d.inter as i32), Arg::I(DOWN_TC_SPLIT as i32)];
            let args = [&head[..], &down_tail(d, p, &[])].concat();
            gpu.launch(down, (d.hidden.div_ceil(16) as u32, 1, 1), (warps * 32) as u32, tc_smem((d.k + 1) * d.inter, warps), &args)
        }
        MoeKernels::CudaCore => {
            let warps = CUDA_CORE_WARPS;
            let rows = d.inter.max(d.sinter);
            let smem = ((d.hidden + d.hidden / d.group + 33) * 4) as u32;
            let grid = (rows.div_ceil(2 * warps) as u32, (d.k + 1) as u32, 1);
            gpu.launch(MOE_GATE_UP, grid, (warps * 32) as u32, smem, &gate_up_args(d, p, &[Arg::I(d.group as i32)]))?;
            let n_act = d.k * d.inter + d.sinter;
            let smem = ((n_act + n_act / d.group + 33) * 4) as u32;
            let head = [Arg::P(p.act), Arg::P(p.top_ids), Arg::P(p.top_w), Arg::I(d.k as i32), Arg::I(d.inter as i32), Arg::I(d.sinter as i32)];
            let args = [&head[..], &down_tail(d, p, &[Arg::I(d.group as i32)])].concat();
            gpu.launch(MOE_DOWN, (d.hidden.div_ceil(warps) as u32, 1, 1), (warps * 32) as u32, smem, &args)
        }
    }
}

/// Slots per tile of the grouped GEMMs' lists (TC_BN in kernels/common.cuh).
pub const GEMM_TILE: usize = 64;

/// Upper bound on the (expert, `tile`-slot) tiles of `n` tokens' routing: every tile holds at
/// least one of the n * k slots, all but one per expert hold `tile`.
pub fn tiles_of(n: usize, d: &MoeDims, tile: usize) -> usize {
    ((n * d.k).div_ceil(tile) + d.e).min(n * d.k)
}

/// Upper bound on the (expert, 64-token) tiles of a grouped GEMM over `n` tokens.
pub fn max_tiles(n: usize, d: &MoeDims) -> usize {
    tiles_of(n, d, GEMM_TILE)
}

/// How a prefill chunk runs its routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillExperts {
    /// `moe_tcb`: passes of 16 slots over 16-slot tiles (chunks of at most `tcb_tokens` tokens).
    Tcb,
    /// `stage_wg` + `pf_moe_wg_glu` / `_down`: wgmma over [`WG_TILE`]-slot tiles (longer chunks).
    Wg,
    /// The same on the narrow kernels (`pf_moe_wg_glu_n` / `_down_res_n`): [`WG_NARROW_TILE`]-slot
    /// tiles, two CTAs per SM (chunks of a few dozen slots per expert).
    WgNarrow,
    /// The grouped GEMMs: `pf_gemm` in the exact f32 mode, `pf_gemm_tc` for matrices the staged
    /// kernels do not take.
    Gemm,
}

impl PrefillExperts {
    /// Slots per tile of the routing lists this route's kernels walk.
    pub fn tile(self) -> usize {
        match self {
            PrefillExperts::Tcb => BATCH_TILE,
            PrefillExperts::Wg => WG_TILE,
            PrefillExperts::WgNarrow => WG_NARROW_TILE,
            PrefillExperts::Gemm => GEMM_TILE,
        }
    }

    /// Whether the route runs the wgmma kernels (bf16 down outputs).
    pub fn wgmma(self) -> bool {
        matches!(self, PrefillExperts::Wg | PrefillExperts::WgNarrow)
    }
}

/// Whether the staged expert kernels take the layer: 4-bit experts of whole 64-column groups (and
/// 64-row groups of intermediate outputs, the wgmma down product's columns, at most
/// [`WG_RES_COLS`] of them), the shared expert as wide as a routed one.
pub fn staged_experts_fit(m: &DevMoe, d: &MoeDims) -> bool {
    let q4 = |q: &DevQ| q.bits == 4 && q.cols.is_multiple_of(64);
    let mats = [&m.gate_exps, &m.up_exps, &m.down_exps, &m.shared_gate, &m.shared_up, &m.shared_down];
    d.group == 64 && d.sinter == d.inter && d.inter.is_multiple_of(64) && d.inter <= WG_RES_COLS && mats.iter().all(|q| q4(q))
}

/// The route of a prefill chunk of `n` tokens: in the bf16 mode, the staged kernels where they
/// fit (`moe_tcb` up to `tcb_tokens` tokens, see [`TCB_PREFILL_TOKENS`]; the narrow wgmma kernels
/// up to `narrow_tokens`, see [`WG_NARROW_TOKENS`]), else the grouped GEMMs.
pub fn prefill_experts(n: usize, exact: bool, tcb_tokens: usize, narrow_tokens: usize, staged_fit: bool) -> PrefillExperts {
    if exact || !staged_fit {
        PrefillExperts::Gemm
    } else if n <= tcb_tokens {
        PrefillExperts::Tcb
    } else if n <= narrow_tokens {
        PrefillExperts::WgNarrow
    } else {
        PrefillExperts::Wg
    }
}

/// Most prefill tokens whose routed experts run as `moe_tcb` passes (16 slots per pass); longer
/// chunks take the wgmma kernels. Measured on one H200 (docs/cuda-prefill.md): `moe_tcb` 3% faster
/// at 512 tokens (~16 slots per expert), the wgmma kernels 1% faster at 700 and 13% at 1,024.
pub const TCB_PREFILL_TOKENS: usize = 640;

/// Most prefill tokens whose routed experts run on the narrow wgmma kernels (tiles of
/// [`WG_NARROW_TILE`] slots): at the 35B's 8 of 256 experts, 768 tokens are 24 slots per expert
/// on average, and a tile per expert with few split in two.
pub const WG_NARROW_TOKENS: usize = 768;

/// Routing scratch of a prefill chunk.
pub struct RouteLists {
    /// Router logits `[T][E]`.
    pub logits: u64,
    /// Top-k expert ids and weights per token `[T][k]`.
    pub top_ids: u64,
    pub top_w: u64,
    /// Per expert: token count (zeroed before `route`), first slot, fill cursor.
    pub counts: u64,
    pub offsets: u64,
    pub fill: u64,
    /// Slots grouped by expert.
    pub list: u64,
    /// `[count, (expert, first slot)...]` for the tensor-core grouped GEMM.
    pub tiles: u64,
}

impl RouteLists {
    /// The routing lists of a multi-token pass: router logits and top-k in its activations, the
    /// lists in its scratch.
    pub fn over(gpu: &Gpu, a: &Activations, s: &ChunkScratch) -> Self {
        let p = |x: &CudaSlice<i32>| ptr(x, &gpu.stream);
        RouteLists {
            logits: ptr(&a.router, &gpu.stream),
            top_ids: p(&a.top_ids),
            top_w: ptr(&a.top_w, &gpu.stream),
            counts: p(&s.counts),
            offsets: p(&s.offsets),
            fill: p(&s.fill),
            list: p(&s.list),
            tiles: p(&s.tiles),
        }
    }

    /// The per-expert lists of `n` tokens as a grouped product reads them (`xdiv`: k for the
    /// gate|up products, whose input rows are tokens; 1 for down, whose input rows are slots).
    pub fn grouped(&self, d: &MoeDims, n: usize, xdiv: usize) -> Grouped {
        Grouped { experts: d.e, counts: self.counts, offsets: self.offsets, list: self.list, xdiv, tiles: self.tiles, max_tiles: max_tiles(n, d) }
    }
}

/// The f32 router and shared-expert gate logits of `n` normalised rows (`a.u`), then the routing:
/// top-k per token and the per-expert slot lists and tiles (a multi-token pass).
#[allow(clippy::too_many_arguments)]
pub fn gate_and_route(gpu: &Gpu, gemm: &Gemm, m: &DevMoe, d: &MoeDims, a: &Activations, s: &ChunkScratch, n: usize, tile: usize) -> Result<RouteLists> {
    let (u, p) = (ptr(&a.u, &gpu.stream), |x: &CudaSlice<f32>| ptr(x, &gpu.stream));
    let router = FewRows { q: &m.router, rows: d.e, y: p(&a.router), ldy: d.e };
    let gate = FewRows { q: &m.shared_expert_gate, rows: 1, y: p(&a.sgl), ldy: 1 };
    gemm.few_rows(&[router, gate], u, n)?;
    let r = RouteLists::over(gpu, a, s);
    route(gpu, d, &r, n)?;
    slot_lists(gpu, d.e, &r, n * d.k, tile)?;
    Ok(r)
}

/// Top-k ids and weights per token (counted per expert by [`slot_lists`]).
pub fn route(gpu: &Gpu, d: &MoeDims, r: &RouteLists, n: usize) -> Result<()> {
    let args = [Arg::P(r.logits), Arg::I(n as i32), Arg::I(d.e as i32), Arg::I(d.k as i32), Arg::P(r.top_ids), Arg::P(r.top_w)];
    gpu.launch(PF_ROUTE, (n.div_ceil(4) as u32, 1, 1), 128, 0, &args)
}

/// `pf_scatter`'s block, the slots each block lists and the experts its shared-memory counters
/// hold (SCATTER_THREADS, SCATTER_SLOTS, SCATTER_MAX_EXPERTS in kernels/moe.cu).
const SCATTER_THREADS: u32 = 1024;
const SCATTER_SLOTS: usize = 4 * SCATTER_THREADS as usize;
const SCATTER_MAX_EXPERTS: usize = 512;

/// The per-expert counts of `slots` top-k slots, their offsets and tiles of `tile` slots, then
/// the per-expert slot lists.
pub fn slot_lists(gpu: &Gpu, experts: usize, r: &RouteLists, slots: usize, tile: usize) -> Result<()> {
    if experts > SCATTER_MAX_EXPERTS {
        bail!("the prefill slot lists take at most {SCATTER_MAX_EXPERTS} experts, not {experts}");
    }
    let args = [Arg::P(r.top_ids), Arg::I(slots as i32), Arg::P(r.counts), Arg::I(experts as i32), Arg::P(r.offsets), Arg::P(r.fill), Arg::P(r.tiles), Arg::I(tile as i32)];
    gpu.launch(PF_SCAN, (1, 1, 1), 512, 0, &args)?;
    let args = [Arg::P(r.top_ids), Arg::I(slots as i32), Arg::P(r.offsets), Arg::P(r.fill), Arg::P(r.list), Arg::I(experts as i32)];
    gpu.launch(PF_SCATTER, (slots.div_ceil(SCATTER_SLOTS) as u32, 1, 1), SCATTER_THREADS, 0, &args)
}

/// `x[t] += sum_k w[t,k] * down[t*k + j] + sigmoid(sgl[t]) * shared[t]` over `n` rows.
pub fn combine(gpu: &Gpu, d: &MoeDims, out: &PendingCombine, x: u64, n: usize) -> Result<()> {
    if out.shared_bf16 {
        bail!("the f32 combine takes the shared expert's outputs in f32");
    }
    gpu.launch(PF_MOE_COMBINE, (d.hidden.div_ceil(256) as u32, n as u32, 1), 256, 0, &combine_args(d, out, x))
}

/// The combine kernels' arguments (`pf_moe_combine`, `pf_moe_combine_bf16`).
fn combine_args(d: &MoeDims, out: &PendingCombine, x: u64) -> Vec<Arg> {
    [&combine_head(out, x)[..], &[Arg::I(d.hidden as i32)]].concat()
}

/// The leading arguments of every combine kernel: the routed outputs, their weights and count,
/// the shared expert's output and gate logit, the residual stream they are added into.
fn combine_head(out: &PendingCombine, x: u64) -> [Arg; 6] {
    [Arg::P(out.down), Arg::P(out.top_w), Arg::I(out.k as i32), Arg::P(out.shared), Arg::P(out.sgl), Arg::P(x)]
}

/// [`combine`] over routed outputs in bf16 (`out.down`, as [`moe_wg_down`] writes them).
pub fn combine_bf16_down(gpu: &Gpu, d: &MoeDims, out: &PendingCombine, x: u64, n: usize) -> Result<()> {
    if !d.hidden.is_multiple_of(2) {
        bail!("the bf16 combine takes an even hidden size, not {}", d.hidden);
    }
    gpu.launch(PF_MOE_COMBINE_BF16[out.shared_bf16 as usize], (d.hidden.div_ceil(512) as u32, n as u32, 1), 256, 0, &combine_args(d, out, x))
}

/// The longest row [`combine_norm_bf16`] takes: what one norm block keeps in registers.
const COMBINE_NORM_MAX: usize = ops::NORM_THREADS as usize * 4 * ops::NORM_V;

/// Whether [`combine_norm_bf16`] takes rows of `hidden` values (one block's registers hold a row).
pub fn combine_norm_fits(hidden: usize) -> bool {
    hidden.is_multiple_of(4) && hidden <= COMBINE_NORM_MAX
}

/// [`combine_bf16_down`] fused with the next layer's input norm over `n` rows: `x += ...`, then
/// `u = RMSNorm(x) * gain` and, with `staged`, its bf16 copy there (`ops::rms_norm`'s): the
/// values of the separate launches, one launch and one read of `x` fewer.
#[allow(clippy::too_many_arguments)]
pub fn combine_norm_bf16(gpu: &Gpu, d: &MoeDims, out: &PendingCombine, x: u64, gain: u64, u: u64, staged: Option<u64>, n: usize, eps: f32) -> Result<()> {
    if !combine_norm_fits(d.hidden) {
        bail!("the fused combine and norm take rows of whole float4s of at most {COMBINE_NORM_MAX} values, not {}", d.hidden);
    }
    let norm = [Arg::P(gain), Arg::P(u), Arg::P(staged.unwrap_or(0)), Arg::I(n as i32), Arg::I(d.hidden as i32), Arg::F(eps)];
    let args = [&combine_head(out, x)[..], &norm].concat();
    gpu.launch(PF_MOE_COMBINE_NORM_BF16[out.shared_bf16 as usize], (n as u32, 1, 1), ops::NORM_THREADS, 0, &args)
}

/// `moe_route_batch`'s shape: tokens and threads per block (kernels/moe.cu); its router rows per
/// block are `route_rows_per_block`.
const RB_TOK: usize = 16;
const RB_THREADS: usize = 256;

/// `moe_route_batch`'s `done` words: RB_DONE counters (finished groups, then finished blocks per
/// RB_TOK-token group: 1 + MAX_BATCH / RB_TOK of them), then the groups' summed counts (E < 2 *
/// RB_THREADS experts). Zeroed when allocated; the kernel leaves them zeroed.
const ROUTE_DONE_WORDS: usize = 16;
pub const ROUTE_DONE_LEN: usize = ROUTE_DONE_WORDS + 2 * RB_THREADS;
const _: () = assert!(super::batch::MAX_BATCH.div_ceil(RB_TOK) < ROUTE_DONE_WORDS);

/// Whether the batched decode's MoE kernels take this model: 4- or 8-bit router and gate rows in
/// groups of a multiple of 8 columns, E + 1 <= 2 * RB_THREADS experts (the shared one counts),
/// k <= 16, and a 4-bit shared expert of the routed experts' width (it runs as one more expert).
pub fn batch_supported(m: &DevMoe, d: &MoeDims, group: usize) -> bool {
    let bits_ok = |q: &DevQ| q.bits == 4 || q.bits == 8;
    let shared_ok = d.sinter == d.inter && [&m.shared_gate, &m.shared_up, &m.shared_down].iter().all(|q| q.bits == 4);
    bits_ok(&m.router) && bits_ok(&m.shared_expert_gate) && group.is_multiple_of(8) && d.hidden.is_multiple_of(group) && d.e < 2 * RB_THREADS && d.k <= 16 && shared_ok
}

/// Slots per tile of a batched decode step (TCB_TOK: one `moe_tcb` pass).
pub const BATCH_TILE: usize = 16;

/// Upper bound on the tiles of a batched decode step over `n` tokens: every routed expert's tile
/// holds at least one of the n * k slots, all but one per expert hold BATCH_TILE; the shared
/// expert adds its tokens' tiles.
pub fn batch_max_tiles(n: usize, d: &MoeDims) -> usize {
    ((n * d.k).div_ceil(BATCH_TILE) + d.e).min(n * d.k) + n.div_ceil(BATCH_TILE)
}

/// The routing of a batched decode step over `n` normalised rows `u` in one launch: router and
/// shared-expert gate logits (f32) into `logits` / `sgl`, top-k into `r`'s ids and weights, and
/// its per-expert counts, offsets, slot lists and tiles, the shared expert as expert E over slots
/// n * k + t (`done`: [`ROUTE_DONE_LEN`] zeroed words the kernel leaves zeroed).
#[allow(clippy::too_many_arguments)]
pub fn route_batch(gpu: &Gpu, router: &DevQ, gate: &DevQ, d: &MoeDims, group: usize, u: u64, n: usize, sgl: u64, r: &RouteLists, done: u64) -> Result<()> {
    route_batch_on(gpu, router, gate, d, group, u, n, sgl, r, done, route_shaped(router.bits, gate.bits, d, group))
}

/// Whether the routing shapes (the router's and gate's bits, `d`, the group size) are the ones
/// `moe_route_batch_*_35b` are compiled for.
fn route_shaped(router_bits: usize, gate_bits: usize, d: &MoeDims, group: usize) -> bool {
    [d.hidden, group, router_bits, gate_bits, d.e, d.k] == SHAPED_ROUTE
}

/// [`route_batch`] on the general kernels or (`shaped`) on the ones compiled for the 35B's
/// routing shapes, which these must then be: the two side by side in tests.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_batch_on(gpu: &Gpu, router: &DevQ, gate: &DevQ, d: &MoeDims, group: usize, u: u64, n: usize, sgl: u64, r: &RouteLists, done: u64, shaped: bool) -> Result<()> {
    if shaped && !route_shaped(router.bits, gate.bits, d, group) {
        bail!("moe_route_batch_*_35b are compiled for routing shapes {SHAPED_ROUTE:?}, not these");
    }
    let ((rw, rs, rb), (gw, gs, gb)) = (router.ptrs(gpu), gate.ptrs(gpu));
    let args = [
        Arg::P(u),
        Arg::I(n as i32),
        Arg::I(d.hidden as i32),
        Arg::I(group as i32),
        Arg::P(rw),
        Arg::P(rs),
        Arg::P(rb),
        Arg::I(router.bits as i32),
        Arg::P(gw),
        Arg::P(gs),
        Arg::P(gb),
        Arg::I(gate.bits as i32),
        Arg::I(d.e as i32),
        Arg::I(d.k as i32),
        Arg::P(r.logits),
        Arg::P(sgl),
        Arg::P(r.top_ids),
        Arg::P(r.top_w),
        Arg::P(r.counts),
        Arg::P(r.offsets),
        Arg::P(r.fill),
        Arg::P(r.list),
        Arg::P(r.tiles),
        Arg::I(1),
        Arg::P(done),
    ];
    let rows = route_rows_per_block(n);
    let kernel = route_kernel(rows, shaped);
    let grid = ((d.e + 1).div_ceil(rows) as u32, n.div_ceil(RB_TOK) as u32, 1);
    gpu.launch(kernel, grid, RB_THREADS as u32, route_batch_smem(d, n, rows) as u32, &args)
}

/// The routing kernel of `rows` router rows per block, general or shaped.
fn route_kernel(rows: usize, shaped: bool) -> Kernel {
    match (rows, shaped) {
        (1, false) => MOE_ROUTE_BATCH_1,
        (_, false) => MOE_ROUTE_BATCH_4,
        (1, true) => MOE_ROUTE_BATCH_1_35B,
        (_, true) => MOE_ROUTE_BATCH_4_35B,
    }
}

/// Router rows per `moe_route_batch` block for a step of `n` tokens: one while a single token
/// block holds them all (the router then spreads over E + 1 blocks instead of a quarter of that:
/// +2.4% aggregate decode at B = 16 on an H200, 2026-12-01), four for more tokens (one row per
/// block lost 1.4% at B = 64, where the token blocks already fill the GPU).
fn route_rows_per_block(n: usize) -> usize {
    if n <= RB_TOK {
        1
    } else {
        4
    }
}

/// `moe_route_batch`'s dynamic shared memory: the block sums, then the last block's routing
/// scratch (its group's logits; counts and offsets; every slot's id; per warp two tokens' ids
/// and weights).
fn route_batch_smem(d: &MoeDims, n: usize, rows: usize) -> usize {
    let warps = RB_THREADS / 32;
    let sums = warps * rows * RB_TOK;
    let routing = RB_TOK.min(n) * d.e + 2 * d.e + n * d.k + 4 * warps * d.k;
    4 * sums.max(routing)
}

/// Codes, scales and biases of `q`, then of `up` (zeros without it): the leading arguments of the
/// staged expert kernels; the codes in fragment order (`frag`: the caller checked that they have
/// it) or row order. `Stage` order: the scales and biases as their one stage-order array (the
/// caller checked that they have it), no biases.
fn matrix_pair_args(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, order: CodeOrder) -> [Arg; 6] {
    let ptrs = |m: &DevQ| match order {
        CodeOrder::Row => m.ptrs(gpu),
        CodeOrder::Fragment => m.frag_ptrs(gpu).expect("checked by the caller"),
        CodeOrder::Stage => {
            let (w, _, _) = m.frag_ptrs(gpu).expect("checked by the caller");
            (w, ptr(m.stage_sb.as_ref().expect("checked by the caller"), &gpu.stream), 0)
        }
    };
    let (w, s, b) = ptrs(q);
    let (w2, s2, b2) = up.map(ptrs).unwrap_or((0, 0, 0));
    [Arg::P(w), Arg::P(s), Arg::P(b), Arg::P(w2), Arg::P(s2), Arg::P(b2)]
}

/// How the staged expert kernels read a matrix: row-order codes; fragment-order codes; or
/// fragment-order codes with the scales and biases in stage order (`moe_tcr_f`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum CodeOrder {
    Row,
    Fragment,
    Stage,
}

impl CodeOrder {
    fn of(frag: bool) -> Self {
        if frag {
            CodeOrder::Fragment
        } else {
            CodeOrder::Row
        }
    }
}

/// Rows of an expert per `moe_tcb` block (8 warps of 16-row tiles).
const MOE_TCB_ROWS: usize = 128;

/// The shared expert as one more expert of `moe_tcb`: expert number `expert`, whose slots from
/// `base` on (`None`: none) read token `slot - base`.
pub struct SharedExpert<'a> {
    pub q: &'a DevQ,
    pub up: Option<&'a DevQ>,
    pub expert: usize,
    pub base: Option<usize>,
}

/// `moe_tcb` (batched decode): per slot of the lists, `y[slot] = W_e · x[slot / xdiv]`, or with
/// `up` `y[slot] = silu(W_e · x) * (Up_e · x)`, x staged in `st`; the shared expert's slots with
/// its own matrices (4-bit, group 64).
#[allow(clippy::too_many_arguments)]
pub fn moe_tcb(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, shared: &SharedExpert, rows: usize, st: &TcbStaging, y: u64, g: Grouped) -> Result<()> {
    let (args, smem, frag) = tcb_args(gpu, q, up, shared, rows, st, y, &g, Some(MOE_TCB_ROWS), false)?;
    gpu.launch(if frag { MOE_TCB_F } else { MOE_TCB }, (rows.div_ceil(MOE_TCB_ROWS) as u32, g.max_tiles as u32, 1), GEMV_THREADS, smem, &args)
}

/// `moe_tcp`: the products of [`moe_tcb`] on one wave of persistent blocks, each taking a
/// contiguous run of the lists' (tile, 16-row) items and staging each tile it meets once
/// (bit-identical results). The down products of the batched decode and of short prefill
/// chunks: there each warp's share of a 128-row moe_tcb block is one 512-column item, so the
/// block's staging was most of its time. Over fragment-order codes of whole ring stages and
/// without a second matrix the blocks stream each warp's weights through a ring that runs on
/// across its items (`moe_tcq_f`, the same products).
#[allow(clippy::too_many_arguments)]
pub fn moe_tcp(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, shared: &SharedExpert, rows: usize, st: &TcbStaging, y: u64, g: Grouped) -> Result<()> {
    let (args, smem, frag) = tcb_args(gpu, q, up, shared, rows, st, y, &g, None, false)?;
    let ring = frag && up.is_none() && q.cols.is_multiple_of(64 * TCR_GROUPS);
    let (k, smem) = match (frag, ring) {
        (true, true) => (tcq_kernel(rows, q.cols), tcr_smem(q.cols)),
        (true, false) => (MOE_TCP_F, smem),
        _ => (MOE_TCP, smem),
    };
    let per_sm = super::qmatmul::blocks_per_sm(gpu, k, smem, 2)?;
    let blocks = tcp_blocks(g.max_tiles * rows.div_ceil(16), gpu.sms as usize * per_sm);
    gpu.launch(k, (blocks as u32, 1, 1), GEMV_THREADS, smem, &args)
}

/// The down ring kernel for experts of `rows` x `cols`: the instance with the 35B's shapes as
/// constants where they are those (the same products), else the general one.
fn tcq_kernel(rows: usize, cols: usize) -> Kernel {
    if (rows, cols) == (2048, 512) {
        MOE_TCQ_F_35B
    } else {
        MOE_TCQ_F
    }
}

/// `moe_tcr`'s ring: stages of `TCR_GROUPS` 64-column groups, `TCR_DEPTH` per warp, each 16 rows
/// of codes padded to `TCR_ROW_BYTES` plus their scales and biases (kernels/moe.cu).
pub(super) const TCR_GROUPS: usize = 2;
const TCR_DEPTH: usize = 4;
const TCR_ROW_BYTES: usize = TCR_GROUPS * 32 + 16;
pub(super) const TCR_STAGE_BYTES: usize = 16 * TCR_ROW_BYTES + 16 * TCR_GROUPS * 4;

/// Whether `moe_tcr` takes matrices of `cols` columns (whole stages) and two of its blocks fit an
/// SM beside their staged tokens (what its speed relies on).
pub fn tcr_fits(gpu: &Gpu, cols: usize) -> Result<bool> {
    if !cols.is_multiple_of(64 * TCR_GROUPS) {
        return Ok(false);
    }
    Ok(super::qmatmul::blocks_per_sm(gpu, MOE_TCR, tcr_smem(cols), 1)? >= 2)
}

/// `moe_tcr`'s dynamic shared memory: `moe_tcb`'s and every warp's ring.
fn tcr_smem(cols: usize) -> u32 {
    tcb_smem(cols) + ((GEMV_THREADS as usize / 32) * TCR_DEPTH * TCR_STAGE_BYTES) as u32
}

/// The staged expert kernels' dynamic shared memory: 16 tokens' fragments and group sums over
/// `cols` columns.
fn tcb_smem(cols: usize) -> u32 {
    let gpr = cols / 64;
    ((2 * gpr * TCB_WORDS + 16 * gpr) * 4) as u32
}

/// `moe_tcr`: the products of [`moe_tcb`] with each warp's weights streamed through a ring of
/// stages in shared memory (bit-identical results): its loads stay in flight while it multiplies,
/// where a `moe_tcb` warp waits on every 512-column item. The caller checks [`tcr_fits`]. With
/// `staged_out` the outputs are not stored in `y` but staged there as [`super::qmatmul::stage_tcb`]
/// would stage `y`'s rows (the same words and group sums): the down products' input without a
/// staging launch (`rows` a multiple of 64; `staged_out` holds a row for every slot of the lists).
/// Over fragment-order codes the matrices need their stage-order scales ([`DevQ::stage_sb`]).
#[allow(clippy::too_many_arguments)]
pub fn moe_tcr(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, shared: &SharedExpert, rows: usize, st: &TcbStaging, y: u64, g: Grouped, staged_out: Option<&TcbStaging>) -> Result<()> {
    let (mut args, _, frag) = tcb_args(gpu, q, up, shared, rows, st, y, &g, None, true)?;
    let (sfrag, sgsum) = match staged_out {
        None => (0, 0),
        Some(o) if rows.is_multiple_of(64) && o.cols >= rows => (ptr(&o.frag, &gpu.stream), ptr(&o.gsum, &gpu.stream)),
        Some(o) => bail!("moe_tcr cannot stage {rows}-column outputs into {}-column rows", o.cols),
    };
    args.extend([Arg::P(sfrag), Arg::P(sgsum)]);
    gpu.launch(tcr_kernel(frag, rows, q.cols), (rows.div_ceil(MOE_TCB_ROWS) as u32, g.max_tiles as u32, 1), GEMV_THREADS, tcr_smem(q.cols), &args)
}

/// The ring kernel for expert matrices of `rows` x `cols` (`frag`: codes in fragment order): over
/// fragment-order codes, the instance with the 35B's gate|up shapes as constants where they are
/// those (the same products), else the general one.
fn tcr_kernel(frag: bool, rows: usize, cols: usize) -> Kernel {
    match (frag, (rows, cols) == (512, 2048)) {
        (true, true) => MOE_TCR_F_35B,
        (true, false) => MOE_TCR_F,
        (false, _) => MOE_TCR,
    }
}

/// `moe_tcp`'s grid: one wave of blocks, but no more than give each block's warps one of the
/// `max_items` (tile, 16-row) items the lists can hold apiece, so at a batch of one (9 tiles)
/// the blocks split the work as moe_tcb's do.
fn tcp_blocks(max_items: usize, wave: usize) -> usize {
    max_items.div_ceil((GEMV_THREADS / 32) as usize).clamp(1, wave.max(1))
}

/// The arguments (`rows_per_block`: moe_tcb's, none for moe_tcp) and dynamic shared memory of
/// the staged expert kernels, after checking the matrices; `stage_scales`: over fragment-order
/// codes the kernel reads the scales and biases in stage order (`moe_tcr_f`).
#[allow(clippy::too_many_arguments)]
fn tcb_args(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, shared: &SharedExpert, rows: usize, st: &TcbStaging, y: u64, g: &Grouped, rows_per_block: Option<usize>, stage_scales: bool) -> Result<(Vec<Arg>, u32, bool)> {
    let same = |a: &DevQ| a.bits == 4 && a.cols == q.cols;
    if !same(q) || !up.is_none_or(same) || !same(shared.q) || shared.up.is_some() != up.is_some() || !shared.up.is_none_or(same) || !q.cols.is_multiple_of(64) {
        bail!("the batched expert kernel takes 4-bit matrices of whole 64-column groups, the shared expert's like the routed ones'");
    }
    let smem = tcb_smem(q.cols);
    let base = shared.base.map_or(i32::MAX, |b| b.min(i32::MAX as usize) as i32);
    let stream = &gpu.stream;
    // Fragment order (the `*_f` instances) when the routed experts are in it; the shared expert's
    // matrices then come as their fragment-order copy.
    let frag = q.frag;
    let mats = [Some(q), up, Some(shared.q), shared.up];
    if mats.iter().flatten().any(|m| if frag { m.frag_ptrs(gpu).is_none() } else { m.frag }) {
        bail!("the batched expert kernel takes the routed and shared experts' codes in one order");
    }
    let order = if frag && stage_scales { CodeOrder::Stage } else { CodeOrder::of(frag) };
    if order == CodeOrder::Stage {
        if mats.iter().flatten().any(|m| m.stage_sb.is_none()) {
            bail!("moe_tcr over fragment-order codes needs stage-order scales");
        }
        if !rows.is_multiple_of(16) {
            bail!("moe_tcr over fragment-order codes takes experts of whole 16-row tiles, not {rows} rows");
        }
    }
    let mut args = matrix_pair_args(gpu, q, up, order).to_vec();
    args.extend(matrix_pair_args(gpu, shared.q, shared.up, order));
    args.extend([Arg::I(shared.expert as i32), Arg::I(base), Arg::P(y), Arg::I(rows as i32), Arg::I(q.cols as i32)]);
    args.extend(rows_per_block.map(|r| Arg::I(r as i32)));
    args.extend([
        Arg::P(ptr(&st.frag, stream)),
        Arg::P(ptr(&st.gsum, stream)),
        Arg::I(g.xdiv as i32),
        Arg::P(g.counts),
        Arg::P(g.offsets),
        Arg::P(g.list),
        Arg::P(g.tiles),
    ]);
    Ok((args, smem, frag))
}

/// The wgmma expert kernels (`pf_moe_wg_glu`, `pf_moe_wg_down_res`; WG_* in kernels/moe.cu): tiles
/// of the lists' [`WG_TILE`] slots, four warpgroups per block, 128 gate|up or 256 down rows (256 A
/// rows). Gate|up: `WG_STAGES` stages of one 64-column group's slot inputs and codes of the
/// block's rows, and two buffers of 8 groups' scales and biases in shared memory (the 35B's
/// shapes: [`wgm_smem`]; down: [`wg_res_smem`]).
const WG_THREADS: u32 = 512;
const WG_GLU_ROWS: usize = 128;
const WG_DOWN_ROWS: usize = 256;
const WG_STAGES: usize = 4;
const WG_AROWS: usize = 256;
/// Gate|up's dynamic shared memory over tiles of `tile` slots.
const fn wg_smem(tile: usize) -> u32 {
    (WG_STAGES * (tile * 128 + WG_AROWS * 32) + 2 * WG_AROWS * 2 * 16 + 2 * tile * 4) as u32
}

/// `pf_moe_wg_glu_mc`'s stages, the slots each holds (an expert's last tile takes up to 32 past
/// [`WG_TILE`]) and their bytes (WGM_STAGES, WGM_N, WGM_STAGE in kernels/moe.cu).
const WGM_STAGES: usize = 6;
const WGM_N: usize = WG_TILE + 32;
const WGM_STAGE: usize = WGM_N * 128 + WG_AROWS * 32;
/// `pf_moe_wg_glu_mc`'s dynamic shared memory over rows of `cols` columns: 1,024 bytes of room
/// to align the stages (the swizzle's atoms), the stages, every group's scales and biases of the
/// block's 128 gate and 128 up rows (rows padded by 16 bytes), the stages' two barriers and the
/// tile's slot and input-row indices.
const fn wgm_smem(cols: usize) -> u32 {
    (1024 + WGM_STAGES * WGM_STAGE + 4 * 128 * (2 * (cols / 64) + 16) + 16 * WGM_STAGES + 2 * WGM_N * 4) as u32
}

/// Whether gate|up over `cols` columns takes `pf_moe_wg_glu_mc` (codes in fragment order, wide
/// tiles): every group's scales stay in shared memory beside the stages, so they must fit.
fn wgm_takes(cols: usize, frag: bool, narrow: bool) -> bool {
    frag && !narrow && cols.is_multiple_of(512) && wgm_smem(cols) <= crate::backend::cuda::registry::SMEM_OPTIN_LIMIT
}

/// The clusters `pf_moe_wg_glu_mc` runs in over `row_blocks` blocks of an expert's rows: pairs
/// where they tile them, else single blocks (a cluster shares one copy of the tile's inputs; the
/// kernel takes clusters of four too, which measured slower than pairs at the 35B:
/// docs/cuda-prefill.md).
fn wgm_cluster(row_blocks: usize) -> u32 {
    [2, 1].into_iter().find(|c| row_blocks.is_multiple_of(*c as usize)).unwrap_or(1)
}

/// The tensor map `pf_moe_wg_glu_mc` reads its inputs through: `x` as a bf16 tensor of `x_rows`
/// rows of `cols`, one 64-column group of one row per copy, in the 128-byte swizzle its wgmmas'
/// B descriptors read.
fn wg_input_map(x: u64, x_rows: usize, cols: usize) -> Result<Arg> {
    use cudarc::driver::sys;
    let dims = [cols as u64, x_rows.max(1) as u64];
    let strides = [(cols * 2) as u64];
    let boxes = [64u32, 1];
    let elem = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: the arrays outlive the call and hold `rank` (2) entries (strides rank - 1); the
    // driver writes the map into `map`.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            x as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("cuTensorMapEncodeTiled for the wgmma gate|up's inputs ({x_rows} x {cols}): {r:?}");
    }
    // SAFETY: written by the successful call above.
    let map = unsafe { map.assume_init() };
    const { assert!(std::mem::size_of::<sys::CUtensorMap>() <= ARG_STRUCT_WORDS * 8) };
    let mut words = Box::new([0u64; ARG_STRUCT_WORDS]);
    // SAFETY: CUtensorMap is 128 bytes of plain data, fewer than the words' 512.
    unsafe {
        std::ptr::copy_nonoverlapping(&map as *const sys::CUtensorMap as *const u8, words.as_mut_ptr() as *mut u8, std::mem::size_of::<sys::CUtensorMap>())
    };
    Ok(Arg::S(words))
}

/// Slots per tile of the wgmma expert kernels (WG_N in kernels/moe.cu): each dequantised weight
/// serves this many slots.
pub const WG_TILE: usize = 128;
/// Slots per tile of the narrow wgmma expert kernels (WG_NARROW in kernels/moe.cu).
pub const WG_NARROW_TILE: usize = 32;

/// Index (in bf16 units) of column `c` within a row staged for the wgmma kernels (`stage_wg` and
/// the gate|up kernel's output; `wg_pos` in kernels/moe.cu): word 32G + 8i + 4reg + t holds the
/// columns (c, c + 4), c = 64G + 16t + 8(i / 2) + 2(i % 2) + reg.
pub fn wg_column_pos(c: usize) -> usize {
    let (grp, cg) = (c / 64, c % 64);
    let (t, h, nib) = (cg / 16, (cg / 8) % 2, cg % 8);
    let j = nib % 4;
    let (i, reg) = (2 * h + j / 2, j % 2);
    2 * (grp * 32 + i * 8 + reg * 4 + t) + nib / 4
}

/// `stage_wg`: `n` rows of `x` (`cols` f32 each, whole 64-column groups) as bf16 in the wgmma
/// kernels' column order into `out` (`n * cols / 2` words).
pub fn stage_wg(gpu: &Gpu, x: u64, cols: usize, n: usize, out: u64) -> Result<()> {
    if !cols.is_multiple_of(64) {
        bail!("wgmma staging takes whole 64-column groups, not {cols} columns");
    }
    gpu.launch(STAGE_WG, (n as u32, 1, 1), 256, 0, &[Arg::P(x), Arg::I(cols as i32), Arg::P(out)])
}

/// Whether the wgmma expert kernels take these matrices: 4-bit, whole 64-column groups alike.
fn wg_takes(mats: &[&DevQ]) -> bool {
    mats.iter().all(|q| q.bits == 4 && q.cols.is_multiple_of(64) && q.cols == mats[0].cols)
}

/// The routed experts' gate|up products of a prefill chunk on wgmma: per slot of the lists'
/// `tile`-slot tiles ([`WG_TILE`], or [`WG_NARROW_TILE`] on the narrow kernel), `h[slot] =
/// silu(Gate_e · x[slot / xdiv]) * (Up_e · x[slot / xdiv])` in bf16, `x` and `h` in the wgmma
/// order (`stage_wg`, `x_rows` rows); `rows` per expert.
#[allow(clippy::too_many_arguments)]
pub fn moe_wg_glu(gpu: &Gpu, gate: &DevQ, up: &DevQ, rows: usize, x: u64, x_rows: usize, h: u64, g: Grouped, tile: usize) -> Result<()> {
    if !wg_takes(&[gate, up]) || !rows.is_multiple_of(64) {
        bail!("the wgmma gate|up kernel takes 4-bit matrices of whole 64-column groups and outputs of whole groups");
    }
    if gate.frag != up.frag {
        bail!("the wgmma gate|up kernel takes both matrices' codes in one order");
    }
    wg_outputs_fit(g, tile, rows)?;
    let k = match (wg_narrow(tile)?, gate.frag) {
        (false, false) => PF_MOE_WG_GLU,
        (false, true) => PF_MOE_WG_GLU_F,
        (true, false) => PF_MOE_WG_GLU_N,
        (true, true) => PF_MOE_WG_GLU_N_F,
    };
    let mut args = wg_args(matrix_pair_args(gpu, gate, Some(up), CodeOrder::of(gate.frag)), rows, gate.cols, x, h, g);
    let grid = (rows.div_ceil(WG_GLU_ROWS) as u32, g.max_tiles as u32, 1);
    if wgm_takes(gate.cols, gate.frag, tile != WG_TILE) {
        args.push(wg_input_map(x, x_rows, gate.cols)?);
        return gpu.launch_cluster(PF_MOE_WG_GLU_MC, grid, WG_THREADS, wgm_smem(gate.cols), &args, wgm_cluster(grid.0 as usize));
    }
    gpu.launch(k, grid, WG_THREADS, wg_smem(tile), &args)
}

/// Whether lists of `tile`-slot tiles take the narrow wgmma kernels (else the wide ones).
fn wg_narrow(tile: usize) -> Result<bool> {
    match tile {
        WG_TILE => Ok(false),
        WG_NARROW_TILE => Ok(true),
        _ => bail!("the wgmma expert kernels take tiles of {WG_TILE} or {WG_NARROW_TILE} slots, not {tile}"),
    }
}

/// The wgmma expert kernels address their outputs ([slot][rows]) with 32-bit element offsets; the
/// tiles hold every slot, so `max_tiles * tile` bounds the slots.
fn wg_outputs_fit(g: Grouped, tile: usize, rows: usize) -> Result<()> {
    if g.max_tiles.saturating_mul(tile).saturating_mul(rows) > u32::MAX as usize {
        bail!("the wgmma expert kernels' outputs ({} tiles of {tile} slots x {rows} rows) pass 2^32 elements", g.max_tiles);
    }
    Ok(())
}

/// The routed experts' down products on wgmma: `y[slot] = Down_e · h[slot / xdiv]` (bf16 out,
/// [`combine_bf16_down`]'s input; `h` in the wgmma order), over `tile`-slot tiles as
/// [`moe_wg_glu`]. Each CTA keeps its tile's inputs in shared memory for [`WG_RES_ROW_BLOCKS`]
/// row blocks of 256 (`pf_moe_wg_down_res`; the narrow kernel [`WG_NARROW_RES_ROW_BLOCKS`]).
#[allow(clippy::too_many_arguments)]
pub fn moe_wg_down(gpu: &Gpu, down: &DevQ, rows: usize, h: u64, y: u64, g: Grouped, tile: usize) -> Result<()> {
    if !wg_takes(&[down]) || !rows.is_multiple_of(2) || down.cols > WG_RES_COLS {
        bail!("the wgmma down kernel takes 4-bit matrices of at most {WG_RES_COLS} columns in whole 64-column groups and an even number of rows");
    }
    wg_outputs_fit(g, tile, rows)?;
    let narrow = wg_narrow(tile)?;
    let k = match (narrow, down.frag) {
        (false, false) => PF_MOE_WG_DOWN_RES,
        (false, true) => PF_MOE_WG_DOWN_RES_F,
        (true, false) => PF_MOE_WG_DOWN_RES_N,
        (true, true) => PF_MOE_WG_DOWN_RES_N_F,
    };
    let (row_blocks, stages) = if narrow { (WG_NARROW_RES_ROW_BLOCKS, WG_NARROW_RES_STAGES) } else { (WG_RES_ROW_BLOCKS, WG_RES_STAGES) };
    let mut args = wg_args(matrix_pair_args(gpu, down, None, CodeOrder::of(down.frag)), rows, down.cols, h, y, g);
    args.push(Arg::I(row_blocks as i32));
    let grid = (rows.div_ceil(row_blocks * WG_DOWN_ROWS) as u32, g.max_tiles as u32, 1);
    gpu.launch(k, grid, WG_THREADS, wg_res_smem(down.cols, tile, stages), &args)
}

/// The down kernel takes matrices of at most this many columns (8 groups, the 35B's experts' 512):
/// a tile's inputs over all of them stay in shared memory.
pub const WG_RES_COLS: usize = 8 * 64;
/// Its code ring's stages (WG_RES_STAGES in kernels/moe.cu); the narrow kernel's
/// (WG_NARROW_RES_STAGES), fewer so that two CTAs share an SM.
const WG_RES_STAGES: usize = 8;
const WG_NARROW_RES_STAGES: usize = 4;
/// 256-row blocks per CTA of the down kernel: each CTA copies its tile's inputs once for these
/// row blocks and runs their steps as one pipeline. At the 35B's 2,048 rows a CTA takes all 8
/// (one H200, 2026-12-04: down at 4K 10.9 -> 9.9 ms with 8 or 4, 11.0 with 2; docs/cuda-prefill.md).
const WG_RES_ROW_BLOCKS: usize = 8;
/// The narrow kernel's: its tiles are many and short, and a CTA per tile would leave the second
/// wave of two CTAs per SM nearly empty (at 700 tokens ~260 tiles for 264 CTA places).
const WG_NARROW_RES_ROW_BLOCKS: usize = 2;

/// Dynamic shared memory of `pf_moe_wg_down_res` over `cols` columns, tiles of `tile` slots and a
/// ring of `stages`: every group's inputs of a tile, the code ring, the row blocks' scale buffers
/// (as many as the ring needs, see there), the slot and input-row indices, then the ring's full
/// and empty barriers (read by the fragment-order kernels).
fn wg_res_smem(cols: usize, tile: usize, stages: usize) -> u32 {
    let gpr = cols / 64;
    let buffers = (stages - 2) / gpr + 2;
    (gpr * tile * 128 + stages * WG_AROWS * 32 + buffers * WG_AROWS * 2 * 16 + 2 * tile * 4 + 16 * stages) as u32
}

/// The wgmma expert kernels' arguments (PF_MOE_WG_ARGS in kernels/moe.cu).
fn wg_args(mats: [Arg; 6], rows: usize, cols: usize, x: u64, out: u64, g: Grouped) -> Vec<Arg> {
    let mut args = mats.to_vec();
    args.extend([
        Arg::P(out),
        Arg::I(rows as i32),
        Arg::I(cols as i32),
        Arg::P(x),
        Arg::I(g.xdiv as i32),
        Arg::P(g.counts),
        Arg::P(g.offsets),
        Arg::P(g.list),
        Arg::P(g.tiles),
    ]);
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wgmma_outputs_past_32_bit_offsets_are_refused() {
        let d = MoeDims::new(&ModelConfig::qwen36_35b_a3b());
        let g = |n| Grouped { experts: d.e, counts: 0, offsets: 0, list: 0, xdiv: 1, tiles: 0, max_tiles: max_tiles(n, &d) };
        // An 8,192-token chunk (the largest prefill chunk) at the down product's 2,048 rows fits.
        assert!(wg_outputs_fit(g(8192), WG_TILE, d.hidden).is_ok());
        // ~300K tokens in one chunk would not: refused before a launch, not wrapped.
        assert!(wg_outputs_fit(g(300_000), WG_TILE, d.hidden).is_err());
    }

    #[test]
    fn the_35b_expert_shapes_take_the_shaped_ring_kernels() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let d = MoeDims::new(&cfg);
        assert_eq!(tcq_kernel(d.hidden, d.inter).name, "moe_tcq_f_35b");
        let tiny = MoeDims::new(&ModelConfig::tiny());
        assert_eq!(tcq_kernel(tiny.hidden, tiny.inter).name, "moe_tcq_f");
        assert_eq!(tcq_kernel(d.inter, d.hidden).name, "moe_tcq_f");
        assert!(MOE.kernels.contains(&"moe_tcq_f_35b"));
        assert_eq!(tcr_kernel(true, d.inter, d.hidden).name, "moe_tcr_f_35b");
        assert_eq!(tcr_kernel(false, d.inter, d.hidden).name, "moe_tcr");
        assert_eq!(tcr_kernel(true, tiny.inter, tiny.hidden).name, "moe_tcr_f");
        assert_eq!(tcr_kernel(true, d.hidden, d.inter).name, "moe_tcr_f");
        assert!(MOE.kernels.contains(&"moe_tcr_f_35b"));
    }

    #[test]
    fn the_wide_gate_up_shares_its_inputs_across_pairs_of_row_blocks() {
        let d = MoeDims::new(&ModelConfig::qwen36_35b_a3b());
        // The 35B: 512 rows per expert, four row blocks, two clusters of two per tile.
        assert_eq!(wgm_cluster(d.inter.div_ceil(WG_GLU_ROWS)), 2);
        assert_eq!([1, 2, 3, 6, 8, 12].map(wgm_cluster), [1, 2, 1, 2, 2, 2]);
    }

    #[test]
    fn the_35b_routing_shapes_take_the_shaped_kernels() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let (d, group) = (MoeDims::new(&cfg), cfg.quant.group_size);
        assert!(route_shaped(8, 8, &d, group));
        assert_eq!((route_kernel(1, true).name, route_kernel(4, true).name), ("moe_route_batch_1_35b", "moe_route_batch_4_35b"));
        assert_eq!((route_kernel(1, false).name, route_kernel(4, false).name), ("moe_route_batch_1", "moe_route_batch_4"));
        // Any other shape takes the general kernels.
        let tiny = ModelConfig::tiny();
        assert!(!route_shaped(8, 8, &MoeDims::new(&tiny), tiny.quant.group_size));
        assert!(!route_shaped(4, 8, &d, group) && !route_shaped(8, 4, &d, group) && !route_shaped(8, 8, &d, 32));
        assert!(!route_shaped(8, 8, &MoeDims { k: 4, ..d }, group) && !route_shaped(8, 8, &MoeDims { e: 128, ..d }, group));
        for k in [MOE_ROUTE_BATCH_1_35B, MOE_ROUTE_BATCH_4_35B] {
            assert!(MOE.kernels.contains(&k.name), "{}", k.name);
        }
    }

    #[test]
    fn routing_spreads_few_tokens_over_more_blocks() {
        assert_eq!(route_rows_per_block(1), 1);
        assert_eq!(route_rows_per_block(RB_TOK), 1);
        assert_eq!(route_rows_per_block(RB_TOK + 1), 4);
        assert_eq!(route_rows_per_block(64), 4);
        // At the 35B shape the last block's routing scratch (its group's 16 tokens' 256 logits,
        // counts and offsets, the step's slots' ids, per warp two tokens' 8 ids and weights)
        // outweighs the blocks' sums, and grows past 16 tokens only by the slots' ids.
        let d = MoeDims::new(&ModelConfig::qwen36_35b_a3b());
        assert_eq!(route_batch_smem(&d, 16, 1), 4 * (16 * 256 + 2 * 256 + 16 * 8 + 4 * 8 * 8));
        assert_eq!(route_batch_smem(&d, 16, 4), route_batch_smem(&d, 16, 1));
        assert_eq!(route_batch_smem(&d, 4, 1), 4 * (4 * 256 + 2 * 256 + 4 * 8 + 4 * 8 * 8));
        assert_eq!(route_batch_smem(&d, 128, 4), 4 * (16 * 256 + 2 * 256 + 128 * 8 + 4 * 8 * 8));
    }

    #[test]
    fn wgmma_column_order_is_a_permutation_that_pairs_columns_four_apart() {
        for cols in [64usize, 128, 512, 2048] {
            let mut seen = vec![false; cols];
            for c in 0..cols {
                let p = wg_column_pos(c);
                assert!(p < cols && !seen[p], "column {c} of {cols}: position {p} repeated or out of range");
                seen[p] = true;
                // Every 64-column group stays within its own 64 positions.
                assert_eq!(p / 64, c / 64);
            }
            // Word w of a row holds (c, c + 4) with c from the staging formula (stage_wg).
            for w in 0..cols / 2 {
                let (grp, i, reg, t) = (w / 32, (w / 8) % 4, (w / 4) % 2, w % 4);
                let c = 64 * grp + 16 * t + 8 * (i / 2) + 2 * (i % 2) + reg;
                assert_eq!((wg_column_pos(c), wg_column_pos(c + 4)), (2 * w, 2 * w + 1));
            }
        }
    }

    #[test]
    fn wgmma_blocks_fit_hoppers_shared_memory() {
        // One block per SM, within what a block may opt into; the narrow kernels two per SM
        // (228 KB of shared memory, 1 KB of it reserved per block).
        use super::{wg_res_smem, wg_smem, WG_NARROW_RES_STAGES as NS, WG_NARROW_TILE as NT, WG_RES_STAGES as S, WG_TILE as T};
        const { assert!(wg_smem(T) <= crate::backend::cuda::registry::SMEM_OPTIN_LIMIT) };
        let two_per_sm = |smem: u32| 2 * (smem + 1024) <= 228 * 1024;
        assert!(two_per_sm(wg_smem(NT)), "{}", wg_smem(NT));
        // The block's copies: one 16-byte piece of codes per thread per group, 8 groups' scales or
        // biases per thread, two pieces of the slots' inputs per thread.
        assert_eq!(super::WG_AROWS * 2, super::WG_THREADS as usize);
        assert_eq!(super::WG_TILE * 8, 2 * super::WG_THREADS as usize);
        // The down kernel with resident inputs at every width it takes: the 35B's 512 columns
        // (8 groups, two scale buffers) and the tiny model's 64 (one group, eight buffers).
        for gpr in 1..=super::WG_RES_COLS / 64 {
            let smem = wg_res_smem(64 * gpr, T, S);
            assert!(smem <= crate::backend::cuda::registry::SMEM_OPTIN_LIMIT, "{gpr} groups: {smem} bytes");
            let narrow = wg_res_smem(64 * gpr, NT, NS);
            assert!(two_per_sm(narrow), "narrow, {gpr} groups: {narrow} bytes");
        }
        assert_eq!(wg_res_smem(512, T, S), (8 * 16384 + 8 * 8192 + 2 * 8192 + 1024 + 8 * 16) as u32);
        assert_eq!(wg_res_smem(64, T, S), (16384 + 8 * 8192 + 8 * 8192 + 1024 + 8 * 16) as u32);
        assert_eq!(wg_res_smem(512, NT, NS), (8 * 4096 + 4 * 8192 + 2 * 8192 + 256 + 4 * 16) as u32);
    }

    #[test]
    fn the_35b_gate_up_takes_the_cluster_kernel() {
        // The stages' alignment slack, six stages of 28 KB (160 slots), the 35B's 32 groups' scales and
        // biases of 256 rows (80-byte rows) resident, the barriers and indices.
        assert_eq!(wgm_smem(2048), (1024 + 6 * 28672 + 4 * 128 * 80 + 6 * 16 + 1280) as u32);
        assert!(wgm_takes(2048, true, false));
        // Not the narrow tiles, not row-order codes, not the tiny model's two groups (its scales
        // are not whole 16-byte runs), nor rows whose resident scales would not fit.
        assert!(!wgm_takes(2048, true, true));
        assert!(!wgm_takes(2048, false, false));
        assert!(!wgm_takes(128, true, false));
        assert!(!wgm_takes(64 * 128, true, false));
    }

    #[test]
    fn persistent_down_blocks_give_each_warp_an_item() {
        let big = MoeDims::new(&ModelConfig::qwen36_35b_a3b());
        let down_items = |n| batch_max_tiles(n, &big) * 2048 / 16;
        // One token: 9 tiles of 128 row items, 8 per block, as moe_tcb's 144 blocks of 128 rows.
        assert_eq!(super::tcp_blocks(down_items(1), 264), 144);
        // From a few tokens on, one wave.
        assert_eq!(super::tcp_blocks(down_items(4), 264), 264);
        assert_eq!(super::tcp_blocks(down_items(64), 264), 264);
        assert_eq!(super::tcp_blocks(0, 264), 1);
    }

    #[test]
    fn prefill_chunks_pick_their_expert_kernels() {
        use super::{prefill_experts, PrefillExperts::*, TCB_PREFILL_TOKENS as T, WG_NARROW_TOKENS as W};
        assert_eq!(prefill_experts(512, false, T, W, true), Tcb);
        assert_eq!(prefill_experts(700, false, T, W, true), WgNarrow);
        assert_eq!(prefill_experts(T, false, T, W, true), Tcb);
        assert_eq!(prefill_experts(T + 1, false, T, W, true), WgNarrow);
        assert_eq!(prefill_experts(W, false, T, W, true), WgNarrow);
        assert_eq!(prefill_experts(W + 1, false, T, W, true), Wg);
        assert_eq!(prefill_experts(700, false, T, 0, true), Wg);
        assert_eq!(prefill_experts(4096, false, T, W, true), Wg);
        assert_eq!(prefill_experts(4096, false, 0, W, true), Wg);
        assert_eq!(prefill_experts(512, false, 0, W, true), WgNarrow);
        assert_eq!(prefill_experts(1, false, 0, 0, true), Wg);
        // The exact f32 mode and shapes the staged kernels do not take: the grouped GEMMs.
        assert_eq!(prefill_experts(4096, true, T, W, true), Gemm);
        assert_eq!(prefill_experts(700, true, T, W, true), Gemm);
        assert_eq!(prefill_experts(4096, false, T, W, false), Gemm);
        assert_eq!(prefill_experts(700, false, T, W, false), Gemm);
    }

    #[test]
    fn kernels_for_the_35b_and_tiny_shapes() {
        for cfg in [ModelConfig::qwen36_35b_a3b(), ModelConfig::tiny()] {
            let d = MoeDims::new(&cfg);
            assert_eq!(select(&d, false), MoeKernels::TensorCore);
            assert_eq!(select(&d, true), MoeKernels::CudaCore);
        }
        let tiny = MoeDims::new(&ModelConfig::tiny());
        // Shapes the tensor-core kernels do not take fall back to the CUDA cores.
        assert_eq!(select(&MoeDims { sinter: 128, ..tiny }, false), MoeKernels::CudaCore);
        assert_eq!(select(&MoeDims { inter: 768, sinter: 768, ..tiny }, false), MoeKernels::CudaCore);
        assert_eq!(select(&MoeDims { k: 32, e: 64, ..tiny }, false), MoeKernels::CudaCore);
        // Top-16 would need 34 warps in moe_down_tc's block (two per expert): past the 32 a block
        // holds, so the CUDA-core kernels take it.
        assert_eq!(select(&MoeDims { k: 16, e: 64, ..tiny }, false), MoeKernels::CudaCore);
        assert_eq!(select(&MoeDims { k: 15, e: 64, ..tiny }, false), MoeKernels::TensorCore);
        let big = MoeDims::new(&ModelConfig::qwen36_35b_a3b());
        assert_eq!(max_tiles(4096, &big), 512 + 256);
        // A decode batch: at most one tile per routed slot.
        assert_eq!(max_tiles(1, &big), 8);
        assert_eq!(max_tiles(16, &big), 128);
        // moe_tcb's 16-slot passes over a 700-token prefill chunk: 5,600 slots.
        assert_eq!(tiles_of(700, &big, BATCH_TILE), 350 + 256);
        // A batched decode step: 16-slot tiles, at most one per routed slot, plus the shared
        // expert's.
        assert_eq!(batch_max_tiles(16, &big), 128 + 1);
        assert_eq!(batch_max_tiles(64, &big), 512 / 16 + 256 + 4);
        assert_eq!(batch_max_tiles(1, &big), 8 + 1);
    }
}
