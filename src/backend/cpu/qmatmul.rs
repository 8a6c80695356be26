//! Matrix products that read MLX affine-quantized weights directly (never dequantizing the
//! whole model): `out[t, r] = Σ_c (scale·q + bias)[row0 + r, c] · x[t, c]`.
//!
//! The bias is folded per group: `Σ (s q + b) x = s Σ q x + b Σ x`, so the inner loop is a plain
//! code-times-activation dot product and `Σ x` per group is computed once per token.

use crate::checkpoint::store::QuantTensor;
use crate::checkpoint::DType;
use rayon::prelude::*;

/// Up to this many tokens, rows are not dequantized first (see `qmatmul`).
const FUSED_MAX_TOKENS: usize = 4;

/// Rows handed to one rayon task; large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

#[inline(always)]
fn scale_at(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        _ => f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]),
    }
}

/// Σ_j code_j · x_j over one group of 4-bit codes (8 codes per word).
#[inline(always)]
fn dot_q4(words: &[u32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, xs) in words.iter().zip(x.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += ((w >> (4 * k)) & 0xF) as f32 * xs[k];
        }
    }
    acc.iter().sum()
}

/// Σ_j code_j · x_j over one group of 8-bit codes (4 codes per word).
#[inline(always)]
fn dot_q8(words: &[u32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    for (w, xs) in words.iter().zip(x.chunks_exact(4)) {
        for k in 0..4 {
            acc[k] += ((w >> (8 * k)) & 0xFF) as f32 * xs[k];
        }
    }
    acc.iter().sum()
}

/// Dequantizes row `r` of `w` into `out` (`w.cols` values).
pub fn dequantize_row(w: &QuantTensor, r: usize, out: &mut [f32]) {
    let wpr = w.words_per_row();
    let gpr = w.groups_per_row();
    let words = &w.words()[r * wpr..(r + 1) * wpr];
    let (sb, bb) = (w.scales.as_bytes(), w.biases.as_bytes());
    let per_word = 32 / w.bits;
    let mask = (1u32 << w.bits) - 1;
    for g in 0..gpr {
        let s = scale_at(sb, w.scale_dtype, r * gpr + g);
        let b = scale_at(bb, w.scale_dtype, r * gpr + g);
        for j in g * w.group..(g + 1) * w.group {
            let code = (words[j / per_word] >> (w.bits * (j % per_word))) & mask;
            out[j] = s * code as f32 + b;
        }
    }
}

/// `out[t * nrows + r] = W[row0 + r, :] · x[t, :]` for `t < tokens`, `r < nrows`.
/// `x` is `[tokens, w.cols]` row-major.
pub fn qmatmul(w: &QuantTensor, row0: usize, nrows: usize, x: &[f32], tokens: usize, out: &mut [f32]) {
    let cols = w.cols;
    assert_eq!(x.len(), tokens * cols, "{}: input has {} values, expected {tokens}x{cols}", w.name, x.len());
    assert!(row0 + nrows <= w.rows, "{}: rows {row0}+{nrows} > {}", w.name, w.rows);
    assert_eq!(out.len(), tokens * nrows);
    let group = w.group;
    // Σ x per (token, group), shared by every row.
    let xsum: Vec<f32> = x.chunks_exact(group).map(|g| g.iter().sum()).collect();

    // Row-major over rows here ([r][t]); transposed into `out` afterwards.
    let mut rt = vec![0.0f32; nrows * tokens];
    rt.par_chunks_mut(ROWS_PER_TASK * tokens).enumerate().for_each(|(task, chunk)| {
        let first = task * ROWS_PER_TASK;
        let mut deq = if tokens > FUSED_MAX_TOKENS { vec![0.0f32; cols] } else { Vec::new() };
        for (i, row_out) in chunk.chunks_exact_mut(tokens).enumerate() {
            let r = row0 + first + i;
            if tokens <= FUSED_MAX_TOKENS {
                // Few tokens (decode, or an expert that got few tokens): the fused code-times-
                // activation loop beats dequantizing the row first.
                let gpr = w.groups_per_row();
                for (t, o) in row_out.iter_mut().enumerate() {
                    *o = row_dot(w, r, &x[t * cols..(t + 1) * cols], &xsum[t * gpr..(t + 1) * gpr]);
                }
            } else {
                // Prefill: dequantize the row once, reuse it for every token.
                dequantize_row(w, r, &mut deq);
                for (t, o) in row_out.iter_mut().enumerate() {
                    *o = dot_fast(&deq, &x[t * cols..(t + 1) * cols]);
                }
            }
        }
    });
    if tokens == 1 {
        out.copy_from_slice(&rt);
    } else {
        for r in 0..nrows {
            for t in 0..tokens {
                out[t * nrows + r] = rt[r * tokens + t];
            }
        }
    }
}

/// One row times one token: `Σ_g s_g Σ q x + b_g Σ x` (decode).
#[inline(always)]
fn row_dot_generic(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
    let (group, gpr, wpr) = (w.group, w.groups_per_row(), w.words_per_row());
    let words_per_group = group * w.bits / 32;
    let row_words = &w.words()[r * wpr..(r + 1) * wpr];
    let (sb, bb) = (w.scales.as_bytes(), w.biases.as_bytes());
    let mut acc = 0.0f32;
    for g in 0..gpr {
        let ws = &row_words[g * words_per_group..(g + 1) * words_per_group];
        let xs = &x[g * group..(g + 1) * group];
        let d = if w.bits == 4 { dot_q4(ws, xs) } else { dot_q8(ws, xs) };
        acc += scale_at(sb, w.scale_dtype, r * gpr + g) * d + scale_at(bb, w.scale_dtype, r * gpr + g) * xsum[g];
    }
    acc
}

// The same loops compiled with AVX2+FMA so the code-times-activation products vectorise; picked
// at run time, so the binary still runs on any x86-64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot_avx2(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
    row_dot_generic(w, r, x, xsum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot(a, b)
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn row_dot(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { row_dot_avx2(w, r, x, xsum) };
    }
    row_dot_generic(w, r, x, xsum)
}

/// [`dot`], vectorised with AVX2 when available.
pub fn dot_fast(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot(a, b)
}

/// Convenience: all rows, returns a new `[tokens, rows]` buffer.
pub fn qmatmul_all(w: &QuantTensor, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut out = vec![0.0; tokens * w.rows];
    qmatmul(w, 0, w.rows, x, tokens, &mut out);
    out
}

/// Dot product with 8 independent accumulators (lets the compiler vectorise).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}
