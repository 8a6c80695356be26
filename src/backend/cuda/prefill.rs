//! Prefill (T > 1): every layer processes all tokens of a chunk at once (design in
//! docs/cuda-prefill.md). Per chunk of up to `prefill_chunk` tokens at positions
//! `pos0..pos0 + n`: embed → per layer { RMSNorm → projections (qmatmul.rs: f32 tiles, bf16
//! tensor cores, or cuBLAS on dequantised weights for long chunks) → GDN (conv with the ring's
//! history, L2 norms, the recurrence exact or in 64-token chunks, gated norm) or attention (norms + RoPE + KV append, causal
//! flash attention) → out-projection added into the residual → RMSNorm → router → GPU top-k and
//! per-expert slot lists → grouped expert GEMMs → shared expert → weighted combine } → final
//! norm and lm_head only for the rows whose logits are wanted. The sequence state is left exactly as the
//! decode step expects it.

use super::activations::{Activations, ChunkScratch};
use super::attention;
use super::blas::Blas;
use super::device::{ptr, Gpu};
use super::attention::{AttnDims, AttnSegment};
use super::forward::{self, LayerDims, LayerStates, Pass, Point, Probe};
use super::gdn::{self, ConvSegment, GdnChunkScratch, GdnDims, ScanSegment};
use super::moe::PrefillExperts;
use super::moe;
use super::ops;
use super::qmatmul::{self, FewRows, Gemm, Grouped, PendingCombine};
use super::state::CudaSequence;
use super::weights::{DevAttn, DevGdn, DevLayer, DevMixer, DevMoe, DevWeights};
use crate::checkpoint::ModelConfig;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, CudaStream, CudaView};

/// Rows of logits computed per lm_head pass when all positions' logits are wanted.
const LOGIT_ROWS: usize = 64;

/// Whether the prefill kernels take this model's shapes (otherwise the backend runs the decode
/// step per token).
pub fn supported(cfg: &ModelConfig) -> bool {
    gdn::chunk_supported(&GdnDims::new(cfg)) && attention::chunk_supported(cfg.num_attention_heads, cfg.num_key_value_heads)
}

/// Buffers of prefill chunks, kept across calls and grown when a call needs more.
pub struct ChunkBuffers {
    act: Activations,
    scratch: ChunkScratch,
}

impl ChunkBuffers {
    /// Buffers for chunks of `tokens` tokens and `logit_rows` rows of logits, reusing `old` when it
    /// is large enough (it is dropped before the new ones are allocated).
    pub fn fit(old: &mut Option<ChunkBuffers>, gpu: &Gpu, cfg: &ModelConfig, tokens: usize, logit_rows: usize, blas: bool) -> Result<()> {
        let (cap, rows) = match old.as_ref() {
            Some(b) if b.act.tokens >= tokens && b.act.logit_rows >= logit_rows => return Ok(()),
            Some(b) => (b.act.tokens.max(tokens), b.act.logit_rows.max(logit_rows)),
            None => (tokens, logit_rows),
        };
        *old = None;
        *old = Some(ChunkBuffers { act: Activations::new(gpu, cfg, cap, rows)?, scratch: ChunkScratch::new(gpu, cfg, cap, blas)? });
        Ok(())
    }
}

/// One sequence's tokens in a chunk: rows `r0..r0 + n` of the chunk's activations, at positions
/// `pos0..pos0 + n` of `seq`. A chunk holds one segment per sequence it feeds.
pub struct Segment<'a> {
    pub seq: &'a CudaSequence,
    pub r0: usize,
    pub n: usize,
    pub pos0: usize,
}

/// The segments' layer states, for `forward::layers`: it checks every segment's sequence against
/// the model's layer kinds. The chunk pass takes each segment's own states from its sequence.
struct Segments<'s, 'a>(&'s [Segment<'a>]);

impl LayerStates for Segments<'_, '_> {
    fn layer(&self, li: usize, mixer: &DevMixer, st: &CudaStream) -> Result<(u64, u64)> {
        let mut first = None;
        for seg in self.0 {
            let p = seg.seq.layer(li, mixer, st)?;
            first.get_or_insert(p);
        }
        first.ok_or_else(|| anyhow!("a prefill chunk with no tokens"))
    }
}

