//! Batched prefill (T > 1): every layer processes all tokens of a chunk at once (kernels in
//! `kernels/prefill.cu`, design in docs/cuda-prefill.md).
//!
//! Per chunk of up to [`DEFAULT_CHUNK`] tokens at positions `pos0..pos0+n`:
//! embed → per layer { RMSNorm → 4-bit GEMMs (weights dequantised once per 128x32 tile and reused
//! by 64 tokens; for chunks of >= 128 tokens the dense ones dequantise the whole matrix to bf16
//! once and run on cuBLAS, blas.rs) → GDN (conv over the chunk + ring history, L2 norms, register-resident exact
//! recurrence per (value head, 32 columns), gated norm) or attention (norm + RoPE + KV append,
//! flash-style causal attention) → out-proj GEMM accumulated into the residual → RMSNorm → router
//! GEMM → GPU top-k + per-expert slot lists (counts, scan, scatter: no host sync) → grouped expert
//! GEMMs → shared expert → weighted combine into the residual } → final norm + lm_head only for
//! the rows whose logits are wanted. The sequence state (KV cache, GDN state, conv ring) is left
//! exactly as the decode path expects it.

use super::blas::{Blas, Precision};
use super::context::{cubin_cached, launch_on, module_source, ptr, Arg, Gpu};
use super::state::{CudaSequence, DevLayerState};
use super::weights::{DevMixer, DevQ};
use super::CudaBackend;
use crate::backend::{LogitsWanted, Sequence};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Source of the prefill kernels (compiled like the other modules, with kernels/common.cuh
/// prepended, but loaded here on first use so the decode module list stays untouched).
pub const SOURCE: &str = include_str!("../../../kernels/prefill.cu");

/// Entry points of kernels/prefill.cu.
pub const ENTRIES: &[&str] = &[
    "pf_gemm",
    "pf_gemm_tc",
    "pf_gemm_skinny",
    "pf_dequant_bf16",
    "pf_dequant_f32",
    "pf_to_bf16",
    "pf_embed",
    "pf_rmsnorm",
    "pf_gdn_conv",
    "pf_gdn_ring",
    "pf_gdn_qk",
    "pf_gdn_scan_32",
    "pf_gdn_scan_64",
    "pf_gdn_scan_128",
    "pf_gdn_norm",
    "pf_attn_prep",
    "pf_attn_64",
    "pf_attn_128",
    "pf_attn_256",
    "pf_attn_tc_64",
    "pf_attn_tc_128",
    "pf_attn_tc_256",
    "pf_attn_prep_bf16",
    "pf_attn_64_bf16",
    "pf_attn_128_bf16",
    "pf_attn_256_bf16",
    "pf_attn_tc_64_bf16",
    "pf_attn_tc_128_bf16",
    "pf_attn_tc_256_bf16",
    "pf_route",
    "pf_scan",
    "pf_scatter",
    "pf_swiglu",
    "pf_moe_combine",
];

/// The loaded prefill module of one CUDA context.
pub(crate) struct Kern {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    _module: Arc<CudaModule>,
    /// Activation scratch kept across calls (grown when a call needs more).
    bufs: Mutex<Option<Buf>>,
    /// cuBLAS for the dense GEMMs of chunks of at least `blas_min_tokens` tokens (blas.rs).
    blas: Option<Blas>,
    blas_min_tokens: usize,
}

impl Kern {
    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| anyhow!("prefill kernel {name} not loaded"))?;
        launch_on(&self.stream, f, name, grid, block, smem, args)
    }
}

/// Compiles (or reads from the on-disk cubin cache) and loads kernels/prefill.cu once per CUDA
/// context. The context handle is kept alive with the module, so a cached entry can never be
/// confused with a later context at the same address.
pub(crate) fn kernels(gpu: &Gpu) -> Result<Arc<Kern>> {
    static LOADED: OnceLock<Mutex<Vec<Arc<Kern>>>> = OnceLock::new();
    let mut list = LOADED
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(k) = list
        .iter()
        .find(|k| Arc::ptr_eq(&k.ctx, &gpu.ctx) && Arc::ptr_eq(&k.stream, &gpu.stream))
    {
        return Ok(k.clone());
    }
    let cubin = cubin_cached("prefill", &module_source(SOURCE))?;
    let module = gpu
        .ctx
        .load_module(Ptx::from_binary(cubin))
        .map_err(|e| anyhow!("loading kernels/prefill.cu: {e:?}"))?;
    let mut funcs = HashMap::new();
    for &e in ENTRIES {
        let f = module
            .load_function(e)
            .map_err(|err| anyhow!("kernel {e} missing from kernels/prefill.cu: {err:?}"))?;
        funcs.insert(e, f);
    }
    // Kernels over 48 KiB of dynamic shared memory need the opt-in.
    funcs["pf_gemm_tc"]
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            GEMM_TC_SMEM as i32,
        )
        .map_err(|e| anyhow!("pf_gemm_tc: shared memory opt-in: {e:?}"))?;
    funcs["pf_gemm_skinny"]
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            SKINNY_SMEM_MAX as i32,
        )
        .map_err(|e| anyhow!("pf_gemm_skinny: shared memory opt-in: {e:?}"))?;
    for hd in [64usize, 128, 256] {
        for sfx in [false, true].map(super::kernels::kv_suffix) {
            funcs[format!("pf_attn_{hd}{sfx}").as_str()]
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    attn_smem(hd) as i32,
                )
                .map_err(|e| anyhow!("pf_attn_{hd}{sfx}: shared memory opt-in: {e:?}"))?;
            funcs[format!("pf_attn_tc_{hd}{sfx}").as_str()]
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    attn_tc_smem(hd) as i32,
                )
                .map_err(|e| anyhow!("pf_attn_tc_{hd}{sfx}: shared memory opt-in: {e:?}"))?;
        }
    }
    let k = Arc::new(Kern {
        ctx: gpu.ctx.clone(),
        stream: gpu.stream.clone(),
        funcs,
        _module: module,
        bufs: Mutex::new(None),
        blas: Blas::open(&gpu.stream),
        blas_min_tokens: std::env::var("LILY_CUDA_CUBLAS_MIN_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(BLAS_MIN_TOKENS),
    });
    list.push(k.clone());
    Ok(k)
}

/// Fewest tokens per chunk for which dequantising a matrix for cuBLAS beats the fused
/// tensor-core kernel (`LILY_CUDA_CUBLAS_MIN_TOKENS` overrides).
const BLAS_MIN_TOKENS: usize = 128;

/// Tokens per chunk (bounds the scratch: ~0.8 GB for the 35B model at 4096). Longer chunks fill
/// the grouped expert tiles better (4096 tokens put ~128 on each of the 256 experts) and dequantise
/// the dense weights for cuBLAS half as often. `LILY_CUDA_PREFILL_CHUNK` overrides it.
pub const DEFAULT_CHUNK: usize = 4096;

