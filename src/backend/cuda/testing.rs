//! Test hooks of the GPU tests (tests/cuda_gpu.rs, tests/cuda_prefill.rs), behind the
//! `cuda-testing` feature: single kernels on host data against the CPU reference, a traced decode
//! step, and prefill with chosen options. Variants are chosen through [`CudaOptions`] fields or
//! the families' route enums, as the backend chooses them.

use super::activations::GdnChunked;
use super::attention::{self, AttnDims, AttnPtrs};
use super::decode::{self, StepOut};
use super::device::{ptr, Gpu};
use super::forward::Probe;
use super::gdn::{self, GdnChunkScratch, GdnDims, GdnPtrs};
pub use super::gdn::ScanPath;
use super::moe::{self, MoeDims, RouteLists};
use super::qmatmul::{self, BlasScratch, FewRowRoute, FewRows, Gemm, GemmRoute, GemvInput, GemvSets, Grouped, TcbStaging};
use super::sampling;
use super::state::CudaSequence;
use super::weights::DevQ;
use super::{CudaBackend, CudaOptions};
use crate::backend::{LogitsWanted, Sequence};
use crate::checkpoint::store::QuantTensor;
use crate::engine::sampling::SamplerSnapshot;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, DeviceRepr};

fn read<T: DeviceRepr + Default + Clone>(gpu: &Gpu, s: &CudaSlice<T>) -> Result<Vec<T>> {
    gpu.stream.clone_dtoh(s).map_err(|e| anyhow!("{e:?}"))
}

/// The options of `b`, to change between calls. Fields read per call (prefill chunk and precision,
/// the GEMV and MoE choices, the cuBLAS threshold, the KV cache of new sequences) apply to the
/// next forward; `pdl`, `graphs`, `cublas`, `profile` and `gdn_state_f16` (the state slots'
/// layout) are fixed when the backend is made.
pub fn options_mut(b: &mut CudaBackend) -> &mut CudaOptions {
    &mut b.opts
}

/// One batched decode step (batch.rs) of `seqs`, each fed its token of `tokens`; returns the logits
/// `[rows][vocab]` and advances every sequence by one.
pub fn batch_logits(b: &mut CudaBackend, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<Vec<f32>> {
    b.batch_logits(seqs, tokens)
}

/// One decode step of `token`; returns the residual stream after every layer and the logits.
pub fn forward_traced(b: &mut CudaBackend, seq: &mut Sequence, token: u32) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
    b.check_tokens(seq, &[token])?;
    let pos = seq.len();
    let st = seq.state_mut::<CudaSequence>();
    decode::upload_step(&b.gpu, st, token, pos)?;
    let mut probe = Probe::tracing();
    b.enqueue_step(st, attention::splits_for(pos + 1), StepOut::Logits, &mut probe)?;
    let logits = b.decoder.read_logits(&b.gpu)?;
    seq.advance(1);
    Ok((probe.trace.unwrap_or_default(), logits))
}

/// The batched prefill with the chunk and precision given (the decode step never stands in).
pub fn prefill(b: &mut CudaBackend, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted, chunk: usize, exact: bool) -> Result<Vec<f32>> {
    if !super::prefill::supported(&b.cfg) {
        bail!("the batched prefill does not support this model's shapes");
    }
    b.check_tokens(seq, tokens)?;
    with_prefill_options(b, chunk, exact, |b| b.prefill(seq, tokens, wanted))
}

/// `Backend::prefill_pieces` with the chunk and precision given.
pub fn prefill_pieces(b: &mut CudaBackend, pieces: &mut [crate::backend::PrefillPiece], chunk: usize, exact: bool) -> Vec<Result<()>> {
    with_prefill_options(b, chunk, exact, |b| crate::backend::Backend::prefill_pieces(b, pieces))
}

/// Runs `f` with the prefill chunk and precision set, then restores the backend's own.
fn with_prefill_options<T>(b: &mut CudaBackend, chunk: usize, exact: bool, f: impl FnOnce(&mut CudaBackend) -> T) -> T {
    let saved = (b.opts.prefill_chunk, b.opts.exact_prefill);
    (b.opts.prefill_chunk, b.opts.exact_prefill) = (chunk, exact);
    let out = f(b);
    (b.opts.prefill_chunk, b.opts.exact_prefill) = saved;
    out
}

/// One matrix times `x` (`gain`: RMSNorm of x first) through the decode GEMV the options select.
pub fn gemv(b: &CudaBackend, q: &QuantTensor, x: &[f32], gain: Option<&[f32]>) -> Result<Vec<f32>> {
    let gpu = &b.gpu;
    if x.len() != q.cols {
        bail!("gemv: x has {} values, matrix has {} columns", x.len(), q.cols);
    }
    let dq = DevQ::upload(gpu, q)?;
    let y = gpu.zeros::<f32>(q.rows)?;
    let (xd, gd) = (gpu.upload(x)?, gpu.upload(gain.unwrap_or(&[0.0]))?);
    let mut sets = GemvSets::default();
    let i = sets.add(gpu, &[(&dq, ptr(&y, &gpu.stream), false)]);
    let descs = gpu.upload(&sets.descs)?;
    let set = sets.set(i, ptr(&descs, &gpu.stream));
    let gp = if gain.is_some() { ptr(&gd, &gpu.stream) } else { 0 };
    let inp = GemvInput { x: ptr(&xd, &gpu.stream), cols: q.cols, gain: gp, eps: b.cfg.rms_norm_eps as f32, xnorm_out: 0 };
    qmatmul::gemv(gpu, set, inp, q.group, b.opts.gemv_tc_min_tiles)?;
    read(gpu, &y)
}

/// `ntok` rows of `x` (`[ntok][q.cols]`) through the batched decode's GEMV set (`stage_tcb`, then
/// `gemv_tcb` as a step of `ntok` rows runs it), over the codes in row order or (`frag`) their
/// fragment-order copy; returns `[ntok][q.rows]`.
pub fn gemv_batch(b: &CudaBackend, q: &QuantTensor, x: &[f32], ntok: usize, frag: bool) -> Result<Vec<f32>> {
    let gpu = &b.gpu;
    if x.len() != ntok * q.cols {
        bail!("gemv_batch: x has {} values, want {ntok}x{}", x.len(), q.cols);
    }
    let dq = if frag { DevQ::upload_with_frag_copy(gpu, q, false)? } else { DevQ::upload(gpu, q)? };
    let y = gpu.zeros::<f32>(ntok * q.rows)?;
    let xd = gpu.upload(x)?;
    let st = qmatmul::TcbStaging::new(gpu, ntok, q.cols)?;
    qmatmul::stage_tcb(gpu, ptr(&xd, &gpu.stream), q.cols, ntok, 0, 1e-6, 0, &st)?;
    let mut sets = GemvSets::default();
    sets.frag = frag;
    let i = sets.add(gpu, &[(&dq, ptr(&y, &gpu.stream), false)]);
    let descs = gpu.upload(&sets.descs)?;
    qmatmul::gemv_tcb(gpu, sets.set(i, ptr(&descs, &gpu.stream)), &st, q.cols, ntok)?;
    read(gpu, &y)
}

/// The prefill RMSNorm of `rows` rows of `x` (`n` values each) with its outputs staged for the
/// wgmma expert kernels by the norm itself, and the same outputs staged by `stage_wg` from the
/// f32 outputs: (the norm's words, stage_wg's words, the f32 outputs).
pub fn norm_wg_staging(b: &CudaBackend, x: &[f32], gain: &[f32], rows: usize, n: usize, eps: f32) -> Result<(Vec<u32>, Vec<u32>, Vec<f32>)> {
    let gpu = &b.gpu;
    if x.len() != rows * n || gain.len() != n {
        bail!("norm_wg_staging: {} inputs and {} gains for {rows} rows of {n}", x.len(), gain.len());
    }
    let (xd, gd, out) = (gpu.upload(x)?, gpu.upload(gain)?, gpu.zeros::<f32>(rows * n)?);
    let (by_norm, by_stage) = (gpu.zeros::<u32>(rows * n / 2)?, gpu.zeros::<u32>(rows * n / 2)?);
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    super::ops::rms_norm(gpu, p(&xd), p(&gd), p(&out), rows, n, eps, None, Some(ptr(&by_norm, &gpu.stream)))?;
    moe::stage_wg(gpu, p(&out), n, rows, ptr(&by_stage, &gpu.stream))?;
    Ok((read(gpu, &by_norm)?, read(gpu, &by_stage)?, read(gpu, &out)?))
}

