//! Batched prefill (T > 1): every layer processes all tokens of a chunk at once (kernels in
//! `kernels/prefill.cu`, design in docs/cuda-prefill.md).
//!
//! Per chunk of up to [`DEFAULT_CHUNK`] tokens at positions `pos0..pos0+n`:
//! embed → per layer { RMSNorm → 4-bit GEMMs (weights dequantised once per 128x32 tile and reused
//! by 64 tokens) → GDN (conv over the chunk + ring history, L2 norms, register-resident exact
//! recurrence per (value head, 32 columns), gated norm) or attention (norm + RoPE + KV append,
//! flash-style causal attention) → out-proj GEMM accumulated into the residual → RMSNorm → router
//! GEMM → GPU top-k + per-expert slot lists (counts, scan, scatter: no host sync) → grouped expert
//! GEMMs → shared expert → weighted combine into the residual } → final norm + lm_head only for
//! the rows whose logits are wanted. The sequence state (KV cache, GDN state, conv ring) is left
//! exactly as the decode path expects it.

use super::context::{cubin_cached, launch_on, module_source, ptr, Arg, Gpu};
use super::state::{CudaSequence, DevLayerState};
use super::weights::{DevMixer, DevQ};
use super::CudaBackend;
use crate::backend::{LogitsWanted, Sequence};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Source of the prefill kernels (compiled like the other modules, with kernels/common.cuh
/// prepended, but loaded here on first use so the decode module list stays untouched).
pub const SOURCE: &str = include_str!("../../../kernels/prefill.cu");

/// Entry points of kernels/prefill.cu.
pub const ENTRIES: &[&str] = &[
    "pf_gemm",
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
    for hd in [64usize, 128, 256] {
        funcs[format!("pf_attn_{hd}").as_str()]
            .set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                attn_smem(hd) as i32,
            )
            .map_err(|e| anyhow!("pf_attn_{hd}: shared memory opt-in: {e:?}"))?;
    }
    let k = Arc::new(Kern {
        ctx: gpu.ctx.clone(),
        stream: gpu.stream.clone(),
        funcs,
        _module: module,
    });
    list.push(k.clone());
    Ok(k)
}

/// Tokens per chunk (bounds the scratch: ~350 MB for the 35B model at 2048).
pub const DEFAULT_CHUNK: usize = 2048;

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
    g: CudaSlice<f32>,
    up: CudaSlice<f32>,
    d: CudaSlice<f32>,
    sg: CudaSlice<f32>,
    su: CudaSlice<f32>,
    sh: CudaSlice<f32>,
    logits: CudaSlice<f32>,
}

impl Buf {
    fn new(gpu: &Gpu, cfg: &ModelConfig, n: usize, logit_rows: usize) -> Result<Self> {
        let f = |k: usize| gpu.zeros::<f32>(n * k);
        let i = |k: usize| gpu.zeros::<i32>(k);
        let k = cfg.num_experts_per_tok;
        let e = cfg.num_experts;
        Ok(Buf {
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
            g: f(k * cfg.moe_intermediate_size)?,
            up: f(k * cfg.moe_intermediate_size)?,
            d: f(k * cfg.hidden_size)?,
            sg: f(cfg.shared_expert_intermediate_size)?,
            su: f(cfg.shared_expert_intermediate_size)?,
            sh: f(cfg.hidden_size)?,
            logits: gpu.zeros::<f32>(logit_rows.max(1) * cfg.vocab_size)?,
        })
    }
}