/// The chunk length of the backend's prefill: `LILY_CUDA_PREFILL_CHUNK`, else [`DEFAULT_CHUNK`].
pub fn chunk_from_env() -> usize {
    std::env::var("LILY_CUDA_PREFILL_CHUNK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&c: &usize| c > 0)
        .unwrap_or(DEFAULT_CHUNK)
}

/// Rows of logits computed per lm_head pass when all positions' logits are wanted.
const LOGIT_ROWS: usize = 64;

/// Whether the batched path supports this model's shapes (otherwise the backend keeps running
/// the decode step per token).
pub fn supported(cfg: &ModelConfig) -> bool {
    let group = cfg.num_attention_heads / cfg.num_key_value_heads.max(1);
    [32, 64, 128].contains(&cfg.linear_key_head_dim)
        && cfg.linear_value_head_dim.is_multiple_of(32)
        && cfg.linear_value_head_dim <= 1024
        && group >= 1
        && 64 % group == 0
        && cfg
            .num_attention_heads
            .is_multiple_of(cfg.num_key_value_heads.max(1))
}

/// Activations of one chunk, token-major.
struct Buf {
    /// What it was sized for: the model, tokens per chunk, logit rows.
    cfg: ModelConfig,
    cap: usize,
    cap_rows: usize,
    tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    u: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    z: CudaSlice<f32>,
    gb: CudaSlice<f32>,
    ga: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    qn: CudaSlice<f32>,
    kn: CudaSlice<f32>,
    o: CudaSlice<f32>,
    y: CudaSlice<f32>,
    kr: CudaSlice<f32>,
    vr: CudaSlice<f32>,
    q: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    rl: CudaSlice<f32>,
    sgl: CudaSlice<f32>,
    top_ids: CudaSlice<i32>,
    top_w: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    fill: CudaSlice<i32>,
    list: CudaSlice<i32>,
    /// pf_scan's tile list for the tensor-core grouped GEMM: [count, (expert, first token)...].
    tiles: CudaSlice<i32>,
    g: CudaSlice<f32>,
    up: CudaSlice<f32>,
    d: CudaSlice<f32>,
    sg: CudaSlice<f32>,
    su: CudaSlice<f32>,
    sh: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// Operands of the cuBLAS GEMMs, when cuBLAS is loaded.
    blas: Option<BlasBufs>,
}

/// Scratch of the cuBLAS route: the dequantised weights of the current GEMM and the bf16 copies
/// of its input.
struct BlasBufs {
    /// bf16 weights, room for the largest dense matrix of a layer.
    wb: CudaSlice<u16>,
    /// f32 weights, room for the largest few-row matrix (router, GDN b/a).
    wf: CudaSlice<f32>,
    /// bf16 copy of the normed hidden states `u` (staged once per norm) and of any other input.
    ub: CudaSlice<u16>,
    xb: CudaSlice<u16>,
}

impl BlasBufs {
    fn new(gpu: &Gpu, cfg: &ModelConfig, n: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        let (vd, inner, sinter) = (
            cfg.gdn_value_dim(),
            cfg.attn_inner(),
            cfg.shared_expert_intermediate_size,
        );
        let dense = [cfg.gdn_conv_dim(), vd, cfg.q_proj_rows(), cfg.kv_dim(), inner, sinter]
            .into_iter()
            .max()
            .unwrap_or(0)
            * h;
        let few = cfg.num_experts.max(cfg.linear_num_value_heads).max(1) * h;
        Ok(BlasBufs {
            wb: gpu.zeros::<u16>(dense)?,
            wf: gpu.zeros::<f32>(few)?,
            ub: gpu.zeros::<u16>(n * h)?,
            xb: gpu.zeros::<u16>(n * vd.max(inner).max(sinter).max(h))?,
        })
    }
}

impl Buf {
    fn new(gpu: &Gpu, cfg: &ModelConfig, n: usize, logit_rows: usize, blas: bool) -> Result<Self> {
        let f = |k: usize| gpu.zeros::<f32>(n * k);
        let i = |k: usize| gpu.zeros::<i32>(k);
        let k = cfg.num_experts_per_tok;
        let e = cfg.num_experts;
        Ok(Buf {
            cfg: cfg.clone(),
            cap: n,
            cap_rows: logit_rows.max(1),
            tokens: i(n)?,
            x: f(cfg.hidden_size)?,
            u: f(cfg.hidden_size)?,
            qkv: f(cfg.gdn_conv_dim().max(cfg.q_proj_rows()))?,
            z: f(cfg.gdn_value_dim())?,
            gb: f(cfg.linear_num_value_heads)?,
            ga: f(cfg.linear_num_value_heads)?,
            conv: f(cfg.gdn_conv_dim())?,
            qn: f(cfg.linear_num_key_heads * cfg.linear_key_head_dim)?,
            kn: f(cfg.linear_num_key_heads * cfg.linear_key_head_dim)?,
            o: f(cfg.gdn_value_dim())?,
            y: f(cfg.gdn_value_dim().max(cfg.attn_inner()))?,
            kr: f(cfg.kv_dim())?,
            vr: f(cfg.kv_dim())?,
            q: f(cfg.attn_inner())?,
            gate: f(cfg.attn_inner())?,
            rl: f(e)?,
            sgl: f(1)?,
            top_ids: i(n * k)?,
            top_w: f(k)?,
            counts: i(e)?,
            offsets: i(e)?,
            fill: i(e)?,
            list: i(n * k)?,
            tiles: i(1 + 2 * max_tiles(n, cfg))?,
            g: f(k * cfg.moe_intermediate_size)?,
            up: f(k * cfg.moe_intermediate_size)?,
            d: f(k * cfg.hidden_size)?,
            sg: f(cfg.shared_expert_intermediate_size)?,
            su: f(cfg.shared_expert_intermediate_size)?,
            sh: f(cfg.hidden_size)?,
            logits: gpu.zeros::<f32>(logit_rows.max(1) * cfg.vocab_size)?,
            blas: if blas {
                Some(BlasBufs::new(gpu, cfg, n)?)
            } else {
                None
            },
        })
    }
}

/// Tokens per block of pf_gemm_skinny (PF_SK_T) and its dynamic shared memory limit.
const SKINNY_T: usize = 8;
const SKINNY_SMEM_MAX: usize = 160 * 1024;

/// pf_gemm_tc's double-buffered bf16 tiles: 2 x (128 rows + 64 tokens) x (64 + 8 padding).
const GEMM_TC_SMEM: usize = 2 * (128 + 64) * 72 * 2;

/// Upper bound on the (expert, 64-token) tiles of a grouped GEMM over `n` tokens.
fn max_tiles(n: usize, cfg: &ModelConfig) -> usize {
    (n * cfg.num_experts_per_tok).div_ceil(64) + cfg.num_experts
}

/// Per-expert token lists for a grouped GEMM.
#[derive(Clone, Copy)]
struct Grouped {
    experts: usize,
    counts: u64,
    offsets: u64,
    list: u64,
    xdiv: usize,
    /// pf_scan's tile list and its capacity (tensor-core path).
    tiles: u64,
    max_tiles: usize,
}

/// LILY_PREFILL_F32=1: the f32 FMA GEMMs (exact to rounding against the CPU reference) instead
/// of the bf16 tensor-core ones. Read once when the backend is made (`CudaBackend::exact_prefill`).
pub fn exact_from_env() -> bool {
    std::env::var("LILY_PREFILL_F32").is_ok_and(|v| v == "1")
}

/// Whether the tensor-core GEMM covers this matrix (k-tiles of 64 columns, one scale per
/// 32-column half tile).
fn tc_ok(q: &DevQ, group: usize) -> bool {
    q.cols.is_multiple_of(64) && group.is_multiple_of(32) && (q.bits == 4 || q.bits == 8)
}

/// `y[t][0..rows] (+)= W · x[t]` through the tensor-core kernel; with `up`, the fused
/// `silu(W·x) * (Up·x)` (rows of both). Grouped: per-expert tiles from pf_scan.
#[allow(clippy::too_many_arguments)]
fn gemm_tc(
    kern: &Kern,
    gpu: &Gpu,
    q: &DevQ,
    up: Option<&DevQ>,
    rows: usize,
    group: usize,
    x: u64,
    ntok: usize,
    y: u64,
    ldy: usize,
    accumulate: bool,
    grouped: Option<Grouped>,
) -> Result<()> {
    let (w, s, b) = q.ptrs(gpu);
    let (w2, s2, b2) = up.map(|u| u.ptrs(gpu)).unwrap_or((0, 0, 0));
    let (gy, counts, offsets, list, tiles, xdiv) = match grouped {
        Some(g) => (g.max_tiles, g.counts, g.offsets, g.list, g.tiles, g.xdiv),
        None => (ntok.div_ceil(64), 0, 0, 0, 0, 1),
    };
    let bm = if up.is_some() { 64 } else { 128 };
    kern.launch(
        "pf_gemm_tc",
        (rows.div_ceil(bm) as u32, gy as u32, 1),
        256,
        GEMM_TC_SMEM as u32,
        &[
            Arg::P(w),
            Arg::P(s),
            Arg::P(b),
            Arg::P(w2),
            Arg::P(s2),
            Arg::P(b2),
            Arg::I(q.bits as i32),
            Arg::I(rows as i32),
            Arg::I(q.cols as i32),
            Arg::I(group as i32),
            Arg::P(x),
            Arg::I(ntok as i32),
            Arg::P(y),
            Arg::I(ldy as i32),
            Arg::I(accumulate as i32),
            Arg::P(counts),
            Arg::P(offsets),
            Arg::P(list),
            Arg::P(tiles),
            Arg::I(xdiv as i32),
        ],
    )
}

/// The cuBLAS route of one forward call: the library and the scratch its operands live in.
struct BlasRoute<'a> {
    blas: &'a Blas,
    min_tokens: usize,
    wb: (u64, usize),
    wf: (u64, usize),
    ub: (u64, usize),
    xb: (u64, usize),
    /// The f32 input (pointer, values) whose bf16 copy is in `ub` (see [`Mm::stage`]).
    staged: Cell<Option<(u64, usize)>>,
}