/// The prefill launches of one chunk: the projections, norms and experts over all its rows, the
/// GDN conv and the attention per segment and the GDN scans of all segments side by side (each
/// over its own sequence's state).
struct ChunkPass<'a> {
    gpu: &'a Gpu,
    w: &'a DevWeights,
    act: &'a Activations,
    s: &'a ChunkScratch,
    gemm: Gemm<'a>,
    rows: usize,
    segments: &'a [Segment<'a>],
    exact: bool,
    tcb_prefill_tokens: usize,
    fuse_combine_norm: bool,
    dims: LayerDims,
    /// The last MoE layer's output, added into the residual by the next layer's input norm
    /// (`moe::combine_norm_bf16`) where the long chunks' route wrote it in bf16.
    pending: Option<PendingCombine>,
}

impl ChunkPass<'_> {
    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.gpu.stream)
    }

    /// `u = RMSNorm(x) * gain`, staged in bf16 for the cuBLAS GEMMs that read it, after adding
    /// the pending MoE output into `x`.
    fn norm(&mut self, gain: &CudaSlice<f32>, probe: &mut Probe) -> Result<()> {
        self.norm_staging(gain, None, probe)
    }

    /// [`Self::norm`], its outputs also staged for the wgmma expert kernels at `wg`
    /// ([`moe::stage_wg`]'s words) where given.
    fn norm_staging(&mut self, gain: &CudaSlice<f32>, wg: Option<u64>, probe: &mut Probe) -> Result<()> {
        let (n, h) = (self.rows, self.w.embed.cols);
        let (x, g, u) = (self.p(&self.act.x), self.p(gain), self.p(&self.act.u));
        let staged = self.gemm.stage_target(u, n, h);
        match self.pending.take() {
            Some(out) => {
                moe::combine_norm_bf16(self.gpu, &self.dims.moe, &out, x, g, u, staged, n, self.dims.eps)?;
                if let Some(wg) = wg {
                    moe::stage_wg(self.gpu, u, h, n, wg)?;
                }
            }
            None => ops::rms_norm(self.gpu, x, g, u, n, h, self.dims.eps, staged, wg)?,
        }
        self.point(probe, Point::Phase("norm"))
    }
}