/// The device argmax (ties -> lowest id) of `logits`.
pub fn argmax(b: &CudaBackend, logits: &[f32]) -> Result<u32> {
    let gpu = &b.gpu;
    let (l, step) = (gpu.upload(logits)?, gpu.upload(&[0i32, 0i32])?);
    let part = gpu.zeros::<f32>(sampling::ARGMAX_SCRATCH)?;
    sampling::argmax_next(gpu, ptr(&l, &gpu.stream), logits.len(), ptr(&step, &gpu.stream), ptr(&part, &gpu.stream), 1)?;
    Ok(read(gpu, &step)?[0] as u32)
}

/// `draws` tokens from the device sampler over fixed `logits`, continuing `snap` (its counts
/// grow with each draw when a penalty is set); each draw is at the next position, so its noise
/// differs. The kernels the decode would pick for `snap` (`sample_small_k` for a small top-k).
pub fn sample(b: &CudaBackend, logits: &[f32], snap: &SamplerSnapshot, draws: usize) -> Result<Vec<u32>> {
    sample_with(b, logits, snap, draws, sampling::select(snap) == sampling::TokenChoice::SampleSmallK)
}

/// [`sample`] through the general kernels (`sample_prep`, `sample_select` x 8, `sample_draw`)
/// whatever the parameters.
pub fn sample_general(b: &CudaBackend, logits: &[f32], snap: &SamplerSnapshot, draws: usize) -> Result<Vec<u32>> {
    sample_with(b, logits, snap, draws, false)
}

/// One draw for each of `rows` rows holding the same `logits` and `snap` (so the same token), in
/// one launch as a batched decode step makes it (fewer blocks per row, each over a longer slice):
/// through `sample_small_k` when `small`, else the general kernels.
pub fn sample_rows(b: &CudaBackend, logits: &[f32], snap: &SamplerSnapshot, rows: usize, small: bool) -> Result<Vec<u32>> {
    let gpu = &b.gpu;
    let mut scratch = sampling::SampleScratch::new(gpu, logits.len(), rows)?;
    scratch.load(gpu, &vec![snap; rows])?;
    let l = gpu.upload(&logits.repeat(rows))?;
    let step = gpu.upload(&vec![0i32; 2 * rows])?;
    sampling::sample_next(gpu, ptr(&l, &gpu.stream), logits.len(), ptr(&step, &gpu.stream), &scratch, rows, small)?;
    Ok(read(gpu, &step)?.chunks(2).map(|s| s[0] as u32).collect())
}

fn sample_with(b: &CudaBackend, logits: &[f32], snap: &SamplerSnapshot, draws: usize, small: bool) -> Result<Vec<u32>> {
    let gpu = &b.gpu;
    let mut scratch = sampling::SampleScratch::new(gpu, logits.len(), 1)?;
    scratch.load(gpu, &[snap])?;
    let l = gpu.upload(logits)?;
    let mut step = gpu.upload(&[0i32, 0i32])?;
    let mut out = Vec::with_capacity(draws);
    for _ in 0..draws {
        sampling::sample_next(gpu, ptr(&l, &gpu.stream), logits.len(), ptr(&step, &gpu.stream), &scratch, 1, small)?;
        let v = read(gpu, &step)?;
        out.push(v[0] as u32);
        gpu.stream.memcpy_htod(&[0i32, v[1]], &mut step).map_err(|e| anyhow!("{e:?}"))?;
    }
    Ok(out)
}

/// The cuBLAS scratch for one matrix of `q`'s size and `tokens` rows, when `needed`.
fn blas_scratch(b: &CudaBackend, q: &QuantTensor, tokens: usize, needed: bool) -> Result<Option<BlasScratch>> {
    if !needed {
        return Ok(None);
    }
    if b.blas.is_none() {
        bail!("cuBLAS is not loaded (libcublas missing or LILY_CUDA_CUBLAS=0)");
    }
    let (w, a) = (q.rows * q.cols, tokens * q.cols);
    Ok(Some(BlasScratch::new(&b.gpu, w, a, a)?))
}

/// `x` is `[tokens][q.cols]`; returns `[tokens][q.rows]` through the prefill GEMM `route`.
pub fn gemm(b: &CudaBackend, q: &QuantTensor, x: &[f32], tokens: usize, route: GemmRoute) -> Result<Vec<f32>> {
    product(b, q, x, tokens, route)
}

/// Like [`gemm`] through a few-row route (router, gates).
pub fn few_rows(b: &CudaBackend, q: &QuantTensor, x: &[f32], tokens: usize, route: FewRowRoute) -> Result<Vec<f32>> {
    Ok(few_rows_set(b, &[q], x, tokens, route)?.remove(0))
}

/// The few-row products of `qs` (one input `x`, `[tokens][cols]`) in one `Gemm::few_rows` call on
/// `route` (the tensor cores stack them in shared launches); each `[tokens][q.rows]`.
pub fn few_rows_set(b: &CudaBackend, qs: &[&QuantTensor], x: &[f32], tokens: usize, route: FewRowRoute) -> Result<Vec<Vec<f32>>> {
    let gpu = &b.gpu;
    let Some(cols) = qs.first().map(|q| q.cols) else { bail!("no products") };
    if qs.iter().any(|q| q.cols != cols || q.group != qs[0].group) || x.len() != tokens * cols {
        bail!("few rows: the products take {tokens}x{cols} inputs of one width and group");
    }
    let dqs = qs.iter().map(|q| DevQ::upload(gpu, q)).collect::<Result<Vec<_>>>()?;
    let xd = gpu.upload(x)?;
    let ys = qs.iter().map(|q| gpu.zeros::<f32>(tokens * q.rows)).collect::<Result<Vec<_>>>()?;
    let outs: Vec<FewRows> = dqs.iter().zip(qs).zip(&ys).map(|((dq, q), y)| FewRows { q: dq, rows: q.rows, y: ptr(y, &gpu.stream), ldy: q.rows }).collect();
    let xp = ptr(&xd, &gpu.stream);
    match route {
        // The exact mode's kernels: pf_gemm_skinny where it takes the width.
        FewRowRoute::Skinny => Gemm::new(gpu, qs[0].group, true, None).few_rows(&outs, xp, tokens)?,
        // The callers' inputs are within f16's range (the kernel tests': |x| <= 1).
        FewRowRoute::TensorCore => Gemm::new(gpu, qs[0].group, false, None).few_inputs_f16(true).few_rows(&outs, xp, tokens)?,
        // The kernel the few-row route falls back to when the skinny one cannot take the width.
        FewRowRoute::F32Tiles => {
            for f in &outs {
                Gemm::new(gpu, qs[0].group, true, None).run(f.q, f.rows, xp, tokens, f.y, f.ldy, false, None)?;
            }
        }
    }
    ys.iter().map(|y| read(gpu, y)).collect()
}

fn product(b: &CudaBackend, q: &QuantTensor, x: &[f32], tokens: usize, route: GemmRoute) -> Result<Vec<f32>> {
    let gpu = &b.gpu;
    if x.len() != tokens * q.cols {
        bail!("gemm: x has {} values, want {tokens}x{}", x.len(), q.cols);
    }
    // The exact mode selects the f32 tiles; cuBLAS is offered (from 0 tokens) only to its route.
    let exact = route == GemmRoute::F32Tiles;
    let scratch = blas_scratch(b, q, tokens, route == GemmRoute::Cublas)?;
    let blas = match (&scratch, b.blas.as_ref()) {
        (Some(s), Some(l)) => Some((l, s, 0)),
        _ => None,
    };
    let dq = DevQ::upload(gpu, q)?;
    let (xd, y) = (gpu.upload(x)?, gpu.zeros::<f32>(tokens * q.rows)?);
    let (xp, yp) = (ptr(&xd, &gpu.stream), ptr(&y, &gpu.stream));
    Gemm::new(gpu, q.group, exact, blas).run(&dq, q.rows, xp, tokens, yp, q.rows, false, None)?;
    read(gpu, &y)
}

/// The kernel of a grouped product ([`grouped_gemm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedRoute {
    /// `pf_gemm` (the exact f32 mode).
    F32,
    /// `pf_gemm_tc` (bf16 tensor cores).
    TensorCore,
    /// `stage_wg` + `pf_moe_wg_glu` / `_down` (the routed experts of long prefill chunks): the
    /// gate|up output is bf16 in the wgmma order, the down output bf16 `[slot][row]`, both read
    /// back here as f32 `[slot][row]`.
    Wgmma,
    /// The same on the narrow kernels (`pf_moe_wg_glu_n` / `_down_res_n`, 32-slot tiles).
    WgmmaNarrow,
    /// `stage_tcb` + `moe_tcb` (the gate|up kernel of the batched decode and of short prefill
    /// chunks, 16-slot tiles).
    Tcb,
    /// `stage_tcb` + `moe_tcp` (their down kernel: persistent blocks over the same tiles;
    /// bit-identical to `Tcb`).
    Tcp,
    /// `stage_tcb` + `moe_tcr` (`moe_tcb` with each warp's weights streamed through a ring in
    /// shared memory; bit-identical to `Tcb`).
    Tcr,
    /// `Tcb`, `Tcp`, `Tcr`, `Wgmma` and `F32` over codes in fragment order (the `*_f` kernel
    /// instances; `pf_gemm`'s other loads): the same products as in row order.
    TcbFrag,
    TcpFrag,
    TcrFrag,
    WgmmaFrag,
    WgmmaNarrowFrag,
    F32Frag,
}