impl<'a> BlasRoute<'a> {
    fn new(kern: &'a Kern, bufs: &BlasBufs, st: &CudaStream) -> Option<Self> {
        let blas = kern.blas.as_ref()?;
        let p = |s: &CudaSlice<u16>| (ptr(s, st), s.len());
        Some(BlasRoute {
            blas,
            min_tokens: kern.blas_min_tokens,
            wb: p(&bufs.wb),
            wf: (ptr(&bufs.wf, st), bufs.wf.len()),
            ub: p(&bufs.ub),
            xb: p(&bufs.xb),
            staged: Cell::new(None),
        })
    }

    /// The bf16 copy of `x` (`len` values): the staged one, else converted into `xb`.
    fn bf16_input(&self, kern: &Kern, x: u64, len: usize) -> Result<u64> {
        if self.staged.get() == Some((x, len)) {
            return Ok(self.ub.0);
        }
        if len > self.xb.1 {
            bail!("cuBLAS input scratch too small ({len} > {})", self.xb.1);
        }
        to_bf16(kern, x, self.xb.0, len)?;
        Ok(self.xb.0)
    }
}

/// The GEMM dispatcher of one forward call: tensor cores unless `exact` (or the matrix does not
/// fit the tensor-core tiling); cuBLAS on dequantised weights for dense GEMMs over many tokens.
struct Mm<'a> {
    kern: &'a Kern,
    gpu: &'a Gpu,
    group: usize,
    exact: bool,
    blas: Option<BlasRoute<'a>>,
}

