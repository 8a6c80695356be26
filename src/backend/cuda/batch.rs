//! Batched decode: one token of each of B sequences per step, through one forward over the
//! batch (`Backend::decode_batch`), the layer loop of forward.rs with [`BatchPass`]:
//! - each input staged once (`stage_tcb`: the RMSNorm, bf16 tensor-core fragments), then the
//!   dense projections and the lm_head as GEMV sets over the batch's tokens (`gemv_tcb`: the
//!   decode GEMV's weight streaming with the tokens as tensor-core columns; GDN b and a ride in
//!   the in-projection's set), the router and shared-expert gate in f32 with the routing in one
//!   launch (`moe_route_batch`);
//! - the MoE over the union of the routed experts: the prefill's GPU routing into per-expert
//!   slot lists, then `moe_tcb` reads each active expert's rows once for all its tokens (gate|up
//!   with SwiGLU fused, then down), the shared expert as a GEMV set, the weighted combine;
//! - the Gated DeltaNet step and split-KV attention per row, on the row's own state, position
//!   and length;
//! - the next token per row on the device (argmax, or the sampler with each row's parameters).
//!
//! The rows are bound through device tables: per layer, the rows' (ring, state) or (K, V)
//! pointers, and per row a `[token, position]` pair that the argmax / sampler advance. A step is
//! a CUDA graph per (rows, splits, KV type, token choice), captured once; the tables are rewritten
//! only when the batch's rows change, so one graph serves whichever sequences are in the batch.
//! Where the next step needs none of a step's tokens on the host, it is queued before they are
//! read back, so the host's work on them overlaps it.
//!
//! Every row's arithmetic is independent of the other rows (the GEMMs' routes do not depend on
//! the token count, each output column is accumulated in the same order), so a sequence's tokens
//! do not depend on its batch.

use super::activations::Activations;
use super::attention::{self, SplitPartials, MAX_SPLITS};
use super::decode::StepOut;
use super::device::{ptr, Gpu};
use super::forward::{self, LayerDims, LayerStates, Pass, Point, Probe};
use super::gdn;
use super::moe::{self, MoeDims, RouteLists, SharedExpert};
use super::qmatmul::{self, GemvSet, Grouped, PendingCombine, QMatDesc, TcbStaging};
use super::sampling::{self, SampleScratch, ARGMAX_SCRATCH};
use super::state::CudaSequence;
use super::weights::{DevAttn, DevGdn, DevLayer, DevMixer, DevMoe, DevWeights};
use super::{CudaBackend, Readback, StepGraph};
use crate::backend::{check_batch, mask_words, Backend, BatchRow, StepHooks};
use crate::checkpoint::ModelConfig;
use crate::engine::sampling::SamplerSnapshot;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, CudaStream};

/// Most rows of one batched decode call.
pub const MAX_BATCH: usize = 128;

/// Captured batch steps kept at once (distinct row counts, split counts and token choices): room
/// for a warm-up's two per row count and as many again, the least recently used going first.
const MAX_BATCH_GRAPHS: usize = 4 * MAX_BATCH;

/// The GEMV sets of one layer (outputs in the batch buffers).
struct LayerSets {
    mixer_in: GemvSet,
    mixer_out: GemvSet,
}

/// The MoE buffers of a batch step: routing lists over the routed experts and the shared one
/// (expert E, slots n * k + t), and per slot the gate|up (then SwiGLU) and down outputs.
struct MoeBuffers {
    counts: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    fill: CudaSlice<i32>,
    list: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    /// moe_route_batch's counters and count scratch (moe::ROUTE_DONE_LEN words, zero between launches).
    done: CudaSlice<u32>,
    gate: CudaSlice<f32>,
    down: CudaSlice<f32>,
    /// gate|up on `moe_tcr` (weights through per-warp rings), else `moe_tcb` (moe::tcr_fits).
    gate_up_ring: bool,
}

impl MoeBuffers {
    fn new(gpu: &Gpu, cfg: &ModelConfig, cap: usize) -> Result<Self> {
        let d = MoeDims::new(cfg);
        let slots = cap * (d.k + 1);
        Ok(MoeBuffers {
            counts: gpu.zeros(d.e + 1)?,
            offsets: gpu.zeros(d.e + 1)?,
            fill: gpu.zeros(d.e + 1)?,
            list: gpu.zeros(slots)?,
            tiles: gpu.zeros(1 + 2 * moe::batch_max_tiles(cap, &d))?,
            done: gpu.zeros(moe::ROUTE_DONE_LEN)?,
            gate: gpu.zeros(slots * d.inter)?,
            down: gpu.zeros(slots * d.hidden)?,
            gate_up_ring: moe::tcr_fits(gpu, d.hidden)?,
        })
    }
}