impl Pass for ChunkPass<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn residual(&self) -> (&CudaSlice<f32>, usize) {
        (&self.act.x, self.rows * self.w.embed.cols)
    }

    fn embed(&mut self, probe: &mut Probe) -> Result<()> {
        qmatmul_embed(self)?;
        self.point(probe, Point::Phase("embed"))
    }

    fn gdn(&mut self, li: usize, lw: &DevLayer, g: &DevGdn, _ring: u64, _state: u64, probe: &mut Probe) -> Result<()> {
        let (a, n, d) = (self.act, self.rows, self.dims.gdn);
        let (u, h) = (self.p(&a.u), self.w.embed.cols);
        self.norm(&lw.input_norm, probe)?;
        let (cdim, vd, nv) = (d.conv_dim, d.nv * d.dv, d.nv);
        self.gemm.run(&g.in_qkv, cdim, u, n, self.p(&a.qkv), cdim, false, None)?;
        // z in bf16 where it comes from cuBLAS: only the gated norm reads it (q|k|v stay f32:
        // rounding them ahead of the conv and the L2 norms moved the trained fixture's PPL past
        // its bound, docs/cuda-prefill.md).
        let z_bf16 = self.gemm.run_bf16_out(&g.in_z, vd, u, n, self.p(&a.z), vd)?;
        let b = FewRows { q: &g.in_b, rows: nv, y: self.p(&a.b), ldy: nv };
        let gate_a = FewRows { q: &g.in_a, rows: nv, y: self.p(&a.a), ldy: nv };
        self.gemm.few_rows(&[b, gate_a], u, n)?;
        self.point(probe, Point::Phase("gdn.proj"))?;
        // The segments' convs (each its own ring) into their rows of the scratch, then one scan
        // over all segments side by side (each its own state), then the norm over all rows.
        let (mut convs, mut scans) = (Vec::with_capacity(self.segments.len()), Vec::with_capacity(self.segments.len()));
        for seg in self.segments {
            let (ring, state) = seg.seq.layer_ptrs(li);
            convs.push(ConvSegment { ring, r0: seg.r0, n: seg.n, pos0: seg.pos0 });
            scans.push(ScanSegment { state, r0: seg.r0, n: seg.n });
        }
        let chunked = self.s.gdn_chunked.ptrs(self.gpu);
        let inputs_bf16 = gdn::scan_inputs_bf16(&d, &scans, self.exact);
        let s = GdnChunkScratch { conv: self.p(&self.s.conv), qn: self.p(&self.s.qn), kn: self.p(&self.s.kn), o: self.p(&self.s.o), chunked, inputs_bf16 };
        let all = forward::gdn_ptrs(self.gpu, a, g, 0, 0);
        gdn::conv(self.gpu, &d, &all, &s, &convs)?;
        self.point(probe, Point::Phase("gdn.conv"))?;
        // The profile splits the chunked scan's prep from its walk.
        gdn::scan(self.gpu, &d, &all, &s, &scans, self.exact, &mut |name| self.point(probe, Point::Phase(name)))?;
        self.point(probe, Point::Phase("gdn.scan"))?;
        // Where the out-projection runs on cuBLAS the norm writes only its bf16 operand, so no
        // other GEMM may run between the two.
        let staged = self.gemm.stage_input(&g.out, h, self.p(&a.y), n);
        gdn::gated_norm(self.gpu, &d, &all, &s, n, z_bf16, staged)?;
        self.point(probe, Point::Phase("gdn.norm"))?;
        self.gemm.run(&g.out, h, self.p(&a.y), n, self.p(&a.x), h, true, None)?;
        self.point(probe, Point::Phase("gdn.out"))
    }

    fn attention(&mut self, li: usize, lw: &DevLayer, at: &DevAttn, _kcache: u64, _vcache: u64, probe: &mut Probe) -> Result<()> {
        let (a, n) = (self.act, self.rows);
        let (u, h) = (self.p(&a.u), self.w.embed.cols);
        self.norm(&lw.input_norm, probe)?;
        let (qrows, kvd) = (at.q.rows, at.k.rows);
        self.gemm.run(&at.q, qrows, u, n, self.p(&a.qkv), qrows, false, None)?;
        self.gemm.run(&at.k, kvd, u, n, self.p(&a.kraw), kvd, false, None)?;
        self.gemm.run(&at.v, kvd, u, n, self.p(&a.vraw), kvd, false, None)?;
        self.point(probe, Point::Phase("attn.proj"))?;
        let part = attention::SplitPartials { o: self.p(&self.s.attn_part_o), ml: self.p(&self.s.attn_part_ml) };
        let p = forward::attn_ptrs(self.gpu, a, at, self.w, 0, 0);
        // Where the out-projection runs on cuBLAS and no segment splits its keys, the core writes
        // only the projection's bf16 operand, so no other GEMM may run between the two.
        let unsplit = !attention::chunk_splits_keys(self.gpu, &self.dims.attn, self.segments.iter().map(|s| (s.n, s.pos0)), self.exact);
        let staged = if unsplit { self.gemm.stage_input(&at.o, h, self.p(&a.y), n) } else { None };
        // The segments in runs of one KV element type (a launch reads one), each run's prep and
        // core over all its segments.
        for run in self.segments.chunk_by(|x, y| x.seq.kv_bf16 == y.seq.kv_bf16) {
            let d = AttnDims { kv_bf16: run[0].seq.kv_bf16, ..self.dims.attn };
            let segs: Vec<AttnSegment> = run
                .iter()
                .map(|seg| {
                    let (kcache, vcache) = seg.seq.layer_ptrs(li);
                    AttnSegment { kcache, vcache, r0: seg.r0, n: seg.n, pos0: seg.pos0 }
                })
                .collect();
            // On the wgmma core the prep writes q as the core's operand and leaves the gate where
            // the projection put it.
            let q16 = attention::chunk_takes_q16(self.gpu, &d, &segs, self.exact);
            attention::prep_chunk(self.gpu, &d, &p, &segs, q16)?;
            self.point(probe, Point::Phase("attn.prep"))?;
            attention::chunk(self.gpu, &d, &p, &part, &segs, self.exact, staged, q16)?;
            self.point(probe, Point::Phase("attn.core"))?;
        }
        self.gemm.run(&at.o, h, self.p(&a.y), n, self.p(&a.x), h, true, None)?;
        self.point(probe, Point::Phase("attn.out"))
    }

    fn moe(&mut self, li: usize, lw: &DevLayer, m: &DevMoe, probe: &mut Probe) -> Result<()> {
        let (a, s, n, d) = (self.act, self.s, self.rows, self.dims.moe);
        let (u, h, k) = (self.p(&a.u), d.hidden, d.k);
        let route = moe::prefill_experts(n, self.exact, self.tcb_prefill_tokens, moe::WG_NARROW_TOKENS, moe::staged_experts_fit(m, &d));
        // The wgmma route's slots' inputs in bf16, wgmma order, in the staging buffers of the
        // short chunks' route: staged by the norm.
        let (xw, hw) = (self.p(&s.tcb_tokens.frag), self.p(&s.tcb_slots.frag));
        self.norm_staging(&lw.post_norm, route.wgmma().then_some(xw), probe)?;
        let tile = route.tile();
        let r = moe::gate_and_route(self.gpu, &self.gemm, m, &d, a, s, n, tile)?;
        self.point(probe, Point::Phase("moe.route"))?;
        let (eg, eu, ed) = (self.p(&s.expert_gate), self.p(&s.expert_up), self.p(&s.expert_down));
        let grouped = |xdiv| Grouped { max_tiles: moe::tiles_of(n, &d, tile), ..r.grouped(&d, n, xdiv) };
        match route {
            PrefillExperts::Tcb => {
                // Passes over staged bf16 inputs (the shared expert runs below as a dense
                // product, so none of the lists' experts is it).
                let none = |q, up| moe::SharedExpert { q, up, expert: usize::MAX, base: None };
                qmatmul::stage_tcb(self.gpu, u, h, n, 0, self.dims.eps, 0, &s.tcb_tokens)?;
                moe::moe_tcb(self.gpu, &m.gate_exps, Some(&m.up_exps), &none(&m.shared_gate, Some(&m.shared_up)), d.inter, &s.tcb_tokens, eg, grouped(k))?;
                self.point(probe, Point::Phase("moe.gate_up"))?;
                qmatmul::stage_tcb(self.gpu, eg, d.inter, n * k, 0, self.dims.eps, 0, &s.tcb_slots)?;
                // Persistent blocks for down, as in the batched decode (one item per warp otherwise).
                moe::moe_tcp(self.gpu, &m.down_exps, None, &none(&m.shared_down, None), h, &s.tcb_slots, ed, grouped(1))?;
                self.point(probe, Point::Phase("moe.down"))?;
            }
            PrefillExperts::Wg | PrefillExperts::WgNarrow => {
                moe::moe_wg_glu(self.gpu, &m.gate_exps, &m.up_exps, d.inter, xw, n, hw, grouped(k), tile)?;
                self.point(probe, Point::Phase("moe.gate_up"))?;
                moe::moe_wg_down(self.gpu, &m.down_exps, h, hw, ed, grouped(1), tile)?;
                self.point(probe, Point::Phase("moe.down"))?;
            }
            PrefillExperts::Gemm => {
                self.gemm.glu(&m.gate_exps, &m.up_exps, d.inter, u, n, eg, eu, n * k, Some(grouped(k)))?;
                self.point(probe, Point::Phase("moe.gate_up"))?;
                self.gemm.run(&m.down_exps, h, eg, n, ed, h, false, Some(grouped(1)))?;
                self.point(probe, Point::Phase("moe.down"))?;
            }
        }
        let (sg, su, sd) = (self.p(&s.shared_gate), self.p(&s.shared_up), self.p(&s.shared_down));
        self.gemm.glu_then(&m.shared_gate, &m.shared_up, d.sinter, u, n, sg, su, n, None, Some((&m.shared_down, h)))?;
        // The shared expert's outputs in bf16 where they come from cuBLAS and the combine takes
        // them so (the one over the wgmma route's bf16 routed outputs).
        let shared_bf16 = if route.wgmma() {
            self.gemm.run_bf16_out(&m.shared_down, h, sg, n, sd, h)?
        } else {
            self.gemm.run(&m.shared_down, h, sg, n, sd, h, false, None)?;
            false
        };
        self.point(probe, Point::Phase("shared"))?;
        let out = PendingCombine { down: ed, top_w: r.top_w, k: d.k, shared: sd, shared_bf16, sgl: self.p(&a.sgl) };
        if route.wgmma() && self.fuse_combine_norm && li + 1 < self.w.layers.len() && moe::combine_norm_fits(h) && probe.trace.is_none() {
            // Added into x by the next layer's input norm, in the same launch (a trace reads x
            // at each layer's end: then it is added here).
            self.pending = Some(out);
            return Ok(());
        }
        if route.wgmma() {
            moe::combine_bf16_down(self.gpu, &d, &out, self.p(&a.x), n)?;
        } else {
            moe::combine(self.gpu, &d, &out, self.p(&a.x), n)?;
        }
        self.point(probe, Point::Phase("combine"))
    }
}