impl Mm<'_> {
    /// The cuBLAS route for this GEMM, if it takes it: a dense (not per-expert) product over at
    /// least `min_tokens` tokens whose dequantised weights fit `scratch`, outside the exact mode.
    fn route(
        &self,
        q: &DevQ,
        rows: usize,
        ntok: usize,
        grouped: &Option<Grouped>,
        scratch: fn(&BlasRoute) -> usize,
    ) -> Option<&BlasRoute<'_>> {
        self.blas.as_ref().filter(|r| {
            !self.exact
                && grouped.is_none()
                && ntok >= r.min_tokens
                && rows <= q.rows
                && rows * q.cols <= scratch(r)
                && q.cols.is_multiple_of(8)
                && self.group.is_multiple_of(8)
        })
    }

    /// Keeps a bf16 copy of the normed hidden states `u` (`ntok` x `cols`) for every GEMM that
    /// reads them until the next norm rewrites `u` (the next `stage`). No-op without the route.
    fn stage(&self, u: u64, ntok: usize, cols: usize) -> Result<()> {
        let Some(r) = self.blas.as_ref() else {
            return Ok(());
        };
        r.staged.set(None);
        let len = ntok * cols;
        if ntok >= r.min_tokens && len <= r.ub.1 {
            to_bf16(self.kern, u, r.ub.0, len)?;
            r.staged.set(Some((u, len)));
        }
        Ok(())
    }

    /// `q` (first `rows` rows) dequantised into a cuBLAS scratch (`kernel`: bf16 or f32).
    fn dequant(&self, q: &DevQ, rows: usize, kernel: &str, out: u64) -> Result<()> {
        self.kern.launch(
            kernel,
            ((rows * q.cols / 8).div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[&qmat_args(q, self.gpu, rows, self.group)[..], &[Arg::P(out)]].concat(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        q: &DevQ,
        rows: usize,
        x: u64,
        ntok: usize,
        y: u64,
        ldy: usize,
        accumulate: bool,
        grouped: Option<Grouped>,
    ) -> Result<()> {
        if let Some(r) = self.route(q, rows, ntok, &grouped, |r| r.wb.1) {
            let xb = r.bf16_input(self.kern, x, ntok * q.cols)?;
            self.dequant(q, rows, "pf_dequant_bf16", r.wb.0)?;
            return r.blas.gemm(
                Precision::Bf16,
                r.wb.0,
                xb,
                y,
                (rows, q.cols, ntok, ldy),
                accumulate,
            );
        }
        if !self.exact && tc_ok(q, self.group) {
            gemm_tc(
                self.kern, self.gpu, q, None, rows, self.group, x, ntok, y, ldy, accumulate,
                grouped,
            )
        } else {
            gemm(
                self.kern, self.gpu, q, rows, self.group, x, ntok, y, ldy, accumulate, grouped,
            )
        }
    }

    /// f32 whatever the mode, for the few-row GEMMs whose outputs pick experts and gates (router,
    /// shared-expert gate, GDN b/a): pf_gemm_skinny, one block per 8 tokens (the 128-row tiles of
    /// pf_gemm would leave most of the GPU idle on them).
    /// With cuBLAS and many tokens: the f32 weights and a pedantic f32 GEMM.
    fn exact(&self, q: &DevQ, rows: usize, x: u64, ntok: usize, y: u64, ldy: usize) -> Result<()> {
        if let Some(r) = self.route(q, rows, ntok, &None, |r| r.wf.1) {
            self.dequant(q, rows, "pf_dequant_f32", r.wf.0)?;
            return r.blas.gemm(Precision::F32, r.wf.0, x, y, (rows, q.cols, ntok, ldy), false);
        }
        let smem = SKINNY_T * (q.cols + q.cols / self.group) * 4;
        if smem > SKINNY_SMEM_MAX || !q.cols.is_multiple_of(32) || !self.group.is_multiple_of(32) {
            return gemm(
                self.kern, self.gpu, q, rows, self.group, x, ntok, y, ldy, false, None,
            );
        }
        self.kern.launch(
            "pf_gemm_skinny",
            (ntok.div_ceil(SKINNY_T) as u32, rows.div_ceil(256) as u32, 1),
            256,
            smem as u32,
            &[
                &qmat_args(q, self.gpu, rows, self.group)[..],
                &[Arg::P(x), Arg::I(ntok as i32), Arg::P(y), Arg::I(ldy as i32)],
            ]
            .concat(),
        )
    }

    /// `out = silu(gate·x) * (up·x)` (`tmp`: room for the up projection on the f32 path).
    #[allow(clippy::too_many_arguments)]
    fn glu(
        &self,
        gate: &DevQ,
        up: &DevQ,
        rows: usize,
        x: u64,
        ntok: usize,
        out: u64,
        tmp: u64,
        slots: usize,
        grouped: Option<Grouped>,
    ) -> Result<()> {
        let wb = |r: &BlasRoute| r.wb.1;
        if self.route(gate, rows, ntok, &grouped, wb).is_some()
            && self.route(up, rows, ntok, &grouped, wb).is_some()
        {
            self.run(gate, rows, x, ntok, out, rows, false, None)?;
            self.run(up, rows, x, ntok, tmp, rows, false, None)?;
            return swiglu(self.kern, out, tmp, slots * rows);
        }
        if !self.exact && tc_ok(gate, self.group) && tc_ok(up, self.group) && gate.bits == up.bits {
            return gemm_tc(
                self.kern,
                self.gpu,
                gate,
                Some(up),
                rows,
                self.group,
                x,
                ntok,
                out,
                rows,
                false,
                grouped,
            );
        }
        gemm(
            self.kern, self.gpu, gate, rows, self.group, x, ntok, out, rows, false, grouped,
        )?;
        gemm(
            self.kern, self.gpu, up, rows, self.group, x, ntok, tmp, rows, false, grouped,
        )?;
        swiglu(self.kern, out, tmp, slots * rows)
    }
}

/// LILY_CUDA_PROFILE=1: an event after every phase of the prefill, summed per phase name and
/// printed (stderr) at the end of each forward call.
struct Prof {
    marks: Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
}

impl Prof {
    fn new(gpu: &Gpu) -> Result<Self> {
        let on = std::env::var("LILY_CUDA_PROFILE").is_ok_and(|v| v == "1");
        let mut p = Prof {
            marks: on.then(Vec::new),
        };
        p.mark(gpu, "start")?;
        Ok(p)
    }

    fn mark(&mut self, gpu: &Gpu, name: &'static str) -> Result<()> {
        if let Some(m) = self.marks.as_mut() {
            m.push((name, gpu.record_event()?));
        }
        Ok(())
    }

    fn report(&self, gpu: &Gpu, tokens: usize) -> Result<()> {
        let Some(m) = &self.marks else {
            return Ok(());
        };
        gpu.sync()?;
        let mut phases: Vec<(&'static str, f64)> = Vec::new();
        for w in m.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1).map_err(|e| anyhow!("{e:?}"))? as f64;
            match phases.iter_mut().find(|(n, _)| *n == w[1].0) {
                Some(e) => e.1 += ms,
                None => phases.push((w[1].0, ms)),
            }
        }
        let total: f64 = phases.iter().map(|(_, t)| t).sum();
        eprintln!(
            "lily: CUDA prefill profile, {tokens} tokens: {total:.2} ms GPU ({:.0} tok/s)",
            tokens as f64 / (total / 1000.0)
        );
        for (name, t) in &phases {
            eprintln!("  {name:<14} {t:>9.3} ms  {:>5.1}%", 100.0 * t / total);
        }
        Ok(())
    }
}

/// `y[t][0..rows] (+)= W[rows of expert e] · x[t]` (see `pf_gemm`). `ntok`: tokens (dense) or the
/// most tokens any expert can have (grouped).
#[allow(clippy::too_many_arguments)]
fn gemm(
    kern: &Kern,
    gpu: &Gpu,
    q: &DevQ,
    rows: usize,
    group: usize,
    x: u64,
    ntok: usize,
    y: u64,
    ldy: usize,
    accumulate: bool,
    grouped: Option<Grouped>,
) -> Result<()> {
    let (gz, counts, offsets, list, xdiv) = match grouped {
        Some(g) => (g.experts, g.counts, g.offsets, g.list, g.xdiv),
        None => (1, 0, 0, 0, 1),
    };
    kern.launch(
        "pf_gemm",
        (
            rows.div_ceil(128) as u32,
            ntok.div_ceil(64) as u32,
            gz as u32,
        ),
        256,
        0,
        &[
            &qmat_args(q, gpu, rows, group)[..],
            &[
                Arg::P(x),
                Arg::I(ntok as i32),
                Arg::P(y),
                Arg::I(ldy as i32),
                Arg::I(accumulate as i32),
                Arg::P(counts),
                Arg::P(offsets),
                Arg::P(list),
                Arg::I(xdiv as i32),
            ],
        ]
        .concat(),
    )
}

/// The leading arguments every quantised-matrix kernel of this module takes (pf_gemm,
/// pf_gemm_skinny, pf_dequant_*): codes, scales, biases, bits, the first `rows` rows, columns,
/// group size.
fn qmat_args(q: &DevQ, gpu: &Gpu, rows: usize, group: usize) -> [Arg; 7] {
    let (w, s, b) = q.ptrs(gpu);
    [
        Arg::P(w),
        Arg::P(s),
        Arg::P(b),
        Arg::I(q.bits as i32),
        Arg::I(rows as i32),
        Arg::I(q.cols as i32),
        Arg::I(group as i32),
    ]
}

fn rmsnorm(
    kern: &Kern,
    x: u64,
    gain: u64,
    out: u64,
    rows: usize,
    n: usize,
    eps: f32,
) -> Result<()> {
    kern.launch(
        "pf_rmsnorm",
        (rows as u32, 1, 1),
        256,
        0,
        &[
            Arg::P(x),
            Arg::P(gain),
            Arg::P(out),
            Arg::I(n as i32),
            Arg::F(eps),
        ],
    )
}

fn attn_smem(hd: usize) -> usize {
    (64 * hd + 32 * (hd + 4) + 32 * hd) * 4
}

/// Q, K and V tiles of 64 rows in bf16 with 8 columns of padding (pf_attn_tc).
fn attn_tc_smem(hd: usize) -> usize {
    3 * 64 * (hd + 8) * 2
}

/// GDN scan launch (also used by the test hook).
#[allow(clippy::too_many_arguments)]
fn gdn_scan(
    kern: &Kern,
    dk: usize,
    ptrs: [u64; 9],
    t: usize,
    nk: usize,
    nv: usize,
    dv: usize,
    c: usize,
) -> Result<()> {
    let name = match dk {
        32 => "pf_gdn_scan_32",
        64 => "pf_gdn_scan_64",
        128 => "pf_gdn_scan_128",
        _ => bail!("GDN key head dim {dk} not supported by the prefill scan"),
    };
    let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::P(p)).collect();
    args.extend([
        Arg::I(t as i32),
        Arg::I(nk as i32),
        Arg::I(nv as i32),
        Arg::I(dv as i32),
        Arg::I(c as i32),
    ]);
    // Columns per block: 4 warps x 32 / PARTS (PARTS = lanes per state column, see gdn_scan).
    let bc = 4 * 32 / (dk / 16).clamp(2, 8);
    kern.launch(name, (nv as u32, dv.div_ceil(bc) as u32, 1), 128, 0, &args)
}