/// Buffers of batched steps for up to `cap` rows, and the GEMV sets that write into them.
pub struct BatchBuffers {
    pub cap: usize,
    act: Activations,
    moe: MoeBuffers,
    _descs: CudaSlice<QMatDesc>,
    layers: Vec<LayerSets>,
    head: GemvSet,
    /// The input of the GEMVs and expert products being run, staged once for all their blocks.
    staged: TcbStaging,
    /// The down products' input, every slot's SwiGLU outputs (the gate|up kernel stages them
    /// while its blocks still read `staged`).
    staged_slots: TcbStaging,
    /// `[token, position]` per row (i32).
    steps: CudaSlice<i32>,
    /// Per layer two tables of `cap` row pointers: (ring, state) or (K, V).
    tables: CudaSlice<u64>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// argmax_next's scratch per row.
    argmax: CudaSlice<f32>,
    sample: SampleScratch,
}

impl BatchBuffers {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, w: &DevWeights, cap: usize) -> Result<Self> {
        let heads = cap * cfg.num_attention_heads * MAX_SPLITS;
        let act = Activations::new(gpu, cfg, cap, cap)?;
        let sets = forward::model_sets(gpu, w, &act, true, |_, _| vec![])?;
        let layers: Vec<LayerSets> = sets.layers.iter().map(|(i, o, _)| LayerSets { mixer_in: *i, mixer_out: *o }).collect();
        let head = sets.head;
        let experts4 = w.layers.iter().all(|l| [&l.moe.gate_exps, &l.moe.up_exps, &l.moe.down_exps].iter().all(|q| q.bits == 4));
        if cfg.quant.group_size != 64 || !experts4 || layers.iter().flat_map(|l| [l.mixer_in, l.mixer_out]).chain([head]).any(|s| !s.all4) {
            bail!("batched decode needs 4-bit matrices of group 64 (all but the router and gates)");
        }
        let md = MoeDims::new(cfg);
        if !w.layers.iter().all(|l| moe::batch_supported(&l.moe, &md, cfg.quant.group_size)) {
            bail!("batched decode needs 4- or 8-bit routers, at most 511 experts, top-16 and a 4-bit shared expert as wide as the routed ones");
        }
        // Widest input: the hidden size, the GDN value / attention inner width, or the experts'
        // width over every slot (routed and shared).
        let k = cfg.num_experts_per_tok;
        let wide = [cfg.hidden_size, cfg.gdn_value_dim(), cfg.attn_inner(), cfg.moe_intermediate_size].into_iter().max().unwrap_or(0);
        let staged = TcbStaging::new(gpu, cap * (k + 1), wide)?;
        let staged_slots = TcbStaging::new(gpu, cap * (k + 1), cfg.moe_intermediate_size)?;
        Ok(BatchBuffers {
            cap,
            act,
            moe: MoeBuffers::new(gpu, cfg, cap)?,
            _descs: sets.descs,
            layers,
            head,
            staged,
            staged_slots,
            steps: gpu.zeros(2 * cap)?,
            tables: gpu.zeros(2 * cfg.layer_types.len() * cap)?,
            part_o: gpu.zeros(heads * cfg.head_dim)?,
            part_ml: gpu.zeros(heads * 2)?,
            argmax: gpu.zeros(cap * ARGMAX_SCRATCH)?,
            sample: SampleScratch::new(gpu, cfg.vocab_size, cap)?,
        })
    }

    /// Device address of layer `li`'s first (`second` = false) or second pointer table.
    fn table(&self, st: &CudaStream, li: usize, second: bool) -> u64 {
        ptr(&self.tables, st) + ((2 * li + second as usize) * self.cap * 8) as u64
    }
}

/// The batch's layer states: the pointer tables.
struct BatchStates<'a>(&'a BatchBuffers);

impl LayerStates for BatchStates<'_> {
    fn layer(&self, li: usize, _mixer: &DevMixer, st: &CudaStream) -> Result<(u64, u64)> {
        Ok((self.0.table(st, li, false), self.0.table(st, li, true)))
    }
}

/// What a captured batch step is specialised for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepKey {
    pub rows: usize,
    pub splits: usize,
    pub kv_bf16: bool,
    /// The rows' GDN states are f16 (`CudaOptions::gdn_state_f16`).
    pub gdn_state_f16: bool,
    pub out: StepOut,
    pub gdn: gdn::StepBatchKernel,
    pub attn: attention::SplitBatch,
}

/// Split count of a batch step: enough for the longest row this call can reach, rounded up to a
/// power of two so few graphs cover every length, and no more than [`SPLIT_ROWS`] (row, split)
/// pairs need: past about a wave of blocks, more splits only shorten each block's stream of K/V
/// tiles (its cp.async ring never fills) and add partials to merge (docs/cuda.md, "Batched
/// decode").
pub fn batch_splits(max_len: usize, rows: usize) -> usize {
    let by_len = attention::splits_for(max_len).next_power_of_two().min(MAX_SPLITS);
    let by_rows = (SPLIT_ROWS / rows.max(1)).max(1);
    by_len.min(1 << by_rows.ilog2())
}