fn qmatmul_embed(pass: &ChunkPass) -> Result<()> {
    let (ids, x) = (pass.p(&pass.s.ids), pass.p(&pass.act.x));
    super::qmatmul::embed_rows(pass.gpu, &pass.w.embed, pass.dims.group, ids, 1, pass.rows, x)
}

/// Where a chunk's logits go: rows `r0..r1` of the chunk, computed `LOGIT_ROWS` at a time.
fn logit_rows(wanted: crate::backend::LogitsWanted, n: usize, last_chunk: bool) -> Option<(usize, usize)> {
    use crate::backend::LogitsWanted;
    match wanted {
        LogitsWanted::All => Some((0, n)),
        LogitsWanted::Last if last_chunk => Some((n - 1, n)),
        _ => None,
    }
}

/// Everything a prefill call reads from the backend.
pub struct Prefill<'a> {
    pub gpu: &'a Gpu,
    pub cfg: &'a ModelConfig,
    pub w: &'a DevWeights,
    pub blas: Option<&'a Blas>,
    pub cublas_min_tokens: usize,
    pub tcb_prefill_tokens: usize,
    /// The long chunks' MoE output added into the residual by the next layer's input norm.
    pub fuse_combine_norm: bool,
    pub chunk: usize,
    pub exact: bool,
    /// The sequences' GDN states are f16 (`CudaOptions::gdn_state_f16`).
    pub gdn_state_f16: bool,
    pub profile: bool,
}