/// Runs `tokens` (already validated: in vocabulary, room in the sequence) through the model in
/// chunks of at most `chunk` tokens; returns the wanted logits, as the `Backend` trait.
pub fn forward(
    b: &mut CudaBackend,
    seq: &mut Sequence,
    tokens: &[u32],
    wanted: LogitsWanted,
    chunk: usize,
) -> Result<Vec<f32>> {
    let exact = b.exact_prefill;
    forward_mode(b, seq, tokens, wanted, chunk, exact)
}

/// [`forward`] with the GEMM precision chosen by the caller (`exact`: f32 FMA GEMMs).
pub fn forward_mode(
    b: &mut CudaBackend,
    seq: &mut Sequence,
    tokens: &[u32],
    wanted: LogitsWanted,
    chunk: usize,
    exact: bool,
) -> Result<Vec<f32>> {
    let cfg = b.cfg.clone();
    let gpu = &b.gpu;
    let chunk = chunk.max(1);
    let nmax = tokens.len().min(chunk);
    let logit_rows = match wanted {
        LogitsWanted::All => nmax.min(LOGIT_ROWS),
        _ => 1,
    };
    let kern = kernels(gpu)?;
    let kern = &*kern;
    let mut cached = kern.bufs.lock().unwrap_or_else(|e| e.into_inner());
    let fits = cached
        .as_ref()
        .is_some_and(|c| c.cfg == cfg && c.cap >= nmax && c.cap_rows >= logit_rows);
    if !fits {
        let (cap, rows) = match cached.as_ref() {
            Some(c) if c.cfg == cfg => (c.cap.max(nmax), c.cap_rows.max(logit_rows)),
            _ => (nmax, logit_rows),
        };
        *cached = None; // free the old scratch before allocating the new one
        *cached = Some(Buf::new(gpu, &cfg, cap, rows, kern.blas.is_some())?);
    }
    let buf = cached.as_mut().unwrap();
    let mut prof = Prof::new(gpu)?;
    let mut out = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let n = chunk.min(tokens.len() - start);
        let pos0 = seq.len();
        let last_chunk = start + n == tokens.len();
        let ids: Vec<i32> = tokens[start..start + n].iter().map(|&t| t as i32).collect();
        gpu.stream
            .memcpy_htod(&ids, &mut buf.tokens)
            .map_err(|e| anyhow!("token upload: {e:?}"))?;
        run_chunk(
            kern,
            b,
            seq.state_mut::<CudaSequence>(),
            buf,
            n,
            pos0,
            exact,
            &mut prof,
        )?;
        let gpu = &b.gpu;
        let st = &gpu.stream;
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps as f32;
        let group = cfg.quant.group_size;
        let vocab = cfg.vocab_size;
        let rows: Option<(usize, usize)> = match wanted {
            LogitsWanted::All => Some((0, n)),
            LogitsWanted::Last if last_chunk => Some((n - 1, n)),
            _ => None,
        };
        if let Some((r0, r1)) = rows {
            // lm_head stays on the fused kernel: its bf16 copy would need ~1 GB of scratch.
            let mm = Mm {
                kern,
                gpu,
                group,
                exact,
                blas: None,
            };
            let mut r = r0;
            while r < r1 {
                let m = (r1 - r).min(logit_rows);
                let xr = ptr(&buf.x, st) + (r * h * 4) as u64;
                let ur = ptr(&buf.u, st);
                rmsnorm(kern, xr, ptr(&b.w.final_norm, st), ur, m, h, eps)?;
                mm.run(
                    &b.w.lm_head,
                    vocab,
                    ur,
                    m,
                    ptr(&buf.logits, st),
                    vocab,
                    false,
                    None,
                )?;
                prof.mark(gpu, "head")?;
                let mut host = vec![0.0f32; m * vocab];
                st.memcpy_dtoh(&buf.logits.slice(0..m * vocab), &mut host)
                    .map_err(|e| anyhow!("CUDA error during prefill: {e:?}"))?;
                gpu.sync()?;
                out.extend(host);
                r += m;
            }
        }
        seq.advance(n);
        start += n;
    }
    b.gpu.sync()?;
    prof.report(&b.gpu, tokens.len())?;
    Ok(out)
}