/// (row, split) pairs a batch step's attention aims for (with two KV heads, 256 blocks: about a
/// wave of the tensor-core split kernel at two blocks per SM).
const SPLIT_ROWS: usize = 128;

/// Buffer capacity for `rows` rows: a power of two of at least 8 (fewer reallocations, which
/// drop the captured graphs).
pub fn capacity_for(rows: usize) -> usize {
    rows.next_power_of_two().clamp(8, MAX_BATCH)
}

/// The launches of one batch step over the first `rows` rows bound in the buffers.
struct BatchPass<'a> {
    gpu: &'a Gpu,
    w: &'a DevWeights,
    b: &'a BatchBuffers,
    rows: usize,
    splits: usize,
    gdn: gdn::StepBatchKernel,
    attn: attention::SplitBatch,
    dims: LayerDims,
    /// The last MoE layer's output, added into the residual by the next staging of it.
    combine: Option<PendingCombine>,
}

impl BatchPass<'_> {
    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.gpu.stream)
    }

    fn steps(&self) -> u64 {
        self.p(&self.b.steps)
    }

    /// Stages `nrows` rows of `x` (`cols` values, a mixer's outputs) for the products that follow.
    fn stage(&self, x: u64, cols: usize, nrows: usize) -> Result<()> {
        qmatmul::stage_tcb(self.gpu, x, cols, nrows, 0, self.dims.eps, 0, &self.b.staged)
    }

    /// Stages the residual stream RMSNorm'd with `gain` (the f32 result also into `u_out`),
    /// adding the last MoE layer's output into it first while that is pending: one launch for
    /// the combine and the next layer's first staging.
    fn stage_residual(&mut self, gain: &CudaSlice<f32>, u_out: u64) -> Result<()> {
        let (x, h, gain, combine) = (self.p(&self.b.act.x), self.w.embed.cols, self.p(gain), self.combine.take());
        qmatmul::stage_tcb_after(self.gpu, x, h, self.rows, gain, self.dims.eps, u_out, &self.b.staged, combine.as_ref())
    }

    /// Every matrix of `set` times the staged rows (`cols` values each).
    fn gemv(&self, set: GemvSet, cols: usize) -> Result<()> {
        qmatmul::gemv_tcb(self.gpu, set, &self.b.staged, cols, self.rows)
    }
}

