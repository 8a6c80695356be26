//! Elementwise and normalisation operations of the model, in f32 (the CPU backend keeps every
//! activation in f32; it is the numerical reference the faster backends are measured against).

/// `y = x / sqrt(mean(x²) + eps) * gain` (the zero-centred Qwen RMSNorm with the MLX-stored
/// gain `1 + w`, and the plain gated-norm gain alike).
pub fn rms_norm(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(gain) {
        *o = v * inv * g;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, accumulated in f64 so long rows do not lose precision.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32
}

/// RMSNorm applied to each `dim`-wide row of `x` in place.
pub fn rms_norm_rows(x: &mut [f32], gain: &[f32], eps: f32) {
    let dim = gain.len();
    for row in x.chunks_exact_mut(dim) {
        let inv = inv_rms(row, eps);
        for (v, &g) in row.iter_mut().zip(gain) {
            *v *= inv * g;
        }
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// PyTorch's softplus (beta 1, threshold 20: linear above 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(‖x‖² + eps)` in place (the HF `l2norm` used on GDN q and k, eps 1e-6).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = (1.0 / (ss + eps as f64).sqrt()) as f32;
    for v in x {
        *v *= inv;
    }
}

/// Softmax in place with max subtraction.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Rotary tables for the first `rotary_dim` dimensions (NeoX half-split pairing):
/// `inv_freq[i] = theta^(-2i/rotary_dim)` for `i < rotary_dim/2`.
pub fn rope_inv_freq(rotary_dim: usize, theta: f64) -> Vec<f64> {
    (0..rotary_dim / 2).map(|i| theta.powf(-(2.0 * i as f64) / rotary_dim as f64)).collect()
}

/// Rotates dims `[0, rotary_dim)` of one head at absolute position `pos`: pairs `(i, i + half)`.
pub fn apply_rope(head: &mut [f32], pos: usize, inv_freq: &[f64]) {
    let half = inv_freq.len();
    for i in 0..half {
        let angle = pos as f64 * inv_freq[i];
        let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64, tol: f64) -> bool {
        ((a as f64) - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn rms_norm_matches_f64() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 7919) % 257) as f32 / 50.0 - 2.5).collect();
        let g: Vec<f32> = (0..256).map(|i| 0.5 + (i % 13) as f32 / 10.0).collect();
        let mut y = vec![0.0; 256];
        rms_norm(&x, &g, 1e-6, &mut y);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 256.0;
        for i in 0..256 {
            let want = x[i] as f64 / (ms + 1e-6).sqrt() * g[i] as f64;
            assert!(close(y[i], want, 1e-6), "{i}: {} vs {want}", y[i]);
        }
    }

    #[test]
    fn scalar_functions_match_f64() {
        for &x in &[-30.0f32, -5.0, -0.1, 0.0, 0.3, 4.0, 19.9, 20.1, 40.0] {
            let xd = x as f64;
            let sig = 1.0 / (1.0 + (-xd).exp());
            assert!(close(sigmoid(x), sig, 1e-6));
            assert!(close(silu(x), xd * sig, 1e-6));
            let sp = if xd > 20.0 { xd } else { xd.exp().ln_1p() };
            assert!(close(softplus(x), sp, 1e-6), "softplus {x}");
        }
    }

    #[test]
    fn softmax_and_l2_match_f64() {
        let mut x: Vec<f32> = vec![1.0, 3.0, -2.0, 0.5, 10.0];
        let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        softmax(&mut x);
        let m = xd.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = xd.iter().map(|v| (v - m).exp()).sum();
        for i in 0..5 {
            assert!(close(x[i], (xd[i] - m).exp() / s, 1e-6));
        }
        let mut v = vec![3.0f32, 4.0];
        l2_normalize(&mut v, 1e-6);
        assert!(close(v[0], 3.0 / (25.0f64 + 1e-6).sqrt(), 1e-7));
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_tail() {
        let inv = rope_inv_freq(8, 10_000_000.0);
        let mut h: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
        let orig = h.clone();
        apply_rope(&mut h, 7, &inv);
        for i in 0..4 {
            let ang = 7.0 * 10_000_000f64.powf(-(2.0 * i as f64) / 8.0);
            let (a, b) = (orig[i] as f64, orig[i + 4] as f64);
            assert!(close(h[i], a * ang.cos() - b * ang.sin(), 1e-6));
            assert!(close(h[i + 4], b * ang.cos() + a * ang.sin(), 1e-6));
        }
        assert_eq!(&h[8..], &orig[8..]);
        // Position 0 is the identity.
        let mut z = orig.clone();
        apply_rope(&mut z, 0, &inv);
        assert_eq!(z, orig);
    }
}