/// Per-expert token lists for a grouped GEMM.
#[derive(Clone, Copy)]
struct Grouped {
    experts: usize,
    counts: u64,
    offsets: u64,
    list: u64,
    xdiv: usize,
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
    let (w, s, b) = q.ptrs(gpu);
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
            Arg::P(w),
            Arg::P(s),
            Arg::P(b),
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
            Arg::I(xdiv as i32),
        ],
    )
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
    kern.launch(name, (nv as u32, (dv / 32) as u32, 1), 32, 0, &args)
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
    let cfg = b.cfg.clone();
    let gpu = &b.gpu;
    let chunk = chunk.max(1);
    let nmax = tokens.len().min(chunk);
    let logit_rows = match wanted {
        LogitsWanted::All => nmax.min(LOGIT_ROWS),
        _ => 1,
    };
    let mut buf = Buf::new(gpu, &cfg, nmax, logit_rows)?;
    let kern = kernels(gpu)?;
    let kern = &*kern;
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
        run_chunk(kern, b, seq.state_mut::<CudaSequence>(), &mut buf, n, pos0)?;
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
            let mut r = r0;
            while r < r1 {
                let m = (r1 - r).min(logit_rows);
                let xr = ptr(&buf.x, st) + (r * h * 4) as u64;
                let ur = ptr(&buf.u, st);
                rmsnorm(kern, xr, ptr(&b.w.final_norm, st), ur, m, h, eps)?;
                gemm(
                    kern,
                    gpu,
                    &b.w.lm_head,
                    vocab,
                    group,
                    ur,
                    m,
                    ptr(&buf.logits, st),
                    vocab,
                    false,
                    None,
                )?;
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
    Ok(out)
}