impl GroupedRoute {
    /// The route over row-order codes that this one must match exactly.
    pub fn row_order(self) -> GroupedRoute {
        match self {
            GroupedRoute::TcbFrag => GroupedRoute::Tcb,
            GroupedRoute::TcpFrag => GroupedRoute::Tcp,
            GroupedRoute::TcrFrag => GroupedRoute::Tcr,
            GroupedRoute::WgmmaFrag => GroupedRoute::Wgmma,
            GroupedRoute::WgmmaNarrowFrag => GroupedRoute::WgmmaNarrow,
            GroupedRoute::F32Frag => GroupedRoute::F32,
            r => r,
        }
    }
}

/// The grouped (MoE) product as the prefill runs it: `q` stacks `experts` matrices of
/// `q.rows / experts` rows; token t's j-th slot (`ids[t*k + j]`, distinct per token) gets
/// `W_e · x[t]`, or with `up` the fused `silu(W_e·x) * (Up_e·x)`. Returns `[tokens*k][rows]`.
/// Routing lists (64-slot tiles, 128 for the wgmma route) come from the MoE kernels.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm(b: &CudaBackend, q: &QuantTensor, up: Option<&QuantTensor>, experts: usize, x: &[f32], tokens: usize, ids: &[u32], k: usize, route: GroupedRoute) -> Result<Vec<f32>> {
    let gpu = &b.gpu;
    if x.len() != tokens * q.cols || ids.len() != tokens * k || !q.rows.is_multiple_of(experts) {
        bail!("grouped_gemm: bad shapes");
    }
    let rows = q.rows / experts;
    let frag = route.row_order() != route;
    let upload = |m: &QuantTensor| if frag { upload_frag_staged(gpu, m) } else { DevQ::upload(gpu, m) };
    let dq = upload(q)?;
    let du = up.map(upload).transpose()?;
    let route = route.row_order();
    let tile = match route {
        GroupedRoute::Wgmma => moe::PrefillExperts::Wg,
        GroupedRoute::WgmmaNarrow => moe::PrefillExperts::WgNarrow,
        GroupedRoute::Tcb | GroupedRoute::Tcp | GroupedRoute::Tcr => moe::PrefillExperts::Tcb,
        GroupedRoute::F32 | GroupedRoute::TensorCore => moe::PrefillExperts::Gemm,
        _ => unreachable!("row_order above"),
    }
    .tile();
    let lists = SlotLists::new(gpu, experts, tokens, ids, k, tile)?;
    let xd = gpu.upload(x)?;
    let (y, tmp) = (gpu.zeros::<f32>(tokens * k * rows)?, gpu.zeros::<f32>(tokens * k * rows)?);
    let (xp, yp, tp) = (ptr(&xd, &gpu.stream), ptr(&y, &gpu.stream), ptr(&tmp, &gpu.stream));
    let g = |xdiv| lists.grouped(xdiv);
    if matches!(route, GroupedRoute::Wgmma | GroupedRoute::WgmmaNarrow) {
        let xs = gpu.zeros::<u32>(tokens * q.cols / 2)?;
        let xsp = ptr(&xs, &gpu.stream);
        moe::stage_wg(gpu, xp, q.cols, tokens, xsp)?;
        let bf16 = |v: u16| f32::from_bits((v as u32) << 16);
        let Some(u) = &du else {
            // bf16 out, read back as f32.
            let yb = gpu.zeros::<u16>(tokens * k * rows)?;
            moe::moe_wg_down(gpu, &dq, rows, xsp, ptr(&yb, &gpu.stream), g(k), tile)?;
            return Ok(read(gpu, &yb)?.into_iter().map(bf16).collect());
        };
        let h = gpu.zeros::<u16>(tokens * k * rows)?;
        moe::moe_wg_glu(gpu, &dq, u, rows, xsp, tokens, ptr(&h, &gpu.stream), g(k), tile)?;
        let h = read(gpu, &h)?;
        return Ok((0..tokens * k * rows).map(|i| bf16(h[(i / rows) * rows + moe::wg_column_pos(i % rows)])).collect());
    }
    if matches!(route, GroupedRoute::Tcb | GroupedRoute::Tcp | GroupedRoute::Tcr) {
        let st = TcbStaging::new(gpu, tokens, q.cols)?;
        qmatmul::stage_tcb(gpu, xp, q.cols, tokens, 0, 1e-6, 0, &st)?;
        // No shared expert: expert number `experts` is in none of the lists.
        let shared = moe::SharedExpert { q: &dq, up: du.as_ref(), expert: experts, base: None };
        let experts_kernel = match route {
            GroupedRoute::Tcb => moe::moe_tcb,
            GroupedRoute::Tcp => moe::moe_tcp,
            _ if !moe::tcr_fits(gpu, q.cols)? => bail!("moe_tcr does not take {} columns", q.cols),
            _ => tcr_rows,
        };
        experts_kernel(gpu, &dq, du.as_ref(), &shared, rows, &st, yp, g(k))?;
        return read(gpu, &y);
    }
    let mm = Gemm::new(gpu, q.group, route == GroupedRoute::F32, None);
    match &du {
        Some(u) => mm.glu(&dq, u, rows, xp, tokens, yp, tp, tokens * k, Some(g(k)))?,
        None => mm.run(&dq, rows, xp, tokens, yp, rows, false, Some(g(k)))?,
    }
    read(gpu, &y)
}

/// The routing lists of `tokens` tokens' `k` slots each (`ids[t*k + j]`) over `experts` experts,
/// in tiles of `tile` slots, built by the MoE kernels.
struct SlotLists {
    /// counts, ids, offsets, fill, list, tiles (the device buffers `r` points into).
    bufs: [CudaSlice<i32>; 6],
    r: RouteLists,
    experts: usize,
    max_tiles: usize,
}

impl SlotLists {
    fn new(gpu: &Gpu, experts: usize, tokens: usize, ids: &[u32], k: usize, tile: usize) -> Result<Self> {
        // The counts are the lists' to write: start them wrong.
        let counts = vec![-1i32; experts];
        let d = MoeDims { e: experts, k, inter: 0, sinter: 0, hidden: 0, group: 0 };
        let max_tiles = moe::tiles_of(tokens, &d, tile);
        let idv: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
        let bufs = [gpu.upload(&counts)?, gpu.upload(&idv)?, gpu.zeros::<i32>(experts)?, gpu.zeros::<i32>(experts)?, gpu.zeros::<i32>(tokens * k)?, gpu.zeros::<i32>(1 + 2 * max_tiles)?];
        let p = |i: usize| ptr(&bufs[i], &gpu.stream);
        let r = RouteLists { logits: 0, top_ids: p(1), top_w: 0, counts: p(0), offsets: p(2), fill: p(3), list: p(4), tiles: p(5) };
        moe::slot_lists(gpu, experts, &r, tokens * k, tile)?;
        Ok(SlotLists { bufs, r, experts, max_tiles })
    }

    /// Each expert's count, first slot and its run of the list.
    fn read(&self, gpu: &Gpu) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let [counts, _, offsets, _, list, _] = &self.bufs;
        Ok((read(gpu, counts)?, read(gpu, offsets)?, read(gpu, list)?))
    }

    fn grouped(&self, xdiv: usize) -> Grouped {
        let r = &self.r;
        Grouped { experts: self.experts, counts: r.counts, offsets: r.offsets, list: r.list, xdiv, tiles: r.tiles, max_tiles: self.max_tiles }
    }
}

/// `q` in fragment order, with its scales and biases in stage order too where they fit (what
/// `moe_tcr` reads over fragment-order codes), as the backend uploads gate and up.
fn upload_frag_staged(gpu: &Gpu, q: &QuantTensor) -> Result<DevQ> {
    DevQ::upload_frag(gpu, q, super::weights::stage_scales_fit(q))
}