/// All layers for one chunk of `n` tokens at positions `pos0..pos0+n` (tokens already in
/// `buf.tokens`); the final hidden states end up in `buf.x`.
#[allow(clippy::too_many_arguments)]
fn run_chunk(
    kern: &Kern,
    b: &CudaBackend,
    seq: &CudaSequence,
    buf: &mut Buf,
    n: usize,
    pos0: usize,
    exact: bool,
    prof: &mut Prof,
) -> Result<()> {
    let gpu = &b.gpu;
    let cfg = &b.cfg;
    let st = &gpu.stream;
    let h = cfg.hidden_size;
    let eps = cfg.rms_norm_eps as f32;
    let group = cfg.quant.group_size;
    let mm = Mm {
        kern,
        gpu,
        group,
        exact,
        blas: buf
            .blas
            .as_ref()
            .and_then(|bb| BlasRoute::new(kern, bb, st)),
    };
    let p = |s: &CudaSlice<f32>| ptr(s, st);
    let (x, u) = (p(&buf.x), p(&buf.u));
    let e = &b.w.embed;
    let (ew, es, eb) = e.ptrs(gpu);
    kern.launch(
        "pf_embed",
        (h.div_ceil(256) as u32, n as u32, 1),
        256,
        0,
        &[
            Arg::P(ew),
            Arg::P(es),
            Arg::P(eb),
            Arg::P(ptr(&buf.tokens, st)),
            Arg::I(h as i32),
            Arg::I(e.bits as i32),
            Arg::I(group as i32),
            Arg::P(x),
        ],
    )?;
    prof.mark(gpu, "embed")?;
    let (nk, nv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let cdim = cfg.gdn_conv_dim();
    let vd = cfg.gdn_value_dim();
    let kc = cfg.linear_conv_kernel_dim;
    let (nh, nkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (ne, k) = (cfg.num_experts, cfg.num_experts_per_tok);
    let (inter, sinter) = (
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    );
    let mtiles = max_tiles(n, cfg);
    for (li, lw) in b.w.layers.iter().enumerate() {
        rmsnorm(kern, x, p(&lw.input_norm), u, n, h, eps)?;
        mm.stage(u, n, h)?;
        prof.mark(gpu, "norm")?;
        match (&lw.mixer, &seq.layers[li]) {
            (DevMixer::Gdn(g), DevLayerState::Gdn { ring, state }) => {
                mm.run(&g.in_qkv, cdim, u, n, p(&buf.qkv), cdim, false, None)?;
                mm.run(&g.in_z, vd, u, n, p(&buf.z), vd, false, None)?;
                mm.exact(&g.in_b, nv, u, n, p(&buf.gb), nv)?;
                mm.exact(&g.in_a, nv, u, n, p(&buf.ga), nv)?;
                prof.mark(gpu, "gdn.proj")?;
                kern.launch(
                    "pf_gdn_conv",
                    (cdim.div_ceil(256) as u32, n as u32, 1),
                    256,
                    0,
                    &[
                        Arg::P(p(&buf.qkv)),
                        Arg::P(p(ring)),
                        Arg::P(p(&g.conv_taps)),
                        Arg::I(n as i32),
                        Arg::I(cdim as i32),
                        Arg::I(kc as i32),
                        Arg::I(pos0 as i32),
                        Arg::P(p(&buf.conv)),
                    ],
                )?;
                kern.launch(
                    "pf_gdn_ring",
                    (cdim.div_ceil(256) as u32, n.min(kc) as u32, 1),
                    256,
                    0,
                    &[
                        Arg::P(p(&buf.qkv)),
                        Arg::P(p(ring)),
                        Arg::I(n as i32),
                        Arg::I(cdim as i32),
                        Arg::I(kc as i32),
                        Arg::I(pos0 as i32),
                    ],
                )?;
                kern.launch(
                    "pf_gdn_qk",
                    (n as u32, nk as u32, 1),
                    dk as u32,
                    0,
                    &[
                        Arg::P(p(&buf.conv)),
                        Arg::I(cdim as i32),
                        Arg::I(nk as i32),
                        Arg::I(dk as i32),
                        Arg::P(p(&buf.qn)),
                        Arg::P(p(&buf.kn)),
                    ],
                )?;
                prof.mark(gpu, "gdn.conv")?;
                gdn_scan(
                    kern,
                    dk,
                    [
                        p(&buf.qn),
                        p(&buf.kn),
                        p(&buf.conv),
                        p(&buf.gb),
                        p(&buf.ga),
                        p(&g.dt_bias),
                        p(&g.neg_a),
                        p(state),
                        p(&buf.o),
                    ],
                    n,
                    nk,
                    nv,
                    dv,
                    cdim,
                )?;
                prof.mark(gpu, "gdn.scan")?;
                kern.launch(
                    "pf_gdn_norm",
                    (n as u32, nv as u32, 1),
                    dv as u32,
                    0,
                    &[
                        Arg::P(p(&buf.o)),
                        Arg::P(p(&buf.z)),
                        Arg::P(p(&g.norm)),
                        Arg::P(p(&buf.y)),
                        Arg::I(nv as i32),
                        Arg::I(dv as i32),
                        Arg::F(eps),
                    ],
                )?;
                prof.mark(gpu, "gdn.norm")?;
                mm.run(&g.out, h, p(&buf.y), n, x, h, true, None)?;
                prof.mark(gpu, "gdn.out")?;
            }
            (
                DevMixer::Attn(a),
                DevLayerState::Attn {
                    k: kcache,
                    v: vcache,
                },
            ) => {
                let qrows = cfg.q_proj_rows();
                let kvd = cfg.kv_dim();
                mm.run(&a.q, qrows, u, n, p(&buf.qkv), qrows, false, None)?;
                mm.run(&a.k, kvd, u, n, p(&buf.kr), kvd, false, None)?;
                mm.run(&a.v, kvd, u, n, p(&buf.vr), kvd, false, None)?;
                prof.mark(gpu, "attn.proj")?;
                let kv_sfx = super::kernels::kv_suffix(seq.kv_bf16);
                kern.launch(
                    &format!("pf_attn_prep{kv_sfx}"),
                    (n as u32, (nh + nkv) as u32, 1),
                    hd as u32,
                    ((hd + 33) * 4) as u32,
                    &[
                        Arg::P(p(&buf.qkv)),
                        Arg::P(p(&buf.kr)),
                        Arg::P(p(&buf.vr)),
                        Arg::P(p(&a.q_norm)),
                        Arg::P(p(&a.k_norm)),
                        Arg::P(ptr(&b.scratch.inv_freq, st)),
                        Arg::P(p(&buf.q)),
                        Arg::P(p(&buf.gate)),
                        Arg::P(ptr(kcache, st)),
                        Arg::P(ptr(vcache, st)),
                        Arg::I(pos0 as i32),
                        Arg::I(nh as i32),
                        Arg::I(nkv as i32),
                        Arg::I(hd as i32),
                        Arg::I((cfg.rotary_dim() / 2) as i32),
                        Arg::F(eps),
                    ],
                )?;
                prof.mark(gpu, "attn.prep")?;
                let qt = 64 / (nh / nkv);
                let (name, threads, smem) = if exact {
                    (format!("pf_attn_{hd}{kv_sfx}"), 256, attn_smem(hd))
                } else {
                    (format!("pf_attn_tc_{hd}{kv_sfx}"), 128, attn_tc_smem(hd))
                };
                kern.launch(
                    &name,
                    (n.div_ceil(qt) as u32, nkv as u32, 1),
                    threads,
                    smem as u32,
                    &[
                        Arg::P(p(&buf.q)),
                        Arg::P(p(&buf.gate)),
                        Arg::P(ptr(kcache, st)),
                        Arg::P(ptr(vcache, st)),
                        Arg::I(n as i32),
                        Arg::I(pos0 as i32),
                        Arg::I(nh as i32),
                        Arg::I(nkv as i32),
                        Arg::F(1.0 / (hd as f32).sqrt()),
                        Arg::P(p(&buf.y)),
                    ],
                )?;
                prof.mark(gpu, "attn.core")?;
                mm.run(&a.o, h, p(&buf.y), n, x, h, true, None)?;
                prof.mark(gpu, "attn.out")?;
            }
            _ => bail!("sequence state does not match the model's layer kinds (layer {li})"),
        }
        // MoE.
        let m = &lw.moe;
        rmsnorm(kern, x, p(&lw.post_norm), u, n, h, eps)?;
        mm.stage(u, n, h)?;
        prof.mark(gpu, "norm")?;
        mm.exact(&m.router, ne, u, n, p(&buf.rl), ne)?;
        mm.exact(&m.shared_expert_gate, 1, u, n, p(&buf.sgl), 1)?;
        st.memset_zeros(&mut buf.counts)
            .map_err(|e| anyhow!("memset: {e:?}"))?;
        let (ti, tw, cnt, off, fill, list, tiles) = (
            ptr(&buf.top_ids, st),
            p(&buf.top_w),
            ptr(&buf.counts, st),
            ptr(&buf.offsets, st),
            ptr(&buf.fill, st),
            ptr(&buf.list, st),
            ptr(&buf.tiles, st),
        );
        kern.launch(
            "pf_route",
            (n.div_ceil(4) as u32, 1, 1),
            128,
            0,
            &[
                Arg::P(p(&buf.rl)),
                Arg::I(n as i32),
                Arg::I(ne as i32),
                Arg::I(k as i32),
                Arg::P(ti),
                Arg::P(tw),
                Arg::P(cnt),
            ],
        )?;
        kern.launch(
            "pf_scan",
            (1, 1, 1),
            256,
            0,
            &[
                Arg::P(cnt),
                Arg::I(ne as i32),
                Arg::P(off),
                Arg::P(fill),
                Arg::P(tiles),
            ],
        )?;
        kern.launch(
            "pf_scatter",
            ((n * k).div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(ti),
                Arg::I((n * k) as i32),
                Arg::P(off),
                Arg::P(fill),
                Arg::P(list),
            ],
        )?;
        prof.mark(gpu, "moe.route")?;
        let gr = |xdiv| Grouped {
            experts: ne,
            counts: cnt,
            offsets: off,
            list,
            xdiv,
            tiles,
            max_tiles: mtiles,
        };
        mm.glu(
            &m.gate_exps,
            &m.up_exps,
            inter,
            u,
            n,
            p(&buf.g),
            p(&buf.up),
            n * k,
            Some(gr(k)),
        )?;
        prof.mark(gpu, "moe.gate_up")?;
        mm.run(
            &m.down_exps,
            h,
            p(&buf.g),
            n,
            p(&buf.d),
            h,
            false,
            Some(gr(1)),
        )?;
        prof.mark(gpu, "moe.down")?;
        mm.glu(
            &m.shared_gate,
            &m.shared_up,
            sinter,
            u,
            n,
            p(&buf.sg),
            p(&buf.su),
            n,
            None,
        )?;
        mm.run(&m.shared_down, h, p(&buf.sg), n, p(&buf.sh), h, false, None)?;
        prof.mark(gpu, "shared")?;
        kern.launch(
            "pf_moe_combine",
            (h.div_ceil(256) as u32, n as u32, 1),
            256,
            0,
            &[
                Arg::P(p(&buf.d)),
                Arg::P(tw),
                Arg::I(k as i32),
                Arg::P(p(&buf.sh)),
                Arg::P(p(&buf.sgl)),
                Arg::P(x),
                Arg::I(h as i32),
            ],
        )?;
        prof.mark(gpu, "combine")?;
    }
    Ok(())
}

/// `len` f32 values at `x` to bf16 at `y` (`len` is a multiple of 4: rows of 64-column matrices).
fn to_bf16(kern: &Kern, x: u64, y: u64, len: usize) -> Result<()> {
    let n4 = len / 4;
    kern.launch(
        "pf_to_bf16",
        (n4.div_ceil(256) as u32, 1, 1),
        256,
        0,
        &[Arg::P(x), Arg::P(y), Arg::I(n4 as i32)],
    )
}

fn swiglu(kern: &Kern, g: u64, u: u64, n: usize) -> Result<()> {
    kern.launch(
        "pf_swiglu",
        (n.div_ceil(256) as u32, 1, 1),
        256,
        0,
        &[Arg::P(g), Arg::P(u), Arg::I(n as i32)],
    )
}

/// Test hooks (tests/cuda_prefill.rs).
impl CudaBackend {
    /// The batched prefill with an explicit chunk length (the backend uses [`DEFAULT_CHUNK`]).
    pub fn prefill_chunked(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        wanted: LogitsWanted,
        chunk: usize,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("prefill called with no tokens");
        }
        if !supported(&self.cfg) {
            bail!("the batched prefill does not support this model's shapes");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!("token id {bad} is outside the vocabulary");
        }
        seq.check_room(tokens.len())?;
        forward(self, seq, tokens, wanted, chunk)
    }

    /// [`Self::prefill_chunked`] with the GEMM precision given (`exact`: the f32 FMA GEMMs, as
    /// LILY_PREFILL_F32=1) instead of read from the environment.
    pub fn prefill_mode(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        wanted: LogitsWanted,
        chunk: usize,
        exact: bool,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("prefill called with no tokens");
        }
        if !supported(&self.cfg) {
            bail!("the batched prefill does not support this model's shapes");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            bail!("token id {bad} is outside the vocabulary");
        }
        seq.check_room(tokens.len())?;
        forward_mode(self, seq, tokens, wanted, chunk, exact)
    }

    /// The grouped (MoE) GEMM as the prefill runs it: `q` stacks `experts` matrices of
    /// `q.rows / experts` rows; token t's k-th slot (`ids[t*k + j]`, distinct per token) gets
    /// `W_e · x[t]`, or with `up` the fused `silu(W_e·x) * (Up_e·x)`. Returns `[tokens*k][rows]`.
    /// `exact`: the f32 kernel, else the tensor-core one.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_grouped_gemm_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        up: Option<&crate::checkpoint::store::QuantTensor>,
        experts: usize,
        x: &[f32],
        tokens: usize,
        ids: &[u32],
        k: usize,
        exact: bool,
    ) -> Result<Vec<f32>> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        if x.len() != tokens * q.cols || ids.len() != tokens * k || !q.rows.is_multiple_of(experts)
        {
            bail!("prefill_grouped_gemm_host: bad shapes");
        }
        let rows = q.rows / experts;
        let kern = kernels(gpu)?;
        let kern = &*kern;
        let dq = DevQ::upload(gpu, q)?;
        let du = match up {
            Some(u) => Some(DevQ::upload(gpu, u)?),
            None => None,
        };
        let mut counts = vec![0i32; experts];
        for &e in ids {
            counts[e as usize] += 1;
        }
        let idv: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
        let mt = (tokens * k).div_ceil(64) + experts;
        let (xd, cd, idd) = (gpu.upload(x)?, gpu.upload(&counts)?, gpu.upload(&idv)?);
        let (od, fd, ld) = (
            gpu.zeros::<i32>(experts)?,
            gpu.zeros::<i32>(experts)?,
            gpu.zeros::<i32>(tokens * k)?,
        );
        let td = gpu.zeros::<i32>(1 + 2 * mt)?;
        let pi = |s: &CudaSlice<i32>| ptr(s, st);
        kern.launch(
            "pf_scan",
            (1, 1, 1),
            256,
            0,
            &[
                Arg::P(pi(&cd)),
                Arg::I(experts as i32),
                Arg::P(pi(&od)),
                Arg::P(pi(&fd)),
                Arg::P(pi(&td)),
            ],
        )?;
        kern.launch(
            "pf_scatter",
            ((tokens * k).div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(pi(&idd)),
                Arg::I((tokens * k) as i32),
                Arg::P(pi(&od)),
                Arg::P(pi(&fd)),
                Arg::P(pi(&ld)),
            ],
        )?;
        let y = gpu.zeros::<f32>(tokens * k * rows)?;
        let tmp = gpu.zeros::<f32>(tokens * k * rows)?;
        let g = Grouped {
            experts,
            counts: pi(&cd),
            offsets: pi(&od),
            list: pi(&ld),
            xdiv: k,
            tiles: pi(&td),
            max_tiles: mt,
        };
        let mm = Mm {
            kern,
            gpu,
            group: q.group,
            exact,
            blas: None,
        };
        match &du {
            Some(u) => mm.glu(
                &dq,
                u,
                rows,
                ptr(&xd, st),
                tokens,
                ptr(&y, st),
                ptr(&tmp, st),
                tokens * k,
                Some(g),
            )?,
            None => mm.run(
                &dq,
                rows,
                ptr(&xd, st),
                tokens,
                ptr(&y, st),
                rows,
                false,
                Some(g),
            )?,
        }
        st.clone_dtoh(&y).map_err(|e| anyhow!("{e:?}"))
    }

    /// `x` is `[tokens][q.cols]`; returns `[tokens][q.rows]` through the prefill GEMM.
    pub fn prefill_gemm_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>> {
        self.prefill_gemm_host_mode(q, x, tokens, true)
    }

    /// [`Self::prefill_gemm_host`] through the tensor-core kernel unless `exact`.
    pub fn prefill_gemm_host_mode(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
        exact: bool,
    ) -> Result<Vec<f32>> {
        self.prefill_gemm_host_kind(q, x, tokens, if exact { 1 } else { 0 })
    }

    /// [`Self::prefill_gemm_host`] through the few-row f32 kernel (router, gates).
    pub fn prefill_skinny_gemm_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>> {
        self.prefill_gemm_host_kind(q, x, tokens, 2)
    }

    /// [`Self::prefill_gemm_host`] through cuBLAS on the dequantised weights, whatever the token
    /// count: bf16 tensor cores, or (`f32`) the pedantic f32 GEMM of the few-row matrices. An
    /// error when cuBLAS is not loaded.
    pub fn prefill_cublas_gemm_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
        f32: bool,
    ) -> Result<Vec<f32>> {
        self.prefill_gemm_host_kind(q, x, tokens, if f32 { 4 } else { 3 })
    }

    /// kind 0: tensor cores, 1: f32 tiles, 2: few-row f32, 3: cuBLAS bf16, 4: cuBLAS f32.
    fn prefill_gemm_host_kind(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
        kind: u8,
    ) -> Result<Vec<f32>> {
        let exact = kind == 1 || kind == 2;
        let gpu = &self.gpu;
        let st = &gpu.stream;
        if x.len() != tokens * q.cols {
            bail!(
                "prefill_gemm_host: x has {} values, want {tokens}x{}",
                x.len(),
                q.cols
            );
        }
        let kern = kernels(gpu)?;
        let kern = &*kern;
        let dq = DevQ::upload(gpu, q)?;
        let xd = gpu.upload(x)?;
        let y = gpu.zeros::<f32>(tokens * q.rows)?;
        let bufs = if kind >= 3 {
            if kern.blas.is_none() {
                bail!("cuBLAS is not loaded (libcublas missing or LILY_CUDA_CUBLAS=0)");
            }
            let sz = q.rows * q.cols;
            Some(BlasBufs {
                wb: gpu.zeros::<u16>(sz)?,
                wf: gpu.zeros::<f32>(sz)?,
                ub: gpu.zeros::<u16>(tokens * q.cols)?,
                xb: gpu.zeros::<u16>(tokens * q.cols)?,
            })
        } else {
            None
        };
        let mut blas = bufs.as_ref().and_then(|bb| BlasRoute::new(kern, bb, st));
        if let Some(r) = blas.as_mut() {
            r.min_tokens = 0;
        }
        let mm = Mm {
            kern,
            gpu,
            group: q.group,
            exact,
            blas,
        };
        if kind == 2 || kind == 4 {
            mm.exact(&dq, q.rows, ptr(&xd, st), tokens, ptr(&y, st), q.rows)?;
        } else {
            mm.run(
                &dq,
                q.rows,
                ptr(&xd, st),
                tokens,
                ptr(&y, st),
                q.rows,
                false,
                None,
            )?;
        }
        st.clone_dtoh(&y).map_err(|e| anyhow!("{e:?}"))
    }

    /// The prefill attention kernel alone: `q`, `gate` `[t][nh][hd]` (q already normed and
    /// rotated), caches `[pos0 + t][nkv][hd]`; returns the gated outputs `[t][nh][hd]`.
    /// `exact`: the f32 SIMT kernel, else the tensor-core one.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention_host(
        &self,
        q: &[f32],
        gate: &[f32],
        kc: &[f32],
        vc: &[f32],
        t: usize,
        pos0: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        exact: bool,
    ) -> Result<Vec<f32>> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        if ![64, 128, 256].contains(&hd) || 64 % (nh / nkv) != 0 {
            bail!("prefill_attention_host: unsupported shape");
        }
        let kern = kernels(gpu)?;
        let kern = &*kern;
        let (qd, gd, kd, vd) = (
            gpu.upload(q)?,
            gpu.upload(gate)?,
            gpu.upload(kc)?,
            gpu.upload(vc)?,
        );
        let od = gpu.zeros::<f32>(t * nh * hd)?;
        let qt = 64 / (nh / nkv);
        let (name, threads, smem) = if exact {
            (format!("pf_attn_{hd}"), 256, attn_smem(hd))
        } else {
            (format!("pf_attn_tc_{hd}"), 128, attn_tc_smem(hd))
        };
        let pp = |s: &CudaSlice<f32>| ptr(s, st);
        kern.launch(
            &name,
            (t.div_ceil(qt) as u32, nkv as u32, 1),
            threads,
            smem as u32,
            &[
                Arg::P(pp(&qd)),
                Arg::P(pp(&gd)),
                Arg::P(pp(&kd)),
                Arg::P(pp(&vd)),
                Arg::I(t as i32),
                Arg::I(pos0 as i32),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::F(1.0 / (hd as f32).sqrt()),
                Arg::P(pp(&od)),
            ],
        )?;
        st.clone_dtoh(&od).map_err(|e| anyhow!("{e:?}"))
    }

    /// The prefill GDN scan for one value head over T tokens: q, k `[T][dk]` (normalised,
    /// q pre-scaled), v `[T][dv]`, raw gate inputs b, a `[T]`, state `s0` `[dk][dv]`.
    /// Returns (outputs `[T][dv]`, final state).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_gdn_scan_host(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        braw: &[f32],
        araw: &[f32],
        dt_bias: f32,
        neg_a: f32,
        s0: &[f32],
        dk: usize,
        dv: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        let t = braw.len();
        let c = 2 * dk + dv;
        let mut conv = vec![0.0f32; t * c];
        for i in 0..t {
            conv[i * c + 2 * dk..(i + 1) * c].copy_from_slice(&v[i * dv..(i + 1) * dv]);
        }
        let up = |v: &[f32]| gpu.upload(v);
        let (qd, kd, cd, bd, ad) = (up(q)?, up(k)?, up(&conv)?, up(braw)?, up(araw)?);
        let (dtb, nga, sd) = (up(&[dt_bias])?, up(&[neg_a])?, up(s0)?);
        let od = gpu.zeros::<f32>(t * dv)?;
        let kern = kernels(gpu)?;
        let kern = &*kern;
        let pp = |s: &CudaSlice<f32>| ptr(s, st);
        gdn_scan(
            kern,
            dk,
            [
                pp(&qd),
                pp(&kd),
                pp(&cd),
                pp(&bd),
                pp(&ad),
                pp(&dtb),
                pp(&nga),
                pp(&sd),
                pp(&od),
            ],
            t,
            1,
            1,
            dv,
            c,
        )?;
        let o = st.clone_dtoh(&od).map_err(|e| anyhow!("{e:?}"))?;
        let s = st.clone_dtoh(&sd).map_err(|e| anyhow!("{e:?}"))?;
        Ok((o, s))
    }
}