impl Pass for BatchPass<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn residual(&self) -> (&CudaSlice<f32>, usize) {
        (&self.b.act.x, self.rows * self.w.embed.cols)
    }

    fn embed(&mut self, probe: &mut Probe) -> Result<()> {
        // The token ids are the first words of the [token, position] step rows.
        qmatmul::embed_rows(self.gpu, &self.w.embed, self.dims.group, self.steps(), 2, self.rows, self.p(&self.b.act.x))?;
        self.point(probe, Point::Phase("embed"))
    }

    /// `ring` / `state` are the rows' pointer tables.
    fn gdn(&mut self, li: usize, lw: &DevLayer, g: &DevGdn, ring: u64, state: u64, probe: &mut Probe) -> Result<()> {
        self.stage_residual(&lw.input_norm, 0)?;
        let (a, sets, h, n) = (&self.b.act, &self.b.layers[li], self.w.embed.cols, self.rows);
        self.gemv(sets.mixer_in, h)?;
        self.point(probe, Point::Phase("gdn.proj"))?;
        let p = forward::gdn_ptrs(self.gpu, a, g, ring, state);
        // The step stages its outputs for the out-projection itself where each head's outputs are
        // whole staged groups: one launch less per layer.
        let fused = gdn::stages_output(&self.dims.gdn);
        gdn::step_batch(self.gpu, &self.dims.gdn, &p, self.steps(), n, fused.then_some(&self.b.staged), self.gdn)?;
        self.point(probe, Point::Phase("gdn.step"))?;
        if !fused {
            self.stage(p.y, g.out.cols, n)?;
        }
        self.gemv(sets.mixer_out, g.out.cols)?;
        self.point(probe, Point::Phase("gdn.out"))
    }

    /// `kcache` / `vcache` are the rows' pointer tables.
    fn attention(&mut self, li: usize, lw: &DevLayer, at: &DevAttn, kcache: u64, vcache: u64, probe: &mut Probe) -> Result<()> {
        self.stage_residual(&lw.input_norm, 0)?;
        let (a, sets, d, h, n) = (&self.b.act, &self.b.layers[li], &self.dims.attn, self.w.embed.cols, self.rows);
        self.gemv(sets.mixer_in, h)?;
        self.point(probe, Point::Phase("attn.proj"))?;
        let p = forward::attn_ptrs(self.gpu, a, at, self.w, kcache, vcache);
        let part = SplitPartials { o: self.p(&self.b.part_o), ml: self.p(&self.b.part_ml) };
        attention::prep_batch(self.gpu, d, &p, self.steps(), self.rows)?;
        attention::split_batch(self.gpu, d, &p, &part, self.steps(), self.splits, self.rows, self.attn)?;
        attention::combine_batch(self.gpu, d, &p, &part, self.splits, self.rows)?;
        self.point(probe, Point::Phase("attn.core"))?;
        self.stage(p.out, at.o.cols, n)?;
        self.gemv(sets.mixer_out, at.o.cols)?;
        self.point(probe, Point::Phase("attn.out"))
    }

    fn moe(&mut self, _li: usize, lw: &DevLayer, m: &DevMoe, probe: &mut Probe) -> Result<()> {
        // The router and gate pick experts in f32 from the normalised input `u`; its staged bf16
        // copy feeds the experts, the shared one included (expert E, slots n * k + t).
        self.stage_residual(&lw.post_norm, self.p(&self.b.act.u))?;
        let (a, mb, n, d) = (&self.b.act, &self.b.moe, self.rows, self.dims.moe);
        let (u, h, k) = (self.p(&a.u), d.hidden, d.k);
        let r = RouteLists {
            logits: self.p(&a.router),
            top_ids: self.p(&a.top_ids),
            top_w: self.p(&a.top_w),
            counts: self.p(&mb.counts),
            offsets: self.p(&mb.offsets),
            fill: self.p(&mb.fill),
            list: self.p(&mb.list),
            tiles: self.p(&mb.tiles),
        };
        moe::route_batch(self.gpu, &m.router, &m.shared_expert_gate, &d, self.dims.group, u, n, self.p(&a.sgl), &r, self.p(&mb.done))?;
        self.point(probe, Point::Phase("moe.route"))?;
        let grouped = |xdiv| Grouped { max_tiles: moe::batch_max_tiles(n, &d), ..r.grouped(&d, n, xdiv) };
        let (gate, down, st) = (self.p(&mb.gate), self.p(&mb.down), &self.b.staged);
        let shared_gate_up = SharedExpert { q: &m.shared_gate, up: Some(&m.shared_up), expert: d.e, base: Some(n * k) };
        // The ring kernel stages its outputs for the down products itself (one launch less).
        let slots = &self.b.staged_slots;
        if mb.gate_up_ring && d.inter.is_multiple_of(64) {
            moe::moe_tcr(self.gpu, &m.gate_exps, Some(&m.up_exps), &shared_gate_up, d.inter, st, gate, grouped(k), Some(slots))?;
            self.point(probe, Point::Phase("moe.gate_up"))?;
        } else {
            moe::moe_tcb(self.gpu, &m.gate_exps, Some(&m.up_exps), &shared_gate_up, d.inter, st, gate, grouped(k))?;
            self.point(probe, Point::Phase("moe.gate_up"))?;
            qmatmul::stage_tcb(self.gpu, gate, d.inter, n * (k + 1), 0, self.dims.eps, 0, slots)?;
        }
        let shared_down = SharedExpert { q: &m.shared_down, up: None, expert: d.e, base: None };
        // Persistent blocks for down: a moe_tcb block's staging there serves one item per warp.
        moe::moe_tcp(self.gpu, &m.down_exps, None, &shared_down, h, slots, down, grouped(1))?;
        self.point(probe, Point::Phase("moe.down"))?;
        let shared_out = down + (n * k * h * 4) as u64;
        let combine = PendingCombine { down, top_w: r.top_w, k, shared: shared_out, shared_bf16: false, sgl: self.p(&a.sgl) };
        if probe.trace.is_some() {
            // The trace copies the residual after each layer: it must hold the layer's output.
            moe::combine(self.gpu, &d, &combine, self.p(&a.x), n)?;
            self.point(probe, Point::Phase("combine"))
        } else {
            self.combine = Some(combine);
            Ok(())
        }
    }
}

/// Enqueues one batch step over the first `key.rows` rows bound in `b`: the layers, the final
/// norm and lm_head into the logits rows, and the token choice into the step rows.
pub fn enqueue(gpu: &Gpu, cfg: &ModelConfig, w: &DevWeights, b: &BatchBuffers, key: StepKey, probe: &mut Probe) -> Result<()> {
    let dims = LayerDims::new(cfg, key.kv_bf16, key.gdn_state_f16);
    let mut pass = BatchPass { gpu, w, b, rows: key.rows, splits: key.splits, gdn: key.gdn, attn: key.attn, dims, combine: None };
    forward::layers(&mut pass, w, &BatchStates(b), probe)?;
    let (n, vocab) = (key.rows, cfg.vocab_size);
    let (steps, logits) = (pass.steps(), pass.p(&b.act.logits));
    pass.stage_residual(&w.final_norm, 0)?;
    pass.gemv(b.head, cfg.hidden_size)?;
    pass.point(probe, Point::Phase("lm_head"))?;
    match key.out {
        StepOut::Greedy => sampling::argmax_next(gpu, logits, vocab, steps, pass.p(&b.argmax), n)?,
        StepOut::Sample | StepOut::SampleSmallK => sampling::sample_next(gpu, logits, vocab, steps, &b.sample, n, key.out == StepOut::SampleSmallK)?,
        StepOut::Logits | StepOut::None => return Ok(()),
    }
    pass.point(probe, Point::Phase("token"))
}

