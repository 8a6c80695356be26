//! MLX affine quantization: `w = scale * q + bias`, q unsigned in `0..2^bits`, one scale and
//! one bias per group of `group` consecutive input columns. Codes are packed into
//! little-endian u32 words from the least significant bits up (4-bit: element `8j+k` in bits
//! `[4k, 4k+4)` of word j; 8-bit: element `4j+k` in bits `[8k, 8k+8)`).

use half::bf16;

/// Packs codes (each `< 2^bits`) into u32 words, MLX order.
pub fn pack_codes(codes: &[u8], bits: usize, out: &mut Vec<u32>) {
    let per_word = 32 / bits;
    assert_eq!(codes.len() % per_word, 0, "codes must fill whole words");
    for chunk in codes.chunks_exact(per_word) {
        let mut w = 0u32;
        for (k, &c) in chunk.iter().enumerate() {
            debug_assert!((c as u32) < (1 << bits));
            w |= (c as u32) << (bits * k);
        }
        out.push(w);
    }
}

/// Code `j` of a packed row.
#[inline(always)]
pub fn code_at(packed: &[u32], bits: usize, j: usize) -> u32 {
    let per_word = 32 / bits;
    (packed[j / per_word] >> (bits * (j % per_word))) & ((1u32 << bits) - 1)
}

/// Dequantizes one row of `cols` values into `out`.
pub fn dequantize_row(packed: &[u32], scales: &[bf16], biases: &[bf16], bits: usize, group: usize, out: &mut [f32]) {
    let cols = out.len();
    debug_assert_eq!(packed.len() * 32 / bits, cols);
    for (j, o) in out.iter_mut().enumerate() {
        let g = j / group;
        *o = scales[g].to_f32() * code_at(packed, bits, j) as f32 + biases[g].to_f32();
    }
    let _ = cols;
}

/// MLX's affine quantizer (`quantize` in mlx/backend/cpu/quantized.cpp), bit for bit: per
/// group, the edge of larger magnitude is represented exactly (the scale is negative when that
/// edge is the maximum, so codes still count up from the bias), and the codes are computed
/// from the f32 scale and bias *before* they are rounded to bf16 for storage. Every rounding is
/// round-half-to-even (`std::rint`), and the arithmetic is plain f32 (no fused multiply-add),
/// so `lily quantize` reproduces `mlx_lm.convert -q` exactly. Returns (codes, scales, biases)
/// for one row whose values are `w` (bf16-exact values when the source is bf16).
pub fn quantize_row(w: &[f32], bits: usize, group: usize) -> (Vec<u8>, Vec<bf16>, Vec<bf16>) {
    let mut codes = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / group);
    let mut biases = Vec::with_capacity(w.len() / group);
    for g in w.chunks(group) {
        let (s, b) = quantize_group(g, bits, &mut codes);
        scales.push(s);
        biases.push(b);
    }
    (codes, scales, biases)
}

/// One group of [`quantize_row`]: appends its codes, returns its stored scale and bias.
pub fn quantize_group(g: &[f32], bits: usize, codes: &mut Vec<u8>) -> (bf16, bf16) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &x in g {
        // std::min/max order as in MLX (a NaN input is not propagated the same way; the
        // quantize command rejects non-finite weights before getting here).
        hi = if hi < x { x } else { hi };
        lo = if x < lo { x } else { lo };
    }
    let min_side = lo.abs() > hi.abs();
    let mut scale = ((hi - lo) / n_bins).max(1e-7);
    if !min_side {
        scale = -scale;
    }
    let edge = if min_side { lo } else { hi };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for &x in g {
        codes.push(((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u8);
    }
    (bf16::from_f32(scale), bf16::from_f32(bias))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_layout_matches_mlx() {
        let codes: Vec<u8> = (0..16).map(|i| i as u8).collect();
        let mut packed = Vec::new();
        pack_codes(&codes, 4, &mut packed);
        // element 0 in the low nibble of byte 0, element 1 in its high nibble
        assert_eq!(packed[0].to_le_bytes(), [0x10, 0x32, 0x54, 0x76]);
        for j in 0..16 {
            assert_eq!(code_at(&packed, 4, j), j as u32);
        }
        let mut p8 = Vec::new();
        pack_codes(&[1, 2, 3, 250], 8, &mut p8);
        assert_eq!(p8[0].to_le_bytes(), [1, 2, 3, 250]);
    }

    #[test]
    fn quantizer_rounds_half_to_even_from_the_unrounded_scale() {
        // max 15, min 0: scale -1, bias 15, code = rint(15 - x); 15 - 2.5 = 12.5 rounds to 12
        // (MLX's std::rint), not 13; 15 - 3.5 = 11.5 to 12.
        let mut w = vec![0.0f32; 64];
        w[0] = 15.0;
        w[1] = 2.5;
        w[2] = 3.5;
        let (codes, s, b) = quantize_row(&w, 4, 64);
        assert_eq!((s[0].to_f32(), b[0].to_f32()), (-1.0, 15.0));
        assert_eq!(&codes[..4], &[0, 12, 12, 15]);
        // All zeros (the fixture's unused vocabulary rows): codes 0, bias 0, so they
        // dequantize to exactly 0.
        let (codes, s, b) = quantize_row(&[0.0; 64], 4, 64);
        assert!(codes.iter().all(|&c| c == 0) && b[0].to_f32() == 0.0 && s[0].to_f32() != 0.0);
    }

    #[test]
    fn quantize_round_trips_within_one_step() {
        let w: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) / 33.0).collect();
        for bits in [4usize, 8] {
            let (codes, s, b) = quantize_row(&w, bits, 64);
            let mut packed = Vec::new();
            pack_codes(&codes, bits, &mut packed);
            let mut back = vec![0.0; w.len()];
            dequantize_row(&packed, &s, &b, bits, 64, &mut back);
            for (g, chunk) in w.chunks(64).enumerate() {
                let step = s[g].to_f32().abs();
                for (j, &x) in chunk.iter().enumerate() {
                    let err = (back[g * 64 + j] - x).abs();
                    assert!(err <= 1.01 * step, "bits {bits} err {err} step {step}");
                }
            }
        }
    }
}
