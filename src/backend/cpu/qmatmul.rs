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
    #[cfg(target_arch = "x86_64")]
    if w.bits == 4 && has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dequantize_row_q4_avx2(w, r, out) };
    }
    dequantize_row_generic(w, r, out)
}

#[inline(always)]
fn dequantize_row_generic(w: &QuantTensor, r: usize, out: &mut [f32]) {
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
        let first = row0 + task * ROWS_PER_TASK;
        let n = chunk.len() / tokens;
        if tokens <= FUSED_MAX_TOKENS {
            // Few tokens (decode, or an expert that got few tokens): the fused code-times-
            // activation loop beats dequantizing the row first.
            let gpr = w.groups_per_row();
            for t in 0..tokens {
                let (xt, st) = (&x[t * cols..(t + 1) * cols], &xsum[t * gpr..(t + 1) * gpr]);
                let mut i = 0;
                while i + 4 <= n {
                    for (k, d) in row_dot4(w, first + i, xt, st).into_iter().enumerate() {
                        chunk[(i + k) * tokens + t] = d;
                    }
                    i += 4;
                }
                for i in i..n {
                    chunk[i * tokens + t] = row_dot(w, first + i, xt, st);
                }
            }
        } else {
            // Prefill: dequantize the row once, reuse it for every token.
            let mut deq = vec![0.0f32; cols];
            for (i, row_out) in chunk.chunks_exact_mut(tokens).enumerate() {
                dequantize_row(w, first + i, &mut deq);
                let mut t = 0;
                while t + 4 <= tokens {
                    let xt = |i: usize| &x[(t + i) * cols..(t + i + 1) * cols];
                    row_out[t..t + 4].copy_from_slice(&dot4_fast(&deq, [xt(0), xt(1), xt(2), xt(3)]));
                    t += 4;
                }
                for t in t..tokens {
                    row_out[t] = dot_fast(&deq, &x[t * cols..(t + 1) * cols]);
                }
            }
        }
    });
    if tokens == 1 {
        out.copy_from_slice(&rt);
    } else {
        // In parallel, token rows of `out` per task (a serial transpose of a 248K-row lm_head
        // over hundreds of tokens took a tenth of a scoring run).
        out.par_chunks_mut(nrows).enumerate().for_each(|(t, o)| {
            for (r, v) in o.iter_mut().enumerate() {
                *v = rt[r * tokens + t];
            }
        });
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

// AVX2 versions of the scalar loops, written with intrinsics so that they vectorise at any
// optimisation level (opt-level 1 has no loop vectoriser). Each of the 8 (or 4) lanes is one of
// the scalar loop's accumulators, products and sums are rounded as there (multiply then add, no
// FMA) and the lanes are summed in the same order, so the results are bit-identical to the scalar
// loops; four rows (decode) or four tokens (prefill) run side by side so that the additions'
// latency overlaps. Picked at run time, so the binary still runs on any x86-64.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// The 8 codes of a 4-bit word as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn codes4(word: u32) -> __m256 {
        let q = _mm256_srlv_epi32(_mm256_set1_epi32(word as i32), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xF)))
    }

    /// The 4 codes of an 8-bit word as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn codes8(word: u32) -> __m128 {
        let q = _mm_srlv_epi32(_mm_set1_epi32(word as i32), _mm_setr_epi32(0, 8, 16, 24));
        _mm_cvtepi32_ps(_mm_and_si128(q, _mm_set1_epi32(0xFF)))
    }

    /// `acc + a * b`, rounded twice as the scalar loops do.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mul_add(acc: __m256, a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(acc, _mm256_mul_ps(a, b))
    }

    /// The lanes summed in order 0..8, as `[f32; 8].iter().sum()`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn lane_sum(v: __m256) -> f32 {
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum()
    }

    /// `dot_q4` of one group: `words` codes against `x` (8 values per word).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn group_q4(ws: *const u32, xs: *const f32, words: usize) -> __m256 {
        let mut a = _mm256_setzero_ps();
        for i in 0..words {
            a = mul_add(a, codes4(*ws.add(i)), _mm256_loadu_ps(xs.add(8 * i)));
        }
        a
    }

    /// `dot_q8` of one group (4 values per word).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn group_q8(ws: *const u32, xs: *const f32, words: usize) -> f32 {
        let mut a = _mm_setzero_ps();
        for i in 0..words {
            a = _mm_add_ps(a, _mm_mul_ps(codes8(*ws.add(i)), _mm_loadu_ps(xs.add(4 * i))));
        }
        let mut lanes = [0.0f32; 4];
        _mm_storeu_ps(lanes.as_mut_ptr(), a);
        lanes.iter().sum()
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot_avx2(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> f32 {
    let (group, gpr, wpr) = (w.group, w.groups_per_row(), w.words_per_row());
    let words_per_group = group * w.bits / 32;
    let row_words = &w.words()[r * wpr..(r + 1) * wpr];
    let (sb, bb) = (w.scales.as_bytes(), w.biases.as_bytes());
    assert!(x.len() >= gpr * group && xsum.len() >= gpr && (w.bits == 4 || w.bits == 8) && group % 8 == 0);
    let (wp, xp) = (row_words.as_ptr(), x.as_ptr());
    let mut acc = 0.0f32;
    for g in 0..gpr {
        let (ws, xs) = (wp.add(g * words_per_group), xp.add(g * group));
        let d = if w.bits == 4 { avx2::lane_sum(avx2::group_q4(ws, xs, words_per_group)) } else { avx2::group_q8(ws, xs, words_per_group) };
        acc += scale_at(sb, w.scale_dtype, r * gpr + g) * d + scale_at(bb, w.scale_dtype, r * gpr + g) * xsum[g];
    }
    acc
}

/// `row_dot_generic` of the 4-bit rows `r..r + 4` against one token, the rows side by side.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot4_q4_avx2(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let (group, gpr, wpr) = (w.group, w.groups_per_row(), w.words_per_row());
    let words_per_group = group / 8;
    let words = &w.words()[r * wpr..(r + 4) * wpr];
    let (sb, bb) = (w.scales.as_bytes(), w.biases.as_bytes());
    assert!(x.len() >= gpr * group && xsum.len() >= gpr && w.bits == 4 && group % 8 == 0);
    let (wp, xp) = (words.as_ptr(), x.as_ptr());
    let mut acc = [0.0f32; 4];
    for g in 0..gpr {
        let (ws, xs) = (wp.add(g * words_per_group), xp.add(g * group));
        let (mut a0, mut a1, mut a2, mut a3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        for i in 0..words_per_group {
            let xv = _mm256_loadu_ps(xs.add(8 * i));
            a0 = avx2::mul_add(a0, avx2::codes4(*ws.add(i)), xv);
            a1 = avx2::mul_add(a1, avx2::codes4(*ws.add(wpr + i)), xv);
            a2 = avx2::mul_add(a2, avx2::codes4(*ws.add(2 * wpr + i)), xv);
            a3 = avx2::mul_add(a3, avx2::codes4(*ws.add(3 * wpr + i)), xv);
        }
        for (k, a) in [a0, a1, a2, a3].into_iter().enumerate() {
            let sg = (r + k) * gpr + g;
            acc[k] += scale_at(sb, w.scale_dtype, sg) * avx2::lane_sum(a) + scale_at(bb, w.scale_dtype, sg) * xsum[g];
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequantize_row_q4_avx2(w: &QuantTensor, r: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let (group, gpr, wpr) = (w.group, w.groups_per_row(), w.words_per_row());
    let words = &w.words()[r * wpr..(r + 1) * wpr];
    let (sb, bb) = (w.scales.as_bytes(), w.biases.as_bytes());
    assert!(out.len() >= w.cols && group % 8 == 0);
    for g in 0..gpr {
        let s = _mm256_set1_ps(scale_at(sb, w.scale_dtype, r * gpr + g));
        let b = _mm256_set1_ps(scale_at(bb, w.scale_dtype, r * gpr + g));
        for i in g * group / 8..(g + 1) * group / 8 {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), avx2::mul_add(b, s, avx2::codes4(words[i])));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len()) / 8 * 8;
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        acc = avx2::mul_add(acc, _mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)));
    }
    let tail: f32 = a[n..].iter().zip(&b[n..]).map(|(x, y)| x * y).sum();
    avx2::lane_sum(acc) + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let n = b.iter().fold(a.len(), |n, b| n.min(b.len())) / 8 * 8;
    let (ap, [b0, b1, b2, b3]) = (a.as_ptr(), b.map(|b| b.as_ptr()));
    let (mut c0, mut c1, mut c2, mut c3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
    for i in (0..n).step_by(8) {
        let av = _mm256_loadu_ps(ap.add(i));
        c0 = avx2::mul_add(c0, av, _mm256_loadu_ps(b0.add(i)));
        c1 = avx2::mul_add(c1, av, _mm256_loadu_ps(b1.add(i)));
        c2 = avx2::mul_add(c2, av, _mm256_loadu_ps(b2.add(i)));
        c3 = avx2::mul_add(c3, av, _mm256_loadu_ps(b3.add(i)));
    }
    let tail = |b: &[f32]| -> f32 { a[n..].iter().zip(&b[n..]).map(|(x, y)| x * y).sum() };
    [
        avx2::lane_sum(c0) + tail(b[0]),
        avx2::lane_sum(c1) + tail(b[1]),
        avx2::lane_sum(c2) + tail(b[2]),
        avx2::lane_sum(c3) + tail(b[3]),
    ]
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

/// [`row_dot`] of rows `r..r + 4`.
fn row_dot4(w: &QuantTensor, r: usize, x: &[f32], xsum: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if w.bits == 4 && has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { row_dot4_q4_avx2(w, r, x, xsum) };
    }
    std::array::from_fn(|k| row_dot(w, r + k, x, xsum))
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

/// [`dot_fast`] of `a` with four vectors (the four computed side by side).
pub fn dot4_fast(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot4_avx2(a, b) };
    }
    b.map(|b| dot(a, b))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::TensorBytes;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    fn owned(bytes: Vec<u8>) -> TensorBytes {
        let len = bytes.len();
        let mut words = vec![0u64; len.div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len].copy_from_slice(&bytes);
        TensorBytes::Owned { words: Arc::new(words), len }
    }

    fn random_matrix(rng: &mut impl Rng, rows: usize, cols: usize, bits: usize) -> QuantTensor {
        let group = 64;
        let weight: Vec<u8> = (0..rows * cols * bits / 8).map(|_| rng.random()).collect();
        let bf16s = |n: usize, rng: &mut dyn rand::RngCore| -> Vec<u8> {
            (0..n).flat_map(|_| half::bf16::from_f32(rng.random_range(-0.1f32..0.1)).to_bits().to_le_bytes()).collect()
        };
        let scales = bf16s(rows * cols / group, rng);
        let biases = bf16s(rows * cols / group, rng);
        QuantTensor { name: "m".into(), rows, cols, bits, group, weight: owned(weight), scales: owned(scales), biases: owned(biases), scale_dtype: DType::BF16 }
    }

    // The AVX2 paths must give the scalar loops' results bit for bit: the CPU backend is the
    // reference, and which path runs depends on the machine.
    #[test]
    fn avx2_paths_equal_the_scalar_loops_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for bits in [4, 8] {
            let (rows, cols) = (9, 320);
            let w = random_matrix(&mut rng, rows, cols, bits);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let xsum: Vec<f32> = x.chunks_exact(w.group).map(|g| g.iter().sum()).collect();
            for r in 0..rows {
                let scalar = row_dot_generic(&w, r, &x, &xsum);
                // SAFETY: has_avx2() said the CPU has AVX2 and FMA.
                let simd = unsafe { row_dot_avx2(&w, r, &x, &xsum) };
                assert_eq!(scalar.to_bits(), simd.to_bits(), "{bits}-bit row {r}: {scalar} vs {simd}");
                if r + 4 <= rows {
                    let four = row_dot4(&w, r, &x, &xsum);
                    for (k, got) in four.into_iter().enumerate() {
                        assert_eq!(row_dot_generic(&w, r + k, &x, &xsum).to_bits(), got.to_bits(), "{bits}-bit rows {r}+{k}");
                    }
                }
                let (mut scalar, mut simd) = (vec![0.0f32; cols], vec![0.0f32; cols]);
                dequantize_row_generic(&w, r, &mut scalar);
                dequantize_row(&w, r, &mut simd);
                assert!(scalar.iter().zip(&simd).all(|(a, b)| a.to_bits() == b.to_bits()), "{bits}-bit row {r} dequantised");
            }
        }
        for n in [0, 5, 8, 64, 203] {
            let a: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            assert_eq!(dot(&a, &b).to_bits(), dot_fast(&a, &b).to_bits(), "dot of {n}");
            let bs: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect()).collect();
            let four = dot4_fast(&a, [&bs[0], &bs[1], &bs[2], &bs[3]]);
            for (b, got) in bs.iter().zip(four) {
                assert_eq!(dot(&a, b).to_bits(), got.to_bits(), "dot4 of {n}");
            }
        }
    }
}