/// A piece of a prefill call: `tokens` fed at position `pos` of `seq`.
pub struct Piece<'a> {
    pub seq: &'a CudaSequence,
    pub pos: usize,
    pub tokens: &'a [u32],
}

/// The chunks of a call over pieces of `lens` tokens: each chunk takes, in piece order, the next
/// tokens of every piece with tokens left, up to `chunk` tokens in all; entries are (piece, first
/// token, tokens). So a piece appears at most once per chunk and its tokens go in in order, and
/// one piece is cut into consecutive chunks of `chunk` tokens.
pub fn plan_chunks(lens: &[usize], chunk: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let chunk = chunk.max(1);
    let mut fed = vec![0usize; lens.len()];
    let mut plan = Vec::new();
    loop {
        let (mut room, mut c) = (chunk, Vec::new());
        for (i, &len) in lens.iter().enumerate() {
            let k = (len - fed[i]).min(room);
            if k > 0 {
                c.push((i, fed[i], k));
                fed[i] += k;
                room -= k;
            }
        }
        if c.is_empty() {
            return plan;
        }
        plan.push(c);
    }
}

impl Prefill<'_> {
    /// Runs the pieces (validated: tokens in vocabulary, room in each sequence, each sequence
    /// once) through the model in chunks ([`plan_chunks`]); returns the wanted logits as the
    /// `Backend` trait does, which only a call of one piece may want.
    pub fn run(&self, bufs: &mut Option<ChunkBuffers>, pieces: &[Piece], wanted: crate::backend::LogitsWanted) -> Result<Vec<f32>> {
        use crate::backend::LogitsWanted;
        if pieces.len() != 1 && wanted != LogitsWanted::None {
            bail!("a prefill of several sequences returns no logits");
        }
        let total = pieces.first().map_or(0, |p| p.tokens.len());
        let logit_rows_cap = |nmax: usize| if wanted == LogitsWanted::All { nmax.min(LOGIT_ROWS) } else { 1 };
        let mut out = Vec::new();
        self.chunks(bufs, pieces, logit_rows_cap, |this, b, c, probe| {
            if let [(0, start, n)] = c[..] {
                if let Some((r0, r1)) = logit_rows(wanted, n, start + n == total) {
                    out.extend(this.logits(b, r0, r1, probe)?);
                }
            }
            Ok(())
        })?;
        self.gpu.sync()?;
        Ok(out)
    }

    /// Runs one piece (validated) through the model as [`Prefill::run`] does, without logits,
    /// and returns its last token's final residual row (f32, `hidden_size` values; valid until
    /// the next prefill call): the decode step's head and token choice take it from there
    /// (`decode::finish_from_row`). The stream is not synchronised: what reads the row queues
    /// behind the prefill.
    pub fn run_to_last_row<'b>(&self, bufs: &'b mut Option<ChunkBuffers>, piece: &Piece) -> Result<CudaView<'b, f32>> {
        let mut last = None;
        self.chunks(bufs, std::slice::from_ref(piece), |_| 1, |_, _, c, _| {
            last = c.last().map(|&(_, _, n)| n - 1);
            Ok(())
        })?;
        let (Some(last), Some(b)) = (last, bufs.as_ref()) else {
            bail!("a prefill of no tokens has no last row");
        };
        let h = self.cfg.hidden_size;
        Ok(b.act.x.slice(last * h..(last + 1) * h))
    }

    /// The pieces' chunks ([`plan_chunks`]) through the layers, `after` called once each chunk's
    /// layers are queued (its rows' final residuals in the buffers' `x`); `logit_rows` sizes the
    /// logits buffer from the largest chunk's token count.
    fn chunks(
        &self,
        bufs: &mut Option<ChunkBuffers>,
        pieces: &[Piece],
        logit_rows: impl Fn(usize) -> usize,
        mut after: impl FnMut(&Self, &ChunkBuffers, &[(usize, usize, usize)], &mut Probe) -> Result<()>,
    ) -> Result<()> {
        pieces.iter().try_for_each(|p| p.seq.check_gdn_state(self.gdn_state_f16))?;
        let gpu = self.gpu;
        let lens: Vec<usize> = pieces.iter().map(|p| p.tokens.len()).collect();
        let plan = plan_chunks(&lens, self.chunk);
        let nmax = plan.iter().map(|c| c.iter().map(|e| e.2).sum::<usize>()).max().unwrap_or(0);
        ChunkBuffers::fit(bufs, gpu, self.cfg, nmax, logit_rows(nmax), self.blas.is_some())?;
        let b = bufs.as_mut().expect("fitted above");
        let mut probe = Probe::profiling(self.profile);
        for c in &plan {
            let mut segments = Vec::with_capacity(c.len());
            let mut ids: Vec<i32> = Vec::with_capacity(nmax);
            for &(i, start, n) in c {
                let p = &pieces[i];
                segments.push(Segment { seq: p.seq, r0: ids.len(), n, pos0: p.pos + start });
                ids.extend(p.tokens[start..start + n].iter().map(|&t| t as i32));
            }
            gpu.stream.memcpy_htod(&ids, &mut b.scratch.ids).map_err(|e| anyhow!("token upload: {e:?}"))?;
            self.chunk_layers(b, ids.len(), &segments, &mut probe)?;
            after(self, b, c, &mut probe)?;
        }
        if self.profile {
            gpu.sync()?;
            report(&probe.phase_ms(gpu)?, lens.iter().sum());
        }
        Ok(())
    }

    fn chunk_layers(&self, b: &ChunkBuffers, rows: usize, segments: &[Segment], probe: &mut Probe) -> Result<()> {
        let blas = self.blas.and_then(|l| b.scratch.blas.as_ref().map(|s| (l, s, self.cublas_min_tokens)));
        let mut pass = ChunkPass {
            gpu: self.gpu,
            w: self.w,
            act: &b.act,
            s: &b.scratch,
            gemm: Gemm::new(self.gpu, self.cfg.quant.group_size, self.exact, blas).few_inputs_f16(self.w.few_inputs_f16),
            rows,
            segments,
            exact: self.exact,
            tcb_prefill_tokens: self.tcb_prefill_tokens,
            fuse_combine_norm: self.fuse_combine_norm,
            // Each segment's attention reads its own sequence's KV type.
            dims: LayerDims::new(self.cfg, false, self.gdn_state_f16),
            pending: None,
        };
        forward::layers(&mut pass, self.w, &Segments(segments), probe)
    }

    /// Final norm + lm_head of chunk rows `r0..r1`, to the host. The lm_head stays on the fused
    /// kernels: its bf16 copy for cuBLAS would need ~1 GB of scratch.
    fn logits(&self, b: &ChunkBuffers, r0: usize, r1: usize, probe: &mut Probe) -> Result<Vec<f32>> {
        let (gpu, st) = (self.gpu, &self.gpu.stream);
        let (h, vocab, eps) = (self.cfg.hidden_size, self.cfg.vocab_size, self.cfg.rms_norm_eps as f32);
        let gemm = Gemm::new(gpu, self.cfg.quant.group_size, self.exact, None);
        let mut out = Vec::with_capacity((r1 - r0) * vocab);
        let mut r = r0;
        while r < r1 {
            let m = (r1 - r).min(b.act.logit_rows);
            let xr = ptr(&b.act.x, st) + (r * h * 4) as u64;
            let ur = ptr(&b.act.u, st);
            ops::rms_norm(gpu, xr, ptr(&self.w.final_norm, st), ur, m, h, eps, None, None)?;
            gemm.run(&self.w.lm_head, vocab, ur, m, ptr(&b.act.logits, st), vocab, false, None)?;
            probe.at(gpu, Point::Phase("head"), &b.act.x, 0)?;
            let mut host = vec![0.0f32; m * vocab];
            st.memcpy_dtoh(&b.act.logits.slice(0..m * vocab), &mut host).map_err(|e| anyhow!("CUDA error during prefill: {e:?}"))?;
            gpu.sync()?;
            out.extend(host);
            r += m;
        }
        Ok(out)
    }
}