/// `moe_tcr` storing its outputs in `y` (the other expert kernels' signature).
#[allow(clippy::too_many_arguments)]
fn tcr_rows(gpu: &Gpu, q: &DevQ, up: Option<&DevQ>, shared: &moe::SharedExpert, rows: usize, st: &TcbStaging, y: u64, g: Grouped) -> Result<()> {
    moe::moe_tcr(gpu, q, up, shared, rows, st, y, g, None)
}

/// The staged input of the down products that `moe_tcr` writes itself (its `staged_out`), and
/// what `stage_tcb` stages from its stored outputs instead: ((fragment words, group sums) of
/// the fused kernel, the same of the two launches), over `tokens * k` slot rows of `q.rows /
/// experts` columns. Same routing as [`grouped_gemm`]; `q` and `up` in fragment order with `frag`.
#[allow(clippy::too_many_arguments)]
pub fn tcr_staged_outputs(b: &CudaBackend, q: &QuantTensor, up: &QuantTensor, experts: usize, x: &[f32], tokens: usize, ids: &[u32], k: usize, frag: bool) -> Result<[(Vec<u32>, Vec<f32>); 2]> {
    let gpu = &b.gpu;
    let rows = q.rows / experts;
    if x.len() != tokens * q.cols || ids.len() != tokens * k || !q.rows.is_multiple_of(experts) || !moe::tcr_fits(gpu, q.cols)? {
        bail!("tcr_staged_outputs: bad shapes");
    }
    let upload = |m: &QuantTensor| if frag { upload_frag_staged(gpu, m) } else { DevQ::upload(gpu, m) };
    let (dq, du) = (upload(q)?, upload(up)?);
    let lists = SlotLists::new(gpu, experts, tokens, ids, k, moe::PrefillExperts::Tcb.tile())?;
    let g = lists.grouped(k);
    let xd = gpu.upload(x)?;
    let st = TcbStaging::new(gpu, tokens, q.cols)?;
    qmatmul::stage_tcb(gpu, ptr(&xd, &gpu.stream), q.cols, tokens, 0, 1e-6, 0, &st)?;
    let shared = moe::SharedExpert { q: &dq, up: Some(&du), expert: experts, base: None };
    let y = gpu.zeros::<f32>(tokens * k * rows)?;
    let yp = ptr(&y, &gpu.stream);
    let (fused, two) = (TcbStaging::new(gpu, tokens * k, rows)?, TcbStaging::new(gpu, tokens * k, rows)?);
    moe::moe_tcr(gpu, &dq, Some(&du), &shared, rows, &st, yp, g, Some(&fused))?;
    moe::moe_tcr(gpu, &dq, Some(&du), &shared, rows, &st, yp, g, None)?;
    qmatmul::stage_tcb(gpu, yp, rows, tokens * k, 0, 1e-6, 0, &two)?;
    Ok([(read(gpu, &fused.frag)?, read(gpu, &fused.gsum)?), (read(gpu, &two.frag)?, read(gpu, &two.gsum)?)])
}

/// A staging's residual rows, fragment words and group sums ([`staged_after_combine`]).
pub type StagedRows = (Vec<f32>, Vec<u32>, Vec<f32>);

/// The batched decode's first staging of a layer with the last MoE layer's output still to add
/// (`stage_tcb_after`), and `moe::combine` then `stage_tcb` as two launches: (residual, fragment
/// words, group sums) of each, over `n` rows of `gain.len()` values. `down`: the rows' k routed
/// outputs `[n * k][h]`, `shared`: the shared expert's `[n][h]`, `sgl`: its gate logits.
#[allow(clippy::too_many_arguments)]
pub fn staged_after_combine(b: &CudaBackend, x: &[f32], down: &[f32], top_w: &[f32], k: usize, shared: &[f32], sgl: &[f32], gain: &[f32], n: usize) -> Result<[StagedRows; 2]> {
    let (gpu, h) = (&b.gpu, gain.len());
    if x.len() != n * h || down.len() != n * k * h || top_w.len() != n * k || shared.len() != n * h || sgl.len() != n {
        bail!("staged_after_combine: bad shapes");
    }
    let (dd, dw, ds, dg, dgain) = (gpu.upload(down)?, gpu.upload(top_w)?, gpu.upload(shared)?, gpu.upload(sgl)?, gpu.upload(gain)?);
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let combine = qmatmul::PendingCombine { down: p(&dd), top_w: p(&dw), k, shared: p(&ds), shared_bf16: false, sgl: p(&dg) };
    let dims = MoeDims { e: 0, k, inter: 0, sinter: 0, hidden: h, group: 64 };
    let mut out = Vec::new();
    for fused in [true, false] {
        let xd = gpu.upload(x)?;
        let st = TcbStaging::new(gpu, n, h)?;
        if fused {
            qmatmul::stage_tcb_after(gpu, p(&xd), h, n, p(&dgain), 1e-6, 0, &st, Some(&combine))?;
        } else {
            moe::combine(gpu, &dims, &combine, p(&xd), n)?;
            qmatmul::stage_tcb(gpu, p(&xd), h, n, p(&dgain), 1e-6, 0, &st)?;
        }
        out.push((read(gpu, &xd)?, read(gpu, &st.frag)?, read(gpu, &st.gsum)?));
    }
    let two = out.pop().expect("two runs");
    Ok([out.pop().expect("two runs"), two])
}

/// What `moe_route_batch` wrote for `n` tokens: router logits `[n][E]`, shared-expert gate
/// logits, top-k ids and weights `[n][k]`, counts and offsets of the E routed experts and the
/// shared one (expert E), the slot list and the tiles `[count, (expert, first slot)...]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRouting {
    pub logits: Vec<f32>,
    pub sgl: Vec<f32>,
    pub top_ids: Vec<i32>,
    pub top_w: Vec<f32>,
    pub counts: Vec<i32>,
    pub offsets: Vec<i32>,
    pub list: Vec<i32>,
    pub tiles: Vec<i32>,
}

/// The batched decode's routing kernel (`moe::route_batch`) on layer `layer`'s router and gate
/// for the `n` rows of `u`, launched `runs` times on the same buffers (the kernel must leave its
/// block counter as it found it); the outputs of each run.
pub fn route_batch(b: &CudaBackend, layer: usize, u: &[f32], n: usize, runs: usize) -> Result<Vec<BatchRouting>> {
    let d = MoeDims::new(&b.cfg);
    let m = &b.w.layers[layer].moe;
    if !moe::batch_supported(m, &d, b.cfg.quant.group_size) {
        bail!("route_batch: bad shapes");
    }
    route_runs(b, &m.router, &m.shared_expert_gate, &d, b.cfg.quant.group_size, u, n, runs, None)
}

/// The routing kernel at any shapes `d` (router `[e][hidden]` and shared-expert gate
/// `[1][hidden]`, groups of `group` columns) for the `n` rows of `u`: on the general kernels, or
/// (`shaped`) on the ones compiled for the 35B's routing shapes.
#[allow(clippy::too_many_arguments)]
pub fn route_batch_at(b: &CudaBackend, router: &QuantTensor, gate: &QuantTensor, d: &MoeDims, group: usize, u: &[f32], n: usize, shaped: bool) -> Result<BatchRouting> {
    let (r, g) = (DevQ::upload(&b.gpu, router)?, DevQ::upload(&b.gpu, gate)?);
    Ok(route_runs(b, &r, &g, d, group, u, n, 1, Some(shaped))?.remove(0))
}

/// `runs` launches of the routing kernel (`shaped`: which one; None: the backend's choice).
#[allow(clippy::too_many_arguments)]
fn route_runs(b: &CudaBackend, router: &DevQ, gate: &DevQ, d: &MoeDims, group: usize, u: &[f32], n: usize, runs: usize, shaped: Option<bool>) -> Result<Vec<BatchRouting>> {
    let gpu = &b.gpu;
    if u.len() != n * d.hidden || router.rows != d.e || router.cols != d.hidden || gate.cols != d.hidden {
        bail!("route_batch: bad shapes");
    }
    let mt = moe::batch_max_tiles(n, d);
    let ud = gpu.upload(u)?;
    let (logits, sgl, top_w) = (gpu.zeros::<f32>(n * d.e)?, gpu.zeros::<f32>(n)?, gpu.zeros::<f32>(n * d.k)?);
    let (top_ids, counts, offsets, fill) = (gpu.zeros::<i32>(n * d.k)?, gpu.zeros::<i32>(d.e + 1)?, gpu.zeros::<i32>(d.e + 1)?, gpu.zeros::<i32>(d.e + 1)?);
    let (list, tiles, done) = (gpu.zeros::<i32>(n * (d.k + 1))?, gpu.zeros::<i32>(1 + 2 * mt)?, gpu.zeros::<u32>(moe::ROUTE_DONE_LEN)?);
    let p = |s: &CudaSlice<i32>| ptr(s, &gpu.stream);
    let f = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let r = RouteLists { logits: f(&logits), top_ids: p(&top_ids), top_w: f(&top_w), counts: p(&counts), offsets: p(&offsets), fill: p(&fill), list: p(&list), tiles: p(&tiles) };
    let mut out = Vec::new();
    for _ in 0..runs {
        let done = ptr(&done, &gpu.stream);
        match shaped {
            None => moe::route_batch(gpu, router, gate, d, group, f(&ud), n, f(&sgl), &r, done)?,
            Some(shaped) => moe::route_batch_on(gpu, router, gate, d, group, f(&ud), n, f(&sgl), &r, done, shaped)?,
        }
        gpu.sync()?;
        let mut t = read(gpu, &tiles)?;
        t.truncate(1 + 2 * t[0].max(0) as usize);
        out.push(BatchRouting {
            logits: read(gpu, &logits)?,
            sgl: read(gpu, &sgl)?,
            top_ids: read(gpu, &top_ids)?,
            top_w: read(gpu, &top_w)?,
            counts: read(gpu, &counts)?,
            offsets: read(gpu, &offsets)?,
            list: read(gpu, &list)?,
            tiles: t,
        });
    }
    Ok(out)
}