/// Asks the hooks for the next step's mask of each of the `live` rows (into `masks` and
/// `masked`, row by row); whether any row has one.
fn ask_masks(hooks: &mut dyn StepHooks, live: &[usize], words: usize, masks: &mut [u32], masked: &mut [i32]) -> Result<bool> {
    for (r, &i) in live.iter().enumerate() {
        masked[r] = hooks.mask(i, &mut masks[r * words..(r + 1) * words])? as i32;
    }
    Ok(masked[..live.len()].iter().any(|&m| m != 0))
}

/// What [`CudaBackend::capture_batch_steps`] did: the rows its buffers take (0: it fitted none),
/// the steps it captured, and the device memory each took.
#[derive(Debug, Default)]
pub struct WarmBatch {
    pub rows: usize,
    pub graphs: usize,
    pub buffer_bytes: usize,
    pub graph_bytes: usize,
}

/// The backend's batch buffers and the steps captured over them.
pub struct Batcher {
    pub bufs: BatchBuffers,
    /// Least recently used first.
    graphs: Vec<(StepKey, StepGraph)>,
}

impl Batcher {
    /// Keeps a captured step as the most recently used, dropping the least recently used one
    /// when [`MAX_BATCH_GRAPHS`] are kept.
    fn keep(&mut self, key: StepKey, g: StepGraph) {
        if self.graphs.len() >= MAX_BATCH_GRAPHS {
            self.graphs.remove(0);
        }
        self.graphs.push((key, g));
    }
}

impl CudaBackend {
    /// Batch buffers for at least `rows` rows (reallocated, and the graphs dropped, when larger
    /// ones are needed).
    fn fit_batch(&mut self, rows: usize) -> Result<()> {
        if self.batcher.as_ref().is_some_and(|b| b.bufs.cap >= rows) {
            return Ok(());
        }
        self.batcher = None;
        let bufs = BatchBuffers::new(&self.gpu, &self.cfg, &self.w, capacity_for(rows))?;
        self.batcher = Some(Batcher { bufs, graphs: Vec::new() });
        Ok(())
    }

    /// Captures ahead the batch steps a server's running batch takes most: every row count from
    /// 2 to `max_rows`, greedy and sampled, over new sequences' KV type and at the split count of
    /// rows whose context is long enough that the row count sets it ([`batch_splits`]: past 16
    /// positions per split, e.g. 128 at 16 rows, 1,024 at 2), with the buffers at the capacity
    /// of `max_rows` (a larger batch reallocates them and drops the graphs). The first step of
    /// each size then does not stall the running streams while it is captured. Returns what it
    /// did.
    pub(super) fn capture_batch_steps(&mut self, max_rows: usize) -> Result<WarmBatch> {
        let max_rows = max_rows.min(MAX_BATCH);
        let mut warm = WarmBatch::default();
        if !self.use_graphs || self.profile.is_some() || max_rows < 2 {
            return Ok(warm);
        }
        let used = |b: &Self| b.device_memory().map_or(0, |(used, _)| used as usize);
        let start = used(self);
        self.fit_batch(max_rows)?;
        let fitted = used(self);
        warm.rows = max_rows;
        warm.buffer_bytes = fitted.saturating_sub(start);
        let kv_bf16 = self.opts.kv_bf16;
        let attn = self.attn_split_kernel(kv_bf16);
        for rows in 2..=max_rows {
            for out in [StepOut::Greedy, StepOut::Sample, StepOut::SampleSmallK] {
                let key = StepKey { rows, splits: batch_splits(usize::MAX, rows), kv_bf16, gdn_state_f16: self.opts.gdn_state_f16, out, gdn: self.gdn_step_kernel(rows), attn };
                let batcher = self.batcher.as_mut().expect("fitted above");
                if batcher.graphs.iter().any(|(k, _)| *k == key) {
                    continue;
                }
                let (gpu, cfg, w) = (&self.gpu, &self.cfg, &self.w);
                let g = super::capture(gpu, || enqueue(gpu, cfg, w, &batcher.bufs, key, &mut Probe::default()))?;
                g.upload()?;
                batcher.keep(key, g);
                warm.graphs += 1;
            }
        }
        self.gpu.sync()?;
        warm.graph_bytes = used(self).saturating_sub(fitted);
        Ok(warm)
    }