/// The prefill phase profile on stderr.
fn report(phases: &[(&'static str, f64)], tokens: usize) {
    let total: f64 = phases.iter().map(|(_, t)| t).sum();
    eprintln!("lily: CUDA prefill profile, {tokens} tokens: {total:.2} ms GPU ({:.0} tok/s)", tokens as f64 / (total / 1000.0));
    for (name, t) in phases {
        eprintln!("  {name:<14} {t:>9.3} ms  {:>5.1}%", 100.0 * t / total);
    }
}

#[cfg(test)]
mod tests {
    use super::plan_chunks;

    #[test]
    fn chunks_take_every_piece_in_order_once_per_chunk() {
        // One piece: consecutive chunks.
        assert_eq!(plan_chunks(&[10], 4), vec![vec![(0, 0, 4)], vec![(0, 4, 4)], vec![(0, 8, 2)]]);
        // Several: each chunk fills from the pieces in order; a piece cut by the chunk's end goes
        // on first in the next one.
        assert_eq!(plan_chunks(&[3, 5, 2], 6), vec![vec![(0, 0, 3), (1, 0, 3)], vec![(1, 3, 2), (2, 0, 2)]]);
        assert_eq!(plan_chunks(&[2, 0, 1], 8), vec![vec![(0, 0, 2), (2, 0, 1)]]);
        assert!(plan_chunks(&[], 8).is_empty());
        // Every token once, in order, and no chunk over its size.
        let lens = [700, 1, 2500, 64, 699];
        let plan = plan_chunks(&lens, 2048);
        let mut fed = vec![0; lens.len()];
        for c in &plan {
            assert!(c.iter().map(|e| e.2).sum::<usize>() <= 2048);
            for &(i, start, n) in c {
                assert_eq!(start, fed[i]);
                fed[i] += n;
            }
        }
        assert_eq!(fed, lens);
    }
}
