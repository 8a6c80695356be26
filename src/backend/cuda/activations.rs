//! Activation buffers of a forward over T tokens, token-major, one naming scheme for the decode
//! step (T = 1) and prefill chunks (T up to the chunk): the layer loop (forward.rs) reads the same
//! fields whatever the token count; each path adds the scratch only its kernels use.

use super::device::Gpu;
use super::gdn::{self, ChunkedScratch, GdnDims};
use super::moe::{tiles_of, MoeDims, BATCH_TILE};
use super::qmatmul::TcbStaging;
use super::qmatmul::BlasScratch;
use super::sampling::{SampleScratch, ARGMAX_SCRATCH};
use crate::checkpoint::ModelConfig;
use anyhow::Result;
use cudarc::driver::CudaSlice;

/// Per-token activations of every layer, room for `tokens` tokens.
pub struct Activations {
    pub tokens: usize,
    /// Residual stream `[T][hidden]` and its normalised copy.
    pub x: CudaSlice<f32>,
    pub u: CudaSlice<f32>,
    /// GDN in-projection q|k|v, or attention q|gate.
    pub qkv: CudaSlice<f32>,
    /// GDN z, b and a projections.
    pub z: CudaSlice<f32>,
    pub b: CudaSlice<f32>,
    pub a: CudaSlice<f32>,
    /// Attention raw k and v projections.
    pub kraw: CudaSlice<f32>,
    pub vraw: CudaSlice<f32>,
    /// Attention normed + rotated q, and the output gate.
    pub q: CudaSlice<f32>,
    pub gate: CudaSlice<f32>,
    /// Mixer output (GDN gated norm or gated attention): the out-projection's input.
    pub y: CudaSlice<f32>,
    /// Router logits and the shared-expert gate logit.
    pub router: CudaSlice<f32>,
    pub sgl: CudaSlice<f32>,
    /// Top-k expert ids and weights.
    pub top_ids: CudaSlice<i32>,
    pub top_w: CudaSlice<f32>,
    /// Logits of up to `logit_rows` tokens.
    pub logits: CudaSlice<f32>,
    pub logit_rows: usize,
}

impl Activations {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, n: usize, logit_rows: usize) -> Result<Self> {
        let f = |k: usize| gpu.zeros::<f32>(n * k);
        let k = cfg.num_experts_per_tok;
        Ok(Activations {
            tokens: n,
            x: f(cfg.hidden_size)?,
            u: f(cfg.hidden_size)?,
            qkv: f(cfg.gdn_conv_dim().max(cfg.q_proj_rows()))?,
            z: f(cfg.gdn_value_dim())?,
            b: f(cfg.linear_num_value_heads)?,
            a: f(cfg.linear_num_value_heads)?,
            kraw: f(cfg.kv_dim())?,
            vraw: f(cfg.kv_dim())?,
            q: f(cfg.attn_inner())?,
            gate: f(cfg.attn_inner())?,
            y: f(cfg.gdn_value_dim().max(cfg.attn_inner()))?,
            router: f(cfg.num_experts)?,
            sgl: f(1)?,
            top_ids: gpu.zeros::<i32>(n * k)?,
            top_w: f(k)?,
            logits: gpu.zeros::<f32>(logit_rows.max(1) * cfg.vocab_size)?,
            logit_rows: logit_rows.max(1),
        })
    }
}

/// Scratch only the decode step uses.
pub struct DecodeScratch {
    /// SwiGLU outputs of the k experts and the shared expert.
    pub act: CudaSlice<f32>,
    /// Split-KV partials: output rows and (max, sum) pairs per q head and split.
    pub part_o: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
    /// argmax_next's partials and ticket (zero between uses).
    pub argmax: CudaSlice<f32>,
    /// The sampler's parameters, counts and passes.
    pub sample: SampleScratch,
}

impl DecodeScratch {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig) -> Result<Self> {
        let splits = super::attention::MAX_SPLITS;
        Ok(DecodeScratch {
            act: gpu.zeros(cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)?,
            part_o: gpu.zeros(cfg.num_attention_heads * splits * cfg.head_dim)?,
            part_ml: gpu.zeros(cfg.num_attention_heads * splits * 2)?,
            argmax: gpu.zeros(ARGMAX_SCRATCH)?,
            sample: SampleScratch::new(gpu, cfg.vocab_size, 1)?,
        })
    }
}