/// Drops the dense matrices' bf16 copies ([`super::weights::DevWeights::keep_dense_bf16`]), so
/// the cuBLAS route dequantises per chunk again; returns how many there were.
pub fn drop_dense_bf16(b: &mut CudaBackend) -> usize {
    b.w.dense_matrices().into_iter().filter_map(|q| q.dense_bf16.take()).count()
}

/// The prefill attention kernel alone: `q`, `gate` `[t][nh][hd]` (q already normed and rotated),
/// caches `[pos0 + t][nkv][hd]` given in f32 and kept as the model would (bf16 with `kv_bf16`);
/// returns the gated outputs `[t][nh][hd]`. `exact`: the f32 kernel, else the tensor-core one.
#[allow(clippy::too_many_arguments)]
pub fn chunk_attention(b: &CudaBackend, q: &[f32], gate: &[f32], kc: &[f32], vc: &[f32], t: usize, pos0: usize, nh: usize, nkv: usize, hd: usize, kv_bf16: bool, exact: bool) -> Result<Vec<f32>> {
    let seg = AttnSegmentInput { q: q.to_vec(), gate: gate.to_vec(), kc: kc.to_vec(), vc: vc.to_vec(), t, pos0 };
    Ok(chunk_attention_segments(b, &[seg], nh, nkv, hd, kv_bf16, exact)?.remove(0))
}

/// One sequence's input to [`chunk_attention_segments`]: `t` queries at `pos0..` and its caches
/// of `pos0 + t` positions, laid out as [`chunk_attention`] takes them.
pub struct AttnSegmentInput {
    pub q: Vec<f32>,
    pub gate: Vec<f32>,
    pub kc: Vec<f32>,
    pub vc: Vec<f32>,
    pub t: usize,
    pub pos0: usize,
}

/// One sequence's inputs to [`attention_prep_both_ways`]: `n` rows at positions `pos0..`, the
/// q|gate projection `[n][nh][2 hd]`, raw k and v `[n][nkv hd]`.
pub struct AttnPrepInput {
    pub qg: Vec<f32>,
    pub kraw: Vec<f32>,
    pub vraw: Vec<f32>,
    pub n: usize,
    pub pos0: usize,
}

/// Each sequence's K and V caches, bf16 bits `[positions][nkv hd]`.
pub type CacheBits = Vec<[Vec<u16>; 2]>;

/// What the prefill attention prep writes both ways over the same rows (several sequences in one
/// launch, each with its own bf16 caches): `pf_attn_prep_bf16` (q and the gate in f32) and
/// `pf_attn_prep_q16` (q as the wgmma core's bf16 operand, no gate).
pub struct AttnPrepBothWays {
    /// The f32 prep's q `[rows][nh hd]` and the q16 prep's bf16 bits.
    pub q: Vec<f32>,
    pub q16: Vec<u16>,
    /// Each sequence's caches after either prep, bf16 bits `[pos0 + n][nkv hd]`.
    pub caches: CacheBits,
    pub caches16: CacheBits,
}

/// [`AttnPrepBothWays`] of `segs` with q/k norm weights `q_norm`, `k_norm` (`[hd]`) and RoPE over
/// the first `2 half_rot` channels at base 10,000.
#[allow(clippy::too_many_arguments)]
pub fn attention_prep_both_ways(b: &CudaBackend, segs: &[AttnPrepInput], nh: usize, nkv: usize, hd: usize, half_rot: usize, q_norm: &[f32], k_norm: &[f32]) -> Result<AttnPrepBothWays> {
    let gpu = &b.gpu;
    let rows: usize = segs.iter().map(|s| s.n).sum();
    let cat = |f: fn(&AttnPrepInput) -> &Vec<f32>| segs.iter().flat_map(|s| f(s).iter().copied()).collect::<Vec<f32>>();
    let (qg, kraw, vraw) = (gpu.upload(&cat(|s| &s.qg))?, gpu.upload(&cat(|s| &s.kraw))?, gpu.upload(&cat(|s| &s.vraw))?);
    let (qn, kn) = (gpu.upload(q_norm)?, gpu.upload(k_norm)?);
    let inv: Vec<f64> = (0..half_rot.max(1)).map(|i| 10000f64.powf(-(i as f64) / half_rot as f64)).collect();
    let inv_freq = gpu.upload(&inv)?;
    let d = AttnDims { nh, nkv, hd, half_rot, eps: 1e-6, kv_bf16: true };
    let p = |x: &CudaSlice<f32>| ptr(x, &gpu.stream);
    // q's buffer and the caches after one prep (the q16 prep's bf16 values fill q's first half).
    let run = |q16: bool| -> Result<(Vec<f32>, CacheBits)> {
        let (q, gate) = (gpu.zeros::<f32>(rows * nh * hd)?, gpu.zeros::<f32>(rows * nh * hd)?);
        let caches: Vec<[CudaSlice<u16>; 2]> = segs.iter().map(|s| Ok([gpu.zeros::<u16>((s.pos0 + s.n) * nkv * hd)?, gpu.zeros::<u16>((s.pos0 + s.n) * nkv * hd)?])).collect::<Result<_>>()?;
        let mut r0 = 0;
        let table: Vec<attention::AttnSegment> = segs
            .iter()
            .zip(&caches)
            .map(|(s, [kc, vc])| {
                let seg = attention::AttnSegment { kcache: ptr(kc, &gpu.stream), vcache: ptr(vc, &gpu.stream), r0, n: s.n, pos0: s.pos0 };
                r0 += s.n;
                seg
            })
            .collect();
        let ptrs = AttnPtrs { qg: p(&qg), kraw: p(&kraw), vraw: p(&vraw), q_norm: p(&qn), k_norm: p(&kn), inv_freq: ptr(&inv_freq, &gpu.stream), q: p(&q), gate: p(&gate), kcache: 0, vcache: 0, out: 0 };
        attention::prep_chunk(gpu, &d, &ptrs, &table, q16)?;
        let caches = caches.iter().map(|[k, v]| Ok([gpu.stream.clone_dtoh(k)?, gpu.stream.clone_dtoh(v)?])).collect::<Result<_>>()?;
        Ok((read(gpu, &q)?, caches))
    };
    let (q, caches) = run(false)?;
    let (words, caches16) = run(true)?;
    let q16 = words.iter().flat_map(|v| [v.to_bits() as u16, (v.to_bits() >> 16) as u16]).take(rows * nh * hd).collect();
    Ok(AttnPrepBothWays { q, q16, caches, caches16 })
}

