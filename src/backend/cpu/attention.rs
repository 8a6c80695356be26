//! Gated full attention: q (+ per-head output gate), k, v projections; per-head q/k RMSNorm;
//! partial NeoX RoPE; causal GQA softmax attention over the KV cache; sigmoid output gate;
//! output projection. The cache stores k after norm and RoPE.

use super::ops::{apply_rope, rms_norm_rows, sigmoid, softmax};
use super::qmatmul::{dot_fast, qmatmul_all};
use crate::checkpoint::ModelConfig;
use crate::model::AttentionWeights;
use rayon::prelude::*;

/// Per-sequence KV cache of one attention layer: `[pos][kv_heads * head_dim]`, grown on demand.
#[derive(Clone, Default)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// K and V are rounded to bf16 (nearest even) as they are appended: the reference for the
    /// CUDA backend's bf16 KV cache (`LILY_KV_BF16=1`). Storage stays f32.
    pub bf16: bool,
}

impl KvCache {
    pub fn bytes(&self) -> usize {
        (self.k.capacity() + self.v.capacity()) * 4
    }
}

/// Runs the attention mixer for `tokens` new tokens at positions `pos0..pos0+tokens`.
pub fn forward(w: &AttentionWeights, cfg: &ModelConfig, inv_freq: &[f64], u: &[f32], tokens: usize, pos0: usize, cache: &mut KvCache) -> Vec<f32> {
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps as f32;
    let qg = qmatmul_all(&w.q, u, tokens);
    let mut k = qmatmul_all(&w.k, u, tokens);
    let v = qmatmul_all(&w.v, u, tokens);

    // Split the per-head interleaved [q_h | gate_h] rows.
    let mut q = vec![0.0f32; tokens * nh * hd];
    let mut gate = vec![0.0f32; tokens * nh * hd];
    for t in 0..tokens {
        for h in 0..nh {
            let src = &qg[t * 2 * nh * hd + h * 2 * hd..t * 2 * nh * hd + (h + 1) * 2 * hd];
            q[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(&src[..hd]);
            gate[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    rms_norm_rows(&mut q, &w.q_norm, eps);
    rms_norm_rows(&mut k, &w.k_norm, eps);
    for t in 0..tokens {
        for h in 0..nh {
            apply_rope(&mut q[(t * nh + h) * hd..(t * nh + h + 1) * hd], pos0 + t, inv_freq);
        }
        for h in 0..nkv {
            apply_rope(&mut k[(t * nkv + h) * hd..(t * nkv + h + 1) * hd], pos0 + t, inv_freq);
        }
    }
    debug_assert_eq!(cache.k.len(), pos0 * nkv * hd, "KV cache out of step with the sequence");
    if cache.bf16 {
        let round = |x: &f32| half::bf16::from_f32(*x).to_f32();
        cache.k.extend(k.iter().map(round));
        cache.v.extend(v.iter().map(round));
    } else {
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
    }

    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let kv_dim = nkv * hd;
    let mut o = vec![0.0f32; tokens * nh * hd];
    o.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
        let (t, h) = (idx / nh, idx % nh);
        let kvh = h / group;
        let qh = &q[idx * hd..(idx + 1) * hd];
        let n = pos0 + t + 1; // causal: positions 0..=pos0+t
        let mut scores: Vec<f32> = (0..n).map(|p| dot_fast(qh, &cache.k[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd]) * scale).collect();
        softmax(&mut scores);
        out.fill(0.0);
        for (p, &pr) in scores.iter().enumerate() {
            for (x, &vv) in out.iter_mut().zip(&cache.v[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd]) {
                *x += pr * vv;
            }
        }
        for (x, &gg) in out.iter_mut().zip(&gate[idx * hd..(idx + 1) * hd]) {
            *x *= sigmoid(gg);
        }
    });
    qmatmul_all(&w.o, &o, tokens)
}