    /// Writes the rows' state pointers and `[token, position]` pairs into the batch tables, and
    /// their sampling state when the step samples.
    fn bind_rows(&mut self, seqs: &[&CudaSequence], tokens: &[u32], positions: &[usize], snaps: &[&SamplerSnapshot], out: StepOut) -> Result<()> {
        let gpu = &self.gpu;
        let st = &gpu.stream;
        let b = &mut self.batcher.as_mut().expect("fitted before binding").bufs;
        let cap = b.cap;
        let mut tables = vec![0u64; 2 * self.w.layers.len() * cap];
        for (li, lw) in self.w.layers.iter().enumerate() {
            for (r, seq) in seqs.iter().enumerate() {
                let (x, y) = seq.layer(li, &lw.mixer, st)?;
                tables[2 * li * cap + r] = x;
                tables[(2 * li + 1) * cap + r] = y;
            }
        }
        let steps: Vec<i32> = tokens.iter().zip(positions).flat_map(|(&t, &p)| [t as i32, p as i32]).collect();
        st.memcpy_htod(&tables, &mut b.tables).map_err(|e| anyhow!("batch table upload: {e:?}"))?;
        let mut dst = b.steps.slice_mut(0..steps.len());
        st.memcpy_htod(&steps, &mut dst).map_err(|e| anyhow!("batch step upload: {e:?}"))?;
        if matches!(out, StepOut::Sample | StepOut::SampleSmallK) {
            b.sample.load(gpu, snaps)?;
        }
        Ok(())
    }

    /// The batched GDN step's kernel for `rows` rows (or the test override's).
    fn gdn_step_kernel(&self, rows: usize) -> gdn::StepBatchKernel {
        let items = rows * self.cfg.linear_num_value_heads;
        match self.opts.gdn_step_blocks {
            Some(0) => gdn::StepBatchKernel::PerItem,
            Some(blocks) => gdn::StepBatchKernel::Persist { blocks: blocks.min(items) },
            None => gdn::select_step_batch(items, self.gpu.sms as usize),
        }
    }

    /// The batched attention's split kernel (or the CUDA-core one where the test option asks).
    fn attn_split_kernel(&self, kv_bf16: bool) -> attention::SplitBatch {
        if self.opts.attn_split_cuda_core {
            return attention::SplitBatch::CudaCore;
        }
        attention::select_split_batch(&LayerDims::new(&self.cfg, kv_bf16, self.opts.gdn_state_f16).attn)
    }

    /// Runs one batch step over the bound rows: through its graph (captured on first use), or
    /// directly (profiling, graphs off or failed).
    fn run_batch_step(&mut self, key: StepKey) -> Result<()> {
        let batcher = self.batcher.as_mut().expect("fitted before stepping");
        if let Some(p) = self.profile.as_mut() {
            p.steps += 1;
            sampling::spin_us(&self.gpu, 20_000)?;
            let mut probe = Probe::profiling(true);
            enqueue(&self.gpu, &self.cfg, &self.w, &batcher.bufs, key, &mut probe)?;
            p.add(&probe.phase_ms(&self.gpu)?);
            return Ok(());
        }
        if !self.use_graphs {
            return enqueue(&self.gpu, &self.cfg, &self.w, &batcher.bufs, key, &mut Probe::default());
        }
        // The most recently used last.
        if let Some(i) = batcher.graphs.iter().position(|(k, _)| *k == key) {
            let hit = batcher.graphs.remove(i);
            batcher.graphs.push(hit);
            return batcher.graphs.last().expect("just pushed").1.launch();
        }
        let (gpu, cfg, w) = (&self.gpu, &self.cfg, &self.w);
        match super::capture(gpu, || enqueue(gpu, cfg, w, &batcher.bufs, key, &mut Probe::default())) {
            Ok(g) => {
                g.launch()?;
                batcher.keep(key, g);
                Ok(())
            }
            Err(e) => {
                eprintln!("lily: CUDA graph capture failed ({e:#}); launching kernels directly");
                self.use_graphs = false;
                enqueue(&self.gpu, &self.cfg, &self.w, &batcher.bufs, key, &mut Probe::default())
            }
        }
    }

    /// `Backend::decode_batch` on the device (see there for the contract).
    pub(super) fn batch_decode(&mut self, rows: &mut [BatchRow], hooks: &mut dyn StepHooks) -> Result<Vec<usize>> {
        if self.batch_readback.is_none() {
            self.batch_readback = Some(Readback::pair(&self.gpu, 2 * MAX_BATCH)?);
        }
        let mut rb = self.batch_readback.take().expect("allocated above");
        let r = self.batch_steps(rows, hooks, &mut rb);
        self.batch_readback = Some(rb);
        if r.is_err() {
            // A step may still be in flight: it must be done before the caller frees what it reads.
            let _ = self.gpu.sync();
        }
        r
    }

    /// Queues one batch step and the copy of its rows' `[token, position]` pairs into `slot`.
    fn queue_batch_step(&mut self, key: StepKey, slot: &mut Readback) -> Result<()> {
        self.run_batch_step(key)?;
        slot.enqueue(&self.gpu, &self.batcher.as_ref().expect("fitted").bufs.steps, 2 * key.rows)
    }