/// The prefill attention over several sequences in one call (their rows back to back, each with
/// its own caches), as a chunk of several prompts runs it; returns each sequence's outputs.
pub fn chunk_attention_segments(b: &CudaBackend, segs: &[AttnSegmentInput], nh: usize, nkv: usize, hd: usize, kv_bf16: bool, exact: bool) -> Result<Vec<Vec<f32>>> {
    let gpu = &b.gpu;
    if attention::select_chunk(hd, kv_bf16, exact, false).is_none() || !attention::chunk_supported(nh, nkv) {
        bail!("chunk_attention: unsupported shape");
    }
    let width = nh * hd;
    if segs.iter().any(|s| s.t == 0 || s.q.len() != s.t * width || s.gate.len() != s.q.len() || s.kc.len() != (s.pos0 + s.t) * nkv * hd || s.vc.len() != s.kc.len()) {
        bail!("chunk_attention: bad shapes");
    }
    let q: Vec<f32> = segs.iter().flat_map(|s| s.q.iter().copied()).collect();
    let gate: Vec<f32> = segs.iter().flat_map(|s| s.gate.iter().copied()).collect();
    let (qd, gd) = (gpu.upload(&q)?, gpu.upload(&gate)?);
    // Each cache as the model keeps it: f32, or bf16 rounded to nearest even.
    let bf16_bits = |x: &[f32]| x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect::<Vec<u16>>();
    let (mut halves, mut floats) = (Vec::new(), Vec::new());
    let mut table = Vec::with_capacity(segs.len());
    let mut r0 = 0;
    for s in segs {
        let (kcache, vcache) = if kv_bf16 {
            halves.push((gpu.upload(&bf16_bits(&s.kc))?, gpu.upload(&bf16_bits(&s.vc))?));
            let (k, v) = halves.last().expect("just pushed");
            (ptr(k, &gpu.stream), ptr(v, &gpu.stream))
        } else {
            floats.push((gpu.upload(&s.kc)?, gpu.upload(&s.vc)?));
            let (k, v) = floats.last().expect("just pushed");
            (ptr(k, &gpu.stream), ptr(v, &gpu.stream))
        };
        table.push(attention::AttnSegment { kcache, vcache, r0, n: s.t, pos0: s.pos0 });
        r0 += s.t;
    }
    let od = gpu.zeros::<f32>(r0 * width)?;
    let rows = attention::chunk_split_rows(nh, nkv, gpu.sms as usize);
    let (po, pml) = (gpu.zeros::<f32>(rows * nh * hd)?, gpu.zeros::<f32>(rows * nh * 2)?);
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let d = AttnDims { nh, nkv, hd, half_rot: 0, eps: 0.0, kv_bf16 };
    let ptrs = AttnPtrs { qg: 0, kraw: 0, vraw: 0, q_norm: 0, k_norm: 0, inv_freq: 0, q: p(&qd), gate: p(&gd), kcache: 0, vcache: 0, out: p(&od) };
    let part = attention::SplitPartials { o: p(&po), ml: p(&pml) };
    attention::chunk(gpu, &d, &ptrs, &part, &table, exact, None, false)?;
    let out = read(gpu, &od)?;
    // Where the launches are unsplit the core can write its outputs only as the out-projection's
    // bf16 operand instead: those must be the f32 outputs rounded to nearest even, bit for bit.
    if !exact && !attention::chunk_splits_keys(gpu, &d, table.iter().map(|s| (s.n, s.pos0)), exact) {
        let sd = gpu.zeros::<u16>(r0 * width)?;
        attention::chunk(gpu, &d, &ptrs, &part, &table, exact, Some(ptr(&sd, &gpu.stream)), false)?;
        let staged = read(gpu, &sd)?;
        let differ = out.iter().zip(&staged).filter(|(v, b)| half::bf16::from_f32(**v).to_bits() != **b).count();
        if differ > 0 {
            bail!("chunk_attention: {differ} of {} bf16 outputs differ from the f32 ones rounded", out.len());
        }
    }
    // Where the launches take the prep's bf16 q (pf_attn_prep_q16: q times the core's scale,
    // rounded) and read the gate from the q|gate projection, the outputs must be the same bits.
    if attention::chunk_takes_q16(gpu, &d, &table, exact) {
        let qscale = d.q16_scale();
        let q16: Vec<u16> = q.iter().map(|&v| half::bf16::from_f32(v * qscale).to_bits()).collect();
        let qg: Vec<f32> = q.chunks(hd).zip(gate.chunks(hd)).flat_map(|(q, g)| q.iter().chain(g).copied()).collect();
        let (q16d, qgd, o16) = (gpu.upload(&q16)?, gpu.upload(&qg)?, gpu.zeros::<f32>(r0 * width)?);
        let ptrs16 = AttnPtrs { q: ptr(&q16d, &gpu.stream), qg: p(&qgd), out: p(&o16), ..ptrs };
        attention::chunk(gpu, &d, &ptrs16, &part, &table, exact, None, true)?;
        let differ = out.iter().zip(&read(gpu, &o16)?).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        if differ > 0 {
            bail!("chunk_attention: {differ} of {} outputs over the bf16 q and the gate in place differ", out.len());
        }
    }
    Ok(table.iter().map(|s| out[s.r0 * width..(s.r0 + s.n) * width].to_vec()).collect())
}

/// The batched decode's attention alone (`split_batch` on `kernel`, then `combine_batch`) over
/// `caches.len()` rows: q and gate `[rows][nh][hd]`, row r's cache `(k, v)` `[len_r][nkv][hd]` given
/// in f32 and kept in bf16, each row at position len_r - 1 (attending to all of its cache), `splits`
/// splits per row. Returns the gated outputs `[rows][nh][hd]`.
#[allow(clippy::too_many_arguments)]
pub fn batch_attention(b: &CudaBackend, q: &[f32], gate: &[f32], caches: &[(Vec<f32>, Vec<f32>)], nh: usize, nkv: usize, hd: usize, splits: usize, kernel: attention::SplitBatch) -> Result<Vec<f32>> {
    let gpu = &b.gpu;
    let rows = caches.len();
    if q.len() != rows * nh * hd || gate.len() != q.len() || splits == 0 || splits > attention::MAX_SPLITS {
        bail!("batch_attention: bad shapes");
    }
    let bf16_bits = |x: &[f32]| x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect::<Vec<u16>>();
    let mut held = Vec::new();
    let (mut kt, mut vt, mut steps) = (Vec::new(), Vec::new(), Vec::new());
    for (k, v) in caches {
        let len = k.len() / (nkv * hd);
        if len == 0 || k.len() != len * nkv * hd || v.len() != k.len() {
            bail!("batch_attention: a cache of {} / {} values", k.len(), v.len());
        }
        let (kd, vd) = (gpu.upload(&bf16_bits(k))?, gpu.upload(&bf16_bits(v))?);
        kt.push(ptr(&kd, &gpu.stream));
        vt.push(ptr(&vd, &gpu.stream));
        held.push((kd, vd));
        steps.extend([0i32, (len - 1) as i32]);
    }
    let (ktab, vtab, sd) = (gpu.upload(&kt)?, gpu.upload(&vt)?, gpu.upload(&steps)?);
    let (qd, gd, od) = (gpu.upload(q)?, gpu.upload(gate)?, gpu.zeros::<f32>(q.len())?);
    let (po, pml) = (gpu.zeros::<f32>(rows * nh * splits * hd)?, gpu.zeros::<f32>(rows * nh * splits * 2)?);
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let d = AttnDims { nh, nkv, hd, half_rot: 0, eps: 0.0, kv_bf16: true };
    let ptrs = AttnPtrs { qg: 0, kraw: 0, vraw: 0, q_norm: 0, k_norm: 0, inv_freq: 0, q: p(&qd), gate: p(&gd), kcache: ptr(&ktab, &gpu.stream), vcache: ptr(&vtab, &gpu.stream), out: p(&od) };
    let part = attention::SplitPartials { o: p(&po), ml: p(&pml) };
    attention::split_batch(gpu, &d, &ptrs, &part, ptr(&sd, &gpu.stream), splits, rows, kernel)?;
    attention::combine_batch(gpu, &d, &ptrs, &part, splits, rows)?;
    let out = read(gpu, &od)?;
    drop(held);
    Ok(out)
}

/// The prefill GDN scan for one value head over T tokens on `path`: q, k `[T][dk]` (normalised, q
/// pre-scaled), v `[T][dv]`, raw gate inputs b, a `[T]`, state `s0` `[dk][dv]`. Returns (outputs
/// `[T][dv]`, final state).
#[allow(clippy::too_many_arguments)]
pub fn gdn_scan(b: &CudaBackend, q: &[f32], k: &[f32], v: &[f32], braw: &[f32], araw: &[f32], dt_bias: f32, neg_a: f32, s0: &[f32], dk: usize, dv: usize, path: gdn::ScanPath) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut out = gdn_scan_segments(b, &[ScanInput { q, k, v, braw, araw, s0 }], dt_bias, neg_a, dk, dv, path)?;
    Ok(out.remove(0))
}

/// One value head's inputs to [`gdn_scan_segments`]: q, k `[T][dk]`, v `[T][dv]`, raw gates b, a
/// `[T]`, initial state `[dk][dv]`.
pub struct ScanInput<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub braw: &'a [f32],
    pub araw: &'a [f32],
    pub s0: &'a [f32],
}