/// All layers for one chunk of `n` tokens at positions `pos0..pos0+n` (tokens already in
/// `buf.tokens`); the final hidden states end up in `buf.x`.
fn run_chunk(
    kern: &Kern,
    b: &CudaBackend,
    seq: &CudaSequence,
    buf: &mut Buf,
    n: usize,
    pos0: usize,
) -> Result<()> {
    let gpu = &b.gpu;
    let cfg = &b.cfg;
    let st = &gpu.stream;
    let h = cfg.hidden_size;
    let eps = cfg.rms_norm_eps as f32;
    let group = cfg.quant.group_size;
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
    for (li, lw) in b.w.layers.iter().enumerate() {
        rmsnorm(kern, x, p(&lw.input_norm), u, n, h, eps)?;
        match (&lw.mixer, &seq.layers[li]) {
            (DevMixer::Gdn(g), DevLayerState::Gdn { ring, state }) => {
                gemm(
                    kern,
                    gpu,
                    &g.in_qkv,
                    cdim,
                    group,
                    u,
                    n,
                    p(&buf.qkv),
                    cdim,
                    false,
                    None,
                )?;
                gemm(
                    kern,
                    gpu,
                    &g.in_z,
                    vd,
                    group,
                    u,
                    n,
                    p(&buf.z),
                    vd,
                    false,
                    None,
                )?;
                gemm(
                    kern,
                    gpu,
                    &g.in_b,
                    nv,
                    group,
                    u,
                    n,
                    p(&buf.gb),
                    nv,
                    false,
                    None,
                )?;
                gemm(
                    kern,
                    gpu,
                    &g.in_a,
                    nv,
                    group,
                    u,
                    n,
                    p(&buf.ga),
                    nv,
                    false,
                    None,
                )?;
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
                gemm(kern, gpu, &g.out, h, group, p(&buf.y), n, x, h, true, None)?;
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
                gemm(
                    kern,
                    gpu,
                    &a.q,
                    qrows,
                    group,
                    u,
                    n,
                    p(&buf.qkv),
                    qrows,
                    false,
                    None,
                )?;
                gemm(
                    kern,
                    gpu,
                    &a.k,
                    kvd,
                    group,
                    u,
                    n,
                    p(&buf.kr),
                    kvd,
                    false,
                    None,
                )?;
                gemm(
                    kern,
                    gpu,
                    &a.v,
                    kvd,
                    group,
                    u,
                    n,
                    p(&buf.vr),
                    kvd,
                    false,
                    None,
                )?;
                kern.launch(
                    "pf_attn_prep",
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
                        Arg::P(p(kcache)),
                        Arg::P(p(vcache)),
                        Arg::I(pos0 as i32),
                        Arg::I(nh as i32),
                        Arg::I(nkv as i32),
                        Arg::I(hd as i32),
                        Arg::I((cfg.rotary_dim() / 2) as i32),
                        Arg::F(eps),
                    ],
                )?;
                let qt = 64 / (nh / nkv);
                kern.launch(
                    &format!("pf_attn_{hd}"),
                    (n.div_ceil(qt) as u32, nkv as u32, 1),
                    256,
                    attn_smem(hd) as u32,
                    &[
                        Arg::P(p(&buf.q)),
                        Arg::P(p(&buf.gate)),
                        Arg::P(p(kcache)),
                        Arg::P(p(vcache)),
                        Arg::I(n as i32),
                        Arg::I(pos0 as i32),
                        Arg::I(nh as i32),
                        Arg::I(nkv as i32),
                        Arg::F(1.0 / (hd as f32).sqrt()),
                        Arg::P(p(&buf.y)),
                    ],
                )?;
                gemm(kern, gpu, &a.o, h, group, p(&buf.y), n, x, h, true, None)?;
            }
            _ => bail!("sequence state does not match the model's layer kinds (layer {li})"),
        }
        // MoE.
        let m = &lw.moe;
        rmsnorm(kern, x, p(&lw.post_norm), u, n, h, eps)?;
        gemm(
            kern,
            gpu,
            &m.router,
            ne,
            group,
            u,
            n,
            p(&buf.rl),
            ne,
            false,
            None,
        )?;
        gemm(
            kern,
            gpu,
            &m.shared_expert_gate,
            1,
            group,
            u,
            n,
            p(&buf.sgl),
            1,
            false,
            None,
        )?;
        st.memset_zeros(&mut buf.counts)
            .map_err(|e| anyhow!("memset: {e:?}"))?;
        let (ti, tw, cnt, off, fill, list) = (
            ptr(&buf.top_ids, st),
            p(&buf.top_w),
            ptr(&buf.counts, st),
            ptr(&buf.offsets, st),
            ptr(&buf.fill, st),
            ptr(&buf.list, st),
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
            32,
            0,
            &[Arg::P(cnt), Arg::I(ne as i32), Arg::P(off), Arg::P(fill)],
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
        let gr = |xdiv| Grouped {
            experts: ne,
            counts: cnt,
            offsets: off,
            list,
            xdiv,
        };
        gemm(
            kern,
            gpu,
            &m.gate_exps,
            inter,
            group,
            u,
            n,
            p(&buf.g),
            inter,
            false,
            Some(gr(k)),
        )?;
        gemm(
            kern,
            gpu,
            &m.up_exps,
            inter,
            group,
            u,
            n,
            p(&buf.up),
            inter,
            false,
            Some(gr(k)),
        )?;
        swiglu(kern, p(&buf.g), p(&buf.up), n * k * inter)?;
        gemm(
            kern,
            gpu,
            &m.down_exps,
            h,
            group,
            p(&buf.g),
            n,
            p(&buf.d),
            h,
            false,
            Some(gr(1)),
        )?;
        gemm(
            kern,
            gpu,
            &m.shared_gate,
            sinter,
            group,
            u,
            n,
            p(&buf.sg),
            sinter,
            false,
            None,
        )?;
        gemm(
            kern,
            gpu,
            &m.shared_up,
            sinter,
            group,
            u,
            n,
            p(&buf.su),
            sinter,
            false,
            None,
        )?;
        swiglu(kern, p(&buf.sg), p(&buf.su), n * sinter)?;
        gemm(
            kern,
            gpu,
            &m.shared_down,
            h,
            group,
            p(&buf.sg),
            n,
            p(&buf.sh),
            h,
            false,
            None,
        )?;
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
    }
    Ok(())
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

    /// `x` is `[tokens][q.cols]`; returns `[tokens][q.rows]` through the prefill GEMM.
    pub fn prefill_gemm_host(
        &self,
        q: &crate::checkpoint::store::QuantTensor,
        x: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>> {
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
        gemm(
            kern,
            gpu,
            &dq,
            q.rows,
            q.group,
            ptr(&xd, st),
            tokens,
            ptr(&y, st),
            q.rows,
            false,
            None,
        )?;
        st.clone_dtoh(&y).map_err(|e| anyhow!("{e:?}"))
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