    /// The steps of [`Self::batch_decode`]. Where the hooks allow it ([`StepHooks::queue_ahead`])
    /// and the next step needs nothing from this one's tokens on the host, it is queued before
    /// they are read (the device step feeds each row its token from the step rows), so the GPU
    /// runs while the host takes them: two steps in flight, read back through the pinned slots
    /// `rb` in turn.
    fn batch_steps(&mut self, rows: &mut [BatchRow], hooks: &mut dyn StepHooks, rb: &mut [Readback; 2]) -> Result<Vec<usize>> {
        let vocab = self.cfg.vocab_size;
        check_batch(vocab, rows)?;
        if rows.len() > MAX_BATCH {
            bail!("at most {MAX_BATCH} rows per batched decode ({} given)", rows.len());
        }
        let kv_bf16 = rows.first().map(|r| r.seq.state::<CudaSequence>().kv_bf16).unwrap_or(false);
        if rows.iter().any(|r| r.seq.state::<CudaSequence>().kv_bf16 != kv_bf16) {
            bail!("the rows of a batched decode must share one KV cache element type");
        }
        rows.iter().try_for_each(|r| r.seq.state::<CudaSequence>().check_gdn_state(self.opts.gdn_state_f16))?;
        let mut snaps: Vec<SamplerSnapshot> = rows.iter().map(|r| r.sampler.clone()).collect();
        let mut cur: Vec<u32> = rows.iter().map(|r| r.first_token).collect();
        let mut produced = vec![0usize; rows.len()];
        let mut live: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].max_tokens > 0).collect();
        if live.is_empty() {
            return Ok(produced);
        }
        let reach = rows.iter().map(|r| r.seq.len() + r.max_tokens).max().unwrap_or(1);
        let splits = batch_splits(reach, rows.len());
        let attn = self.attn_split_kernel(kv_bf16);
        self.fit_batch(live.len())?;
        let mut bound = false;
        // Token masks of the rows the hooks constrain, uploaded before each step that has one.
        let words = mask_words(vocab);
        let mut masks = vec![0u32; live.len() * words];
        let mut masked = vec![0i32; live.len()];
        // Whether the device's mask flags may be set (a previous call may have left them so).
        let mut flags_set = true;
        let mut last_out = None;
        // Rows that `token` stopped while the next step was queued: that step fed their last
        // token, and its output for them is not theirs.
        let mut gone = vec![false; rows.len()];
        // A step of the `live` rows queued ahead (its key; it has no mask: see below), read back
        // through `rb[slot]`.
        let mut queued: Option<StepKey> = None;
        let mut slot = 0;
        loop {
            let n = live.len();
            let (key, step_masked) = match queued {
                Some(key) => (key, false),
                None if n == 0 => break,
                None => {
                    // Each row writes its KV at its length: map a page where one starts (all rows
                    // or none of this step's work: a row that cannot grow ends the call before
                    // the step).
                    for &i in &live {
                        let end = rows[i].seq.len() + 1;
                        rows[i].seq.state_mut::<CudaSequence>().grow(end)?;
                    }
                    let any_masked = ask_masks(hooks, &live, words, &mut masks, &mut masked)?;
                    let plain = live.iter().all(|&i| snaps[i].params.is_plain_greedy());
                    let out = if plain && !any_masked {
                        StepOut::Greedy
                    } else if live.iter().all(|&i| sampling::small_k(&snaps[i].params)) {
                        StepOut::SampleSmallK
                    } else {
                        StepOut::Sample
                    };
                    // The sampling state is loaded when rows are bound for sampling.
                    if last_out != Some(out) {
                        bound = false;
                    }
                    last_out = Some(out);
                    if any_masked || flags_set {
                        let b = &mut self.batcher.as_mut().expect("fitted").bufs;
                        b.sample.load_masks(&self.gpu, &masked[..n], any_masked.then(|| &masks[..n * words]))?;
                        flags_set = any_masked;
                    }
                    if !bound {
                        let seqs: Vec<&CudaSequence> = live.iter().map(|&i| rows[i].seq.state::<CudaSequence>()).collect();
                        let toks: Vec<u32> = live.iter().map(|&i| cur[i]).collect();
                        let pos: Vec<usize> = live.iter().map(|&i| rows[i].seq.len()).collect();
                        let sn: Vec<&SamplerSnapshot> = live.iter().map(|&i| &snaps[i]).collect();
                        self.bind_rows(&seqs, &toks, &pos, &sn, out)?;
                    }
                    let key = StepKey { rows: n, splits, kv_bf16, gdn_state_f16: self.opts.gdn_state_f16, out, gdn: self.gdn_step_kernel(n), attn };
                    self.queue_batch_step(key, &mut rb[slot])?;
                    (key, any_masked)
                }
            };
            // Queue the next step now if the hooks agree (asked every step: they may stop rows
            // after a no) and it needs nothing from this one's tokens: the same rows and bindings
            // (none reaches max_tokens here, none left at the previous step), no mask at either
            // step (so the same token choice), and its KV pages. A row that cannot grow fails
            // again before the next step, after these tokens are delivered.
            let mut ahead = hooks.queue_ahead() && !step_masked && live.iter().all(|&i| !gone[i] && produced[i] + 1 < rows[i].max_tokens);
            ahead = ahead
                && live.iter().all(|&i| {
                    let seq = &mut rows[i].seq;
                    let end = seq.len() + 2;
                    seq.state_mut::<CudaSequence>().grow(end).is_ok()
                });
            ahead = ahead && !ask_masks(hooks, &live, words, &mut masks, &mut masked)?;
            if ahead {
                self.queue_batch_step(key, &mut rb[slot ^ 1])?;
            }
            hooks.beside_steps();
            let host = rb[slot].wait(2 * n)?;
            let mut next = Vec::with_capacity(n);
            for (r, &i) in live.iter().enumerate() {
                let (tok, pos) = (host[2 * r], host[2 * r + 1]);
                let seq = &mut rows[i].seq;
                if pos as usize != seq.len() + 1 || tok < 0 || tok as usize >= vocab {
                    bail!("device step rows out of sync (row {i}: token {tok}, position {pos})");
                }
                seq.advance(1);
                if gone[i] {
                    continue;
                }
                produced[i] += 1;
                cur[i] = tok as u32;
                if snaps[i].params.has_penalties() {
                    snaps[i].observe(tok as u32);
                }
                if hooks.token(i, tok as u32) && produced[i] < rows[i].max_tokens {
                    next.push(i);
                } else if ahead {
                    gone[i] = true;
                }
            }
            if ahead {
                // The step queued ahead runs these rows; the next turn reads it.
                queued = Some(key);
                slot ^= 1;
            } else {
                // A row left: the tables are rebuilt for the remaining rows (their device counts
                // and positions are re-sent from the host's copies).
                bound = next.len() == n;
                live = next;
                queued = None;
            }
        }
        Ok(produced)
    }

    /// One batch step of `seqs` fed `tokens`, returning the logits `[rows][vocab]` (tests).
    #[cfg(feature = "cuda-testing")]
    pub(super) fn batch_logits(&mut self, seqs: &mut [&mut crate::backend::Sequence], tokens: &[u32]) -> Result<Vec<f32>> {
        let n = seqs.len();
        if n == 0 || n > MAX_BATCH || tokens.len() != n {
            bail!("batch of {n} rows and {} tokens", tokens.len());
        }
        for (s, &t) in seqs.iter_mut().zip(tokens) {
            self.check_tokens(s, &[t])?;
        }
        let kv_bf16 = seqs[0].state::<CudaSequence>().kv_bf16;
        seqs.iter().try_for_each(|s| s.state::<CudaSequence>().check_gdn_state(self.opts.gdn_state_f16))?;
        let reach = seqs.iter().map(|s| s.len() + 1).max().unwrap_or(1);
        self.fit_batch(n)?;
        let states: Vec<&CudaSequence> = seqs.iter().map(|s| s.state::<CudaSequence>()).collect();
        let pos: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        self.bind_rows(&states, tokens, &pos, &[], StepOut::Logits)?;
        let attn = self.attn_split_kernel(kv_bf16);
        let key = StepKey { rows: n, splits: batch_splits(reach, n), kv_bf16, gdn_state_f16: self.opts.gdn_state_f16, out: StepOut::Logits, gdn: self.gdn_step_kernel(n), attn };
        self.run_batch_step(key)?;
        let b = &self.batcher.as_ref().expect("fitted").bufs;
        let vocab = self.cfg.vocab_size;
        let out = self.gpu.stream.clone_dtoh(&b.act.logits.slice(0..n * vocab)).map_err(|e| anyhow!("CUDA error during the forward pass: {e:?}"))?;
        self.gpu.sync()?;
        for s in seqs.iter_mut() {
            s.advance(1);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_capacity() {
        assert_eq!(batch_splits(1, 1), 1);
        assert_eq!(batch_splits(829, 1), 32);
        assert_eq!(batch_splits(4096 + 129, 1), MAX_SPLITS);
        assert_eq!(batch_splits(262_144, 1), MAX_SPLITS);
        // Many rows: fewer, longer splits (700-token prompts + 128 steps reach 828).
        assert_eq!(batch_splits(829, 4), 32);
        assert_eq!(batch_splits(829, 16), 8);
        assert_eq!(batch_splits(829, 64), 2);
        assert_eq!(batch_splits(829, 128), 1);
        assert_eq!(batch_splits(262_144, 64), 2);
        assert_eq!(batch_splits(829, 300), 1);
        assert_eq!(capacity_for(1), 8);
        assert_eq!(capacity_for(16), 16);
        assert_eq!(capacity_for(17), 32);
        assert_eq!(capacity_for(MAX_BATCH), MAX_BATCH);
    }
}
