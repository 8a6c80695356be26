//! CPU reference backend: the complete forward pass in f32, multi-threaded with rayon, reading
//! the 4-bit weights straight from the mapped checkpoint.
//!
//! Prefill runs in blocks of [`PREFILL_BLOCK`] tokens through all layers (bounded scratch);
//! inside a block Gated DeltaNet uses its chunked form, and a single token uses the recurrent
//! step.

pub mod attention;
pub mod gdn;
pub mod moe;
pub mod ops;
pub mod qmatmul;

use super::{Backend, LogitsWanted, Sequence, SequenceState};
use crate::checkpoint::{Checkpoint, ModelConfig};
use crate::model::{MixerWeights, ModelWeights};
use anyhow::{bail, Result};
use attention::KvCache;
use gdn::GdnState;
use std::any::Any;

/// Tokens pushed through all layers at once during prefill.
pub const PREFILL_BLOCK: usize = 256;

/// Caches of one layer.
#[derive(Clone)]
pub enum LayerCache {
    Gdn(GdnState),
    Attention(KvCache),
}

/// Per-sequence state of the CPU backend.
#[derive(Clone)]
pub struct CpuSequence {
    pub layers: Vec<LayerCache>,
}

impl SequenceState for CpuSequence {
    fn try_clone_state(&self, _len: usize) -> Result<Box<dyn SequenceState>> {
        Ok(Box::new(self.clone()))
    }
    fn memory_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Gdn(g) => g.bytes(),
                LayerCache::Attention(kv) => kv.bytes(),
            })
            .sum()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub struct CpuBackend {
    weights: ModelWeights,
    inv_freq: Vec<f64>,
    prefill_block: usize,
    /// New sequences round their attention KV cache to bf16 (`LILY_KV_BF16=1`, or
    /// [`CpuBackend::set_kv_bf16`]).
    kv_bf16: bool,
}

impl CpuBackend {
    pub fn new(ck: &Checkpoint) -> Result<Self> {
        let weights = ModelWeights::from_checkpoint(ck)?;
        let cfg = &weights.config;
        let inv_freq = ops::rope_inv_freq(cfg.rotary_dim(), cfg.rope_theta);
        Ok(CpuBackend { weights, inv_freq, prefill_block: PREFILL_BLOCK, kv_bf16: crate::backend::kv_bf16_from_env(false) })
    }

    /// Changes the prefill block length (tests use it to move block boundaries).
    pub fn with_prefill_block(mut self, n: usize) -> Self {
        self.prefill_block = n.max(1);
        self
    }

    /// Embedding rows of `tokens` (`[T][hidden]`).
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.weights.config.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (t, &id) in tokens.iter().enumerate() {
            qmatmul::dequantize_row(&self.weights.embed, id as usize, &mut x[t * h..(t + 1) * h]);
        }
        x
    }

    /// One block of tokens through every layer; returns the final hidden states `[T][hidden]`
    /// (before the final norm).
    fn run_block(&self, st: &mut CpuSequence, tokens: &[u32], pos0: usize) -> Vec<f32> {
        let cfg = &self.weights.config;
        let h = cfg.hidden_size;
        let n = tokens.len();
        let eps = cfg.rms_norm_eps as f32;
        let mut x = self.embed(tokens);
        let mut u = vec![0.0f32; n * h];
        for (layer, cache) in self.weights.layers.iter().zip(st.layers.iter_mut()) {
            for t in 0..n {
                ops::rms_norm(&x[t * h..(t + 1) * h], &layer.input_norm, eps, &mut u[t * h..(t + 1) * h]);
            }
            let mixed = match (&layer.mixer, cache) {
                (MixerWeights::Gdn(w), LayerCache::Gdn(s)) => gdn::forward(w, cfg, &u, n, s),
                (MixerWeights::Attention(w), LayerCache::Attention(kv)) => attention::forward(w, cfg, &self.inv_freq, &u, n, pos0, kv),
                _ => unreachable!("layer cache kind follows the layer kind"),
            };
            x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
            for t in 0..n {
                ops::rms_norm(&x[t * h..(t + 1) * h], &layer.post_norm, eps, &mut u[t * h..(t + 1) * h]);
            }
            let moe_out = moe::forward(&layer.moe, cfg, &u, n);
            x.iter_mut().zip(&moe_out).for_each(|(a, b)| *a += b);
        }
        x
    }

    /// Final norm + lm_head for the given hidden rows.
    fn logits(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let cfg = &self.weights.config;
        let h = cfg.hidden_size;
        let mut normed = vec![0.0f32; rows * h];
        for t in 0..rows {
            ops::rms_norm(&hidden[t * h..(t + 1) * h], &self.weights.final_norm, cfg.rms_norm_eps as f32, &mut normed[t * h..(t + 1) * h]);
        }
        qmatmul::qmatmul_all(&self.weights.lm_head, &normed, rows)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn kv_bf16(&self) -> bool {
        self.kv_bf16
    }

    /// `true` rounds K and V to bf16 as they are appended (the reference for the CUDA backend's
    /// bf16 KV cache); the storage stays f32.
    fn set_kv_bf16(&mut self, bf16: bool) {
        self.kv_bf16 = bf16;
    }

    fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    fn new_sequence(&self, max_seq: usize) -> Result<Sequence> {
        let cfg = &self.weights.config;
        let layers = self
            .weights
            .layers
            .iter()
            .map(|l| match l.mixer {
                MixerWeights::Gdn(_) => LayerCache::Gdn(GdnState::new(cfg)),
                MixerWeights::Attention(_) => LayerCache::Attention(KvCache { bf16: self.kv_bf16, ..KvCache::default() }),
            })
            .collect();
        Ok(Sequence::new(max_seq, Box::new(CpuSequence { layers })))
    }

    fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let cfg = &self.weights.config;
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!("token id {bad} is outside the vocabulary ({} entries)", cfg.vocab_size);
        }
        seq.check_room(tokens.len())?;
        let h = cfg.hidden_size;
        let mut out = Vec::new();
        let blocks: Vec<&[u32]> = tokens.chunks(self.prefill_block).collect();
        let nblocks = blocks.len();
        for (bi, block) in blocks.into_iter().enumerate() {
            let pos0 = seq.len();
            let hidden = self.run_block(seq.state_mut::<CpuSequence>(), block, pos0);
            seq.advance(block.len());
            match wanted {
                LogitsWanted::All => out.extend(self.logits(&hidden, block.len())),
                LogitsWanted::Last if bi + 1 == nblocks => {
                    let n = block.len();
                    out = self.logits(&hidden[(n - 1) * h..n * h], 1);
                }
                _ => {}
            }
        }
        Ok(out)
    }
}