/// Several sequences' scans (one value head each) as the prefill runs a chunk of several
/// segments: their rows one after the other, one launch per [`gdn::SCAN_SEGS`] segments, each on
/// `path` whatever its length, the states stored as the backend's options say (f16 with
/// `gdn_state_f16`: the initial states rounded to f16 on upload, the final ones widened back).
/// Returns each segment's (outputs, final state).
#[allow(clippy::too_many_arguments)]
pub fn gdn_scan_segments(b: &CudaBackend, segs: &[ScanInput], dt_bias: f32, neg_a: f32, dk: usize, dv: usize, path: gdn::ScanPath) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    gdn_scan_segments_with(b, segs, dt_bias, neg_a, dk, dv, path, false)
}

/// [`gdn_scan_segments`] with q, k and v uploaded as the conv writes them for the scan:
/// rounded to bf16 with `inputs_bf16` (the chunked path's bf16 instance reads them so).
#[allow(clippy::too_many_arguments)]
pub fn gdn_scan_segments_with(b: &CudaBackend, segs: &[ScanInput], dt_bias: f32, neg_a: f32, dk: usize, dv: usize, path: gdn::ScanPath, inputs_bf16: bool) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    let gpu = &b.gpu;
    let c = 2 * dk + dv;
    let total: usize = segs.iter().map(|s| s.braw.len()).sum();
    let (mut q, mut k, mut conv, mut braw, mut araw) = (Vec::new(), Vec::new(), vec![0.0f32; total * c], Vec::new(), Vec::new());
    let mut r0 = 0;
    let mut states = Vec::new();
    let mut scans = Vec::new();
    for s in segs {
        let t = s.braw.len();
        q.extend_from_slice(s.q);
        k.extend_from_slice(s.k);
        braw.extend_from_slice(s.braw);
        araw.extend_from_slice(s.araw);
        for i in 0..t {
            conv[(r0 + i) * c + 2 * dk..(r0 + i + 1) * c].copy_from_slice(&s.v[i * dv..(i + 1) * dv]);
        }
        let sd = DevValues::upload(gpu, s.s0, Elem::f16_if(b.opts.gdn_state_f16))?;
        scans.push(gdn::ScanSegment { state: sd.ptr(gpu), r0, n: t });
        states.push(sd);
        r0 += t;
    }
    let up = |v: &[f32]| gpu.upload(v);
    let up_in = |v: &[f32]| DevValues::upload(gpu, v, Elem::bf16_if(inputs_bf16));
    let (qd, kd, cd, bd, ad) = (up_in(&q)?, up_in(&k)?, up_in(&conv)?, up(&braw)?, up(&araw)?);
    let (dtb, nga) = (up(&[dt_bias])?, up(&[neg_a])?);
    let od = gpu.zeros::<f32>(total * dv)?;
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let d = GdnDims { nk: 1, nv: 1, dk, dv, kc: 0, conv_dim: c, eps: 0.0, state_f16: b.opts.gdn_state_f16 };
    let ptrs = GdnPtrs { qkv: 0, z: 0, b: p(&bd), a: p(&ad), ring: 0, taps: 0, dt_bias: p(&dtb), neg_a: p(&nga), norm: 0, state: 0, y: 0 };
    // The chunked scan's scratch as the prefill sizes it for a chunk of these tokens.
    let chunked = GdnChunked::new(gpu, &d, total)?;
    let s = GdnChunkScratch { conv: cd.ptr(gpu), qn: qd.ptr(gpu), kn: kd.ptr(gpu), o: p(&od), chunked: chunked.ptrs(gpu), inputs_bf16 };
    for group in scans.chunks(gdn::SCAN_SEGS) {
        match path {
            gdn::ScanPath::Exact => gdn::scan_exact(gpu, &d, &ptrs, &s, group)?,
            gdn::ScanPath::Chunked => gdn::scan_chunked(gpu, &d, &ptrs, &s, group, &mut |_| Ok(()))?,
        }
    }
    let o = read(gpu, &od)?;
    scans.iter().zip(&states).map(|(sc, sd)| Ok((o[sc.r0 * dv..(sc.r0 + sc.n) * dv].to_vec(), sd.read(gpu)?))).collect()
}

/// f32 values on the device, or their roundings to f16 or bf16 (u16 bits): a scan's state as the
/// backend stores it, prefill activations as a kernel reads them.
enum DevValues {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    Bf16(CudaSlice<u16>),
}

/// The element type of [`DevValues`].
#[derive(Clone, Copy)]
enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    /// f16 where `f16` is set, else f32 (a scan state's element).
    fn f16_if(f16: bool) -> Self {
        if f16 { Elem::F16 } else { Elem::F32 }
    }
    /// bf16 where `bf16` is set, else f32 (a prefill activation's element).
    fn bf16_if(bf16: bool) -> Self {
        if bf16 { Elem::Bf16 } else { Elem::F32 }
    }
}

impl DevValues {
    fn upload(gpu: &Gpu, v: &[f32], elem: Elem) -> Result<Self> {
        Ok(match elem {
            Elem::F32 => DevValues::F32(gpu.upload(v)?),
            Elem::F16 => DevValues::F16(gpu.upload(&v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>())?),
            Elem::Bf16 => DevValues::Bf16(gpu.upload(&v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>())?),
        })
    }
    fn zeros(gpu: &Gpu, n: usize, elem: Elem) -> Result<Self> {
        Ok(match elem {
            Elem::F32 => DevValues::F32(gpu.zeros::<f32>(n)?),
            Elem::F16 => DevValues::F16(gpu.zeros::<u16>(n)?),
            Elem::Bf16 => DevValues::Bf16(gpu.zeros::<u16>(n)?),
        })
    }
    fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            DevValues::F32(s) => ptr(s, &gpu.stream),
            DevValues::F16(s) | DevValues::Bf16(s) => ptr(s, &gpu.stream),
        }
    }
    /// The values as f32 (16-bit ones widened exactly).
    fn read(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        Ok(match self {
            DevValues::F32(s) => read(gpu, s)?,
            DevValues::F16(s) => read(gpu, s)?.into_iter().map(|h| half::f16::from_bits(h).to_f32()).collect(),
            DevValues::Bf16(s) => read(gpu, s)?.into_iter().map(|h| half::bf16::from_bits(h).to_f32()).collect(),
        })
    }
}

/// The shape of a GDN layer's prefill conv: key heads (q and k) and value heads, their dims, taps.
#[derive(Clone, Copy, Debug)]
pub struct GdnConvShape {
    pub nk: usize,
    pub dk: usize,
    pub nv: usize,
    pub dv: usize,
    pub kc: usize,
}

/// One sequence's rows of a [`gdn_conv`] chunk: its q|k|v inputs `[n][conv_dim]` at positions
/// `pos0..`, its conv ring `[kc][conv_dim]` (the inputs before them).
pub struct ConvInput<'a> {
    pub qkv: &'a [f32],
    pub ring: &'a [f32],
    pub pos0: usize,
}

/// What [`gdn_conv`] wrote, widened to f32: the normalised q and k `[rows][nk * dk]`, the value
/// channels `[rows][nv * dv]`, and each sequence's ring after it.
pub struct ConvOutputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub rings: Vec<Vec<f32>>,
}

/// The prefill conv (`gdn::conv`) of several sequences' rows back to back with the layer's taps
/// `[kc][conv_dim]`, writing f32 or (`bf16`) bf16 as the chunked scan's inputs.
pub fn gdn_conv(b: &CudaBackend, shape: GdnConvShape, segs: &[ConvInput], taps: &[f32], bf16: bool) -> Result<ConvOutputs> {
    let gpu = &b.gpu;
    let GdnConvShape { nk, dk, nv, dv, kc } = shape;
    let (key_dim, c) = (nk * dk, 2 * nk * dk + nv * dv);
    if segs.iter().any(|g| g.qkv.len() % c != 0 || g.ring.len() != kc * c) || taps.len() != kc * c {
        bail!("gdn conv: q|k|v rows of {c} channels, rings and taps of {kc} rows");
    }
    let rows: usize = segs.iter().map(|g| g.qkv.len() / c).sum();
    let qkv: Vec<f32> = segs.iter().flat_map(|g| g.qkv.iter().copied()).collect();
    let rings = segs.iter().map(|g| gpu.upload(g.ring)).collect::<Result<Vec<_>>>()?;
    let (qkvd, tapsd) = (gpu.upload(&qkv)?, gpu.upload(taps)?);
    let elem = Elem::bf16_if(bf16);
    let (qn, kn, conv) = (DevValues::zeros(gpu, rows * key_dim, elem)?, DevValues::zeros(gpu, rows * key_dim, elem)?, DevValues::zeros(gpu, rows * c, elem)?);
    let mut r0 = 0;
    let mut convs = Vec::with_capacity(segs.len());
    for (g, ring) in segs.iter().zip(&rings) {
        let n = g.qkv.len() / c;
        convs.push(gdn::ConvSegment { ring: ptr(ring, &gpu.stream), r0, n, pos0: g.pos0 });
        r0 += n;
    }
    let d = GdnDims { nk, nv, dk, dv, kc, conv_dim: c, eps: 0.0, state_f16: false };
    let ptrs = GdnPtrs { qkv: ptr(&qkvd, &gpu.stream), z: 0, b: 0, a: 0, ring: 0, taps: ptr(&tapsd, &gpu.stream), dt_bias: 0, neg_a: 0, norm: 0, state: 0, y: 0 };
    let s = GdnChunkScratch { conv: conv.ptr(gpu), qn: qn.ptr(gpu), kn: kn.ptr(gpu), o: 0, chunked: gdn::ChunkedScratch::default(), inputs_bf16: bf16 };
    gdn::conv(gpu, &d, &ptrs, &s, &convs)?;
    let conv = conv.read(gpu)?;
    let v = conv.chunks_exact(c).flat_map(|r| r[2 * key_dim..].iter().copied()).collect();
    let rings = rings.iter().map(|r| read(gpu, r)).collect::<Result<Vec<_>>>()?;
    Ok(ConvOutputs { q: qn.read(gpu)?, k: kn.read(gpu)?, v, rings })
}