/// Scratch only prefill chunks use.
pub struct ChunkScratch {
    /// Token ids of the chunk.
    pub ids: CudaSlice<i32>,
    /// GDN conv outputs, normalised q and k, scan outputs.
    pub conv: CudaSlice<f32>,
    pub qn: CudaSlice<f32>,
    pub kn: CudaSlice<f32>,
    pub o: CudaSlice<f32>,
    /// The chunked GDN scan's per-chunk products (`gdn::ChunkedScratch`; one element each where
    /// the heads do not take that scan).
    pub gdn_chunked: GdnChunked,
    /// MoE routing: per-expert counts, offsets, fill cursors; slot lists; tensor-core tiles.
    pub counts: CudaSlice<i32>,
    pub offsets: CudaSlice<i32>,
    pub fill: CudaSlice<i32>,
    pub list: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    /// Per-slot expert gate (then SwiGLU) and up outputs, per-slot down outputs.
    pub expert_gate: CudaSlice<f32>,
    pub expert_up: CudaSlice<f32>,
    pub expert_down: CudaSlice<f32>,
    /// Shared expert gate (then SwiGLU), up and down outputs.
    pub shared_gate: CudaSlice<f32>,
    pub shared_up: CudaSlice<f32>,
    pub shared_down: CudaSlice<f32>,
    /// Staged bf16 inputs of the routed experts' products (`moe::PrefillExperts::Tcb` and
    /// `Wg`): the tokens (gate|up), then the slots (down).
    pub tcb_tokens: TcbStaging,
    pub tcb_slots: TcbStaging,
    /// Split prefill attention's partials (`attention::chunk`): output rows and (max, sum) pairs
    /// per query token, q head and split.
    pub attn_part_o: CudaSlice<f32>,
    pub attn_part_ml: CudaSlice<f32>,
    /// Operands of the cuBLAS GEMMs, when cuBLAS is loaded.
    pub blas: Option<BlasScratch>,
}

/// Buffers of [`gdn::ChunkedScratch`]: U, W, q, k and M in bf16, G in f32.
pub struct GdnChunked {
    pub chunks: usize,
    pub g: CudaSlice<f32>,
    pub bf16s: [CudaSlice<u16>; 5],
}

impl GdnChunked {
    /// For prefill chunks of up to `n` tokens.
    pub fn new(gpu: &Gpu, d: &GdnDims, n: usize) -> Result<Self> {
        let chunks = if gdn::chunked_supported(d) { ChunkedScratch::chunks_for(n) } else { 0 };
        let [u, w, q, k, m, g] = ChunkedScratch::sizes(d, chunks);
        Ok(GdnChunked { chunks, g: gpu.zeros(g)?, bf16s: [gpu.zeros(u)?, gpu.zeros(w)?, gpu.zeros(q)?, gpu.zeros(k)?, gpu.zeros(m)?] })
    }

    /// The device pointers the scan takes.
    pub fn ptrs(&self, gpu: &Gpu) -> ChunkedScratch {
        let f = |s: &CudaSlice<f32>| super::device::ptr(s, &gpu.stream);
        let h = |s: &CudaSlice<u16>| super::device::ptr(s, &gpu.stream);
        let [u, w, q, k, m] = &self.bf16s;
        ChunkedScratch { u: h(u), w: h(w), q: h(q), k: h(k), m: h(m), g: f(&self.g), chunks: self.chunks }
    }
}

impl ChunkScratch {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, n: usize, blas: bool) -> Result<Self> {
        let f = |k: usize| gpu.zeros::<f32>(n * k);
        let i = |k: usize| gpu.zeros::<i32>(k);
        let (e, k, h) = (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size);
        let qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim;
        let (vd, inner, sinter) = (cfg.gdn_value_dim(), cfg.attn_inner(), cfg.shared_expert_intermediate_size);
        let blas = if blas {
            let dense = [cfg.gdn_conv_dim(), vd, cfg.q_proj_rows(), cfg.kv_dim(), inner, sinter].into_iter().max().unwrap_or(0) * h;
            Some(BlasScratch::new(gpu, dense, n * h, n * vd.max(inner).max(sinter).max(h))?)
        } else {
            None
        };
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let split_rows = if super::attention::chunk_supported(nh, nkv) { super::attention::chunk_split_rows(nh, nkv, gpu.sms as usize) } else { 1 };
        Ok(ChunkScratch {
            ids: i(n)?,
            conv: f(cfg.gdn_conv_dim())?,
            qn: f(qk)?,
            kn: f(qk)?,
            o: f(vd)?,
            gdn_chunked: GdnChunked::new(gpu, &GdnDims::new(cfg), n)?,
            counts: i(e)?,
            offsets: i(e)?,
            fill: i(e)?,
            list: i(n * k)?,
            // The 16-slot tiles of the short-chunk route outnumber the grouped routes' 64-slot ones.
            tiles: i(1 + 2 * tiles_of(n, &MoeDims::new(cfg), BATCH_TILE))?,
            expert_gate: f(k * cfg.moe_intermediate_size)?,
            expert_up: f(k * cfg.moe_intermediate_size)?,
            expert_down: f(k * h)?,
            shared_gate: f(sinter)?,
            shared_up: f(sinter)?,
            shared_down: f(h)?,
            tcb_tokens: TcbStaging::new(gpu, n, h)?,
            tcb_slots: TcbStaging::new(gpu, n * k, cfg.moe_intermediate_size)?,
            attn_part_o: gpu.zeros::<f32>(split_rows * nh * cfg.head_dim)?,
            attn_part_ml: gpu.zeros::<f32>(split_rows * nh * 2)?,
            blas,
        })
    }
}