/// The prefill's per-expert slot lists (`moe::slot_lists`: `pf_scan`, `pf_scatter`) of top-k ids
/// `ids` (`[tokens][k]`, experts below `experts`): each expert's slots, in the order listed.
pub fn slot_lists(b: &CudaBackend, ids: &[u32], experts: usize, k: usize) -> Result<Vec<Vec<usize>>> {
    let lists = SlotLists::new(&b.gpu, experts, ids.len() / k, ids, k, 128)?;
    let (counts, offsets, list) = lists.read(&b.gpu)?;
    Ok((0..experts).map(|e| list[offsets[e] as usize..(offsets[e] + counts[e]) as usize].iter().map(|&s| s as usize).collect()).collect())
}

/// The decode graphs `b` holds.
pub fn decode_graphs(b: &CudaBackend) -> usize {
    b.graphs.len()
}

/// Decode graphs kept at once.
pub const MAX_DECODE_GRAPHS: usize = super::MAX_GRAPHS;

/// Decode graphs made another sequence's by updating them in place.
pub fn decode_graph_updates(b: &CudaBackend) -> u64 {
    b.graph_updates
}

/// What a decode graph of `seq` bakes in of it ([`CudaSequence::binding`]).
pub fn binding(seq: &Sequence) -> Vec<u64> {
    seq.state::<CudaSequence>().binding()
}

/// A GDN decode step's inputs at some dims, for [`gdn_step`]: per row the in-projection's
/// q|k|v `[conv_dim]`, z `[nv * dv]`, raw gates b, a `[nv]`, the conv ring `[kc][conv_dim]`, the
/// state `[nv][dk][dv]` and the position; the layer's taps `[kc][conv_dim]`, dt_bias and
/// neg_a `[nv]`, norm weights `[dv]`.
pub struct GdnStepInput {
    pub qkv: Vec<f32>,
    pub z: Vec<f32>,
    pub braw: Vec<f32>,
    pub araw: Vec<f32>,
    pub rings: Vec<Vec<f32>>,
    pub states: Vec<Vec<f32>>,
    pub positions: Vec<i32>,
    pub taps: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub neg_a: Vec<f32>,
    pub norm_w: Vec<f32>,
}

/// What a GDN step wrote: the gated-norm outputs `[rows][nv * dv]`, the staged out-projection
/// inputs of a batched step (bf16 pair words, group sums; empty for one sequence's), and each
/// row's state (widened to f32) and conv ring.
#[derive(Debug, PartialEq)]
pub struct GdnStepOutput {
    pub y: Vec<f32>,
    pub frag: Vec<u32>,
    pub gsum: Vec<f32>,
    pub states: Vec<Vec<f32>>,
    pub rings: Vec<Vec<f32>>,
}

/// Which GDN decode step [`gdn_step`] runs: one sequence's (`gdn_step`; one row) or a batched
/// one (`kernel`: a block per item or persistent blocks) with its outputs staged for the
/// out-projection as the decode does; each the general instance or (`shaped`) the one compiled
/// for the 35B's head shapes.
#[derive(Clone, Copy, Debug)]
pub enum GdnStepKernel {
    One { shaped: bool },
    Batch { kernel: gdn::StepBatchKernel, shaped: bool },
}

/// One GDN decode step of `inp`'s rows at `d`'s dims on `kernel`. The states are stored as
/// `d.state_f16` says (rounded to f16 on upload).
pub fn gdn_step(b: &CudaBackend, d: &GdnDims, inp: &GdnStepInput, kernel: GdnStepKernel) -> Result<GdnStepOutput> {
    let gpu = &b.gpu;
    let rows = inp.positions.len();
    let (vd, c) = (d.nv * d.dv, d.conv_dim);
    let shapes_ok = inp.qkv.len() == rows * c
        && inp.z.len() == rows * vd
        && inp.braw.len() == rows * d.nv
        && inp.araw.len() == rows * d.nv
        && inp.rings.iter().all(|r| r.len() == d.kc * c)
        && inp.states.iter().all(|s| s.len() == d.nv * d.dk * d.dv)
        && inp.rings.len() == rows
        && inp.states.len() == rows
        && inp.taps.len() == d.kc * c
        && inp.dt_bias.len() == d.nv
        && inp.neg_a.len() == d.nv
        && inp.norm_w.len() == d.dv;
    if !shapes_ok || (matches!(kernel, GdnStepKernel::One { .. }) && rows != 1) {
        bail!("gdn_step: bad shapes");
    }
    let up = |v: &[f32]| gpu.upload(v);
    let rings = inp.rings.iter().map(|r| up(r)).collect::<Result<Vec<_>>>()?;
    let states = inp.states.iter().map(|s| DevValues::upload(gpu, s, Elem::f16_if(d.state_f16))).collect::<Result<Vec<_>>>()?;
    // The batched step reads the rows' rings and states through tables, one sequence's directly.
    let ring_tab = gpu.upload(&rings.iter().map(|r| ptr(r, &gpu.stream)).collect::<Vec<u64>>())?;
    let state_tab = gpu.upload(&states.iter().map(|s| s.ptr(gpu)).collect::<Vec<u64>>())?;
    let (ring, state) = match kernel {
        GdnStepKernel::One { .. } => (ptr(&rings[0], &gpu.stream), states[0].ptr(gpu)),
        GdnStepKernel::Batch { .. } => (ptr(&ring_tab, &gpu.stream), ptr(&state_tab, &gpu.stream)),
    };
    let steps = gpu.upload(&inp.positions.iter().flat_map(|&p| [0, p]).collect::<Vec<i32>>())?;
    let (qkv, z, bd, ad) = (up(&inp.qkv)?, up(&inp.z)?, up(&inp.braw)?, up(&inp.araw)?);
    let (taps, dtb, nga, nw) = (up(&inp.taps)?, up(&inp.dt_bias)?, up(&inp.neg_a)?, up(&inp.norm_w)?);
    let y = gpu.zeros::<f32>(rows * vd)?;
    let staged = TcbStaging::new(gpu, rows, vd)?;
    let p = |s: &CudaSlice<f32>| ptr(s, &gpu.stream);
    let ptrs = GdnPtrs {
        qkv: p(&qkv),
        z: p(&z),
        b: p(&bd),
        a: p(&ad),
        ring,
        taps: p(&taps),
        dt_bias: p(&dtb),
        neg_a: p(&nga),
        norm: p(&nw),
        state,
        y: p(&y),
    };
    let (frag, gsum) = match kernel {
        GdnStepKernel::One { shaped } => {
            gdn::step_with(gpu, d, &ptrs, ptr(&steps, &gpu.stream), shaped)?;
            (Vec::new(), Vec::new())
        }
        GdnStepKernel::Batch { kernel, shaped } => {
            gdn::step_batch_with(gpu, d, &ptrs, ptr(&steps, &gpu.stream), rows, Some(&staged), kernel, shaped)?;
            (read(gpu, &staged.frag)?, read(gpu, &staged.gsum)?)
        }
    };
    Ok(GdnStepOutput {
        y: read(gpu, &y)?,
        frag,
        gsum,
        states: states.iter().map(|s| s.read(gpu)).collect::<Result<_>>()?,
        rings: rings.iter().map(|r| read(gpu, r)).collect::<Result<_>>()?,
    })
}
