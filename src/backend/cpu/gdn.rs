//! Gated DeltaNet layer: projections, causal depthwise conv + SiLU, q/k L2 norm, gates, the
//! delta-rule recurrence (chunked form for prefill, recurrent step for decode), gated RMSNorm,
//! output projection. The recurrent state is f32 `[value_head][Dk][Dv]` (HF layout).

use super::ops::{l2_normalize, rms_norm, sigmoid, silu, softplus};
use super::qmatmul::{dot_fast, qmatmul_all};
use crate::checkpoint::ModelConfig;
use crate::model::GdnWeights;
use rayon::prelude::*;

/// Chunk length of the chunked (UT-transform) prefill form, as in HF and FLA.
pub const CHUNK: usize = 64;

/// Per-sequence caches of one GDN layer.
#[derive(Clone)]
pub struct GdnState {
    /// The last `K-1` pre-conv inputs, oldest first: `[K-1][conv_dim]`.
    pub conv: Vec<f32>,
    /// `[nv][dk][dv]`.
    pub state: Vec<f32>,
}

impl GdnState {
    pub fn new(cfg: &ModelConfig) -> Self {
        GdnState {
            conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()],
            state: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
        }
    }
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.state.len()) * 4
    }
}

/// Inputs of the delta rule for one value head over T tokens (already normalised and gated).
pub struct HeadInputs<'a> {
    /// `[T][dk]` (query pre-scaled by `dk^-1/2`).
    pub q: &'a [f32],
    pub k: &'a [f32],
    /// `[T][dv]`
    pub v: &'a [f32],
    pub beta: &'a [f32],
    /// log-decay per token
    pub g: &'a [f32],
}

/// One token of the recurrence: `S = αS; δ = β(v − Sᵀk); S += kδᵀ; o = Sᵀq`.
pub fn recurrent_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, g: f32, dv: usize, out: &mut [f32]) {
    let alpha = g.exp();
    let dk = k.len();
    for x in s.iter_mut() {
        *x *= alpha;
    }
    let mut kv = vec![0.0f32; dv];
    for i in 0..dk {
        let row = &s[i * dv..(i + 1) * dv];
        for (acc, &x) in kv.iter_mut().zip(row) {
            *acc += x * k[i];
        }
    }
    let delta: Vec<f32> = (0..dv).map(|j| beta * (v[j] - kv[j])).collect();
    out.fill(0.0);
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        for ((x, &d), o) in row.iter_mut().zip(&delta).zip(out.iter_mut()) {
            *x += k[i] * d;
            *o += *x * q[i];
        }
    }
}

/// The chunked form (model.md §3) over all tokens of one head, updating `s` and writing
/// `[T][dv]` outputs. Equal to running [`recurrent_step`] per token, in exact arithmetic.
pub fn chunked(s: &mut [f32], inp: &HeadInputs, dk: usize, dv: usize, out: &mut [f32]) {
    let t_total = inp.beta.len();
    let mut start = 0;
    while start < t_total {
        let n = CHUNK.min(t_total - start);
        let q = &inp.q[start * dk..(start + n) * dk];
        let k = &inp.k[start * dk..(start + n) * dk];
        let v = &inp.v[start * dv..(start + n) * dv];
        let beta = &inp.beta[start..start + n];
        // γ_r: cumulative log-decay inside the chunk.
        let mut gamma = vec![0.0f32; n];
        let mut acc = 0.0f32;
        for r in 0..n {
            acc += inp.g[start + r];
            gamma[r] = acc;
        }
        let kr = |r: usize| &k[r * dk..(r + 1) * dk];
        let qr = |r: usize| &q[r * dk..(r + 1) * dk];
        // L[r][s] = β_r (k_r·k_s) exp(γ_r − γ_s), s < r.
        let mut l = vec![0.0f32; n * n];
        for r in 0..n {
            for c in 0..r {
                l[r * n + c] = beta[r] * dot_fast(kr(r), kr(c)) * (gamma[r] - gamma[c]).exp();
            }
        }
        // Forward substitution with (I + L): U = T·diag(β)V, W = T·diag(β e^γ)K.
        let mut u = vec![0.0f32; n * dv];
        let mut w = vec![0.0f32; n * dk];
        for r in 0..n {
            let eg = gamma[r].exp();
            for j in 0..dv {
                u[r * dv + j] = beta[r] * v[r * dv + j];
            }
            for j in 0..dk {
                w[r * dk + j] = beta[r] * eg * k[r * dk + j];
            }
            for c in 0..r {
                let lrc = l[r * n + c];
                if lrc != 0.0 {
                    let (done_u, cur_u) = u.split_at_mut(r * dv);
                    for (x, &y) in cur_u[..dv].iter_mut().zip(&done_u[c * dv..(c + 1) * dv]) {
                        *x -= lrc * y;
                    }
                    let (done_w, cur_w) = w.split_at_mut(r * dk);
                    for (x, &y) in cur_w[..dk].iter_mut().zip(&done_w[c * dk..(c + 1) * dk]) {
                        *x -= lrc * y;
                    }
                }
            }
        }
        // V_new = U − W S.
        let mut vnew = u;
        for r in 0..n {
            let row = &mut vnew[r * dv..(r + 1) * dv];
            for i in 0..dk {
                let wi = w[r * dk + i];
                for (x, &sv) in row.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *x -= wi * sv;
                }
            }
        }
        // O_r = e^{γ_r} q_r S + Σ_{c≤r} (q_r·k_c) e^{γ_r−γ_c} V_new_c.
        for r in 0..n {
            let o = &mut out[(start + r) * dv..(start + r + 1) * dv];
            o.fill(0.0);
            let eg = gamma[r].exp();
            for i in 0..dk {
                let qi = qr(r)[i] * eg;
                for (x, &sv) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *x += qi * sv;
                }
            }
            for c in 0..=r {
                let a = dot_fast(qr(r), kr(c)) * (gamma[r] - gamma[c]).exp();
                for (x, &y) in o.iter_mut().zip(&vnew[c * dv..(c + 1) * dv]) {
                    *x += a * y;
                }
            }
        }
        // S ← e^{γ_last} S + Σ_c (e^{γ_last − γ_c} k_c) ⊗ V_new_c.
        let last = gamma[n - 1];
        let el = last.exp();
        for x in s.iter_mut() {
            *x *= el;
        }
        for c in 0..n {
            let f = (last - gamma[c]).exp();
            for i in 0..dk {
                let ki = f * k[c * dk + i];
                for (x, &y) in s[i * dv..(i + 1) * dv].iter_mut().zip(&vnew[c * dv..(c + 1) * dv]) {
                    *x += ki * y;
                }
            }
        }
        start += n;
    }
}

/// The causal depthwise conv + SiLU of the rows after the first `kk - 1` of `padded`
/// (`[kk - 1 history rows | new rows][conv_dim]`) with `taps` (`[kk][conv_dim]`): row t, channel
/// c is `silu(sum over taps j of taps[j][c] * padded[t + j][c])`, summed in tap order.
pub fn causal_conv_silu(padded: &[f32], taps: &[f32], conv_dim: usize, kk: usize) -> Vec<f32> {
    let tokens = padded.len() / conv_dim - (kk - 1);
    let mut out = vec![0.0f32; tokens * conv_dim];
    out.par_chunks_mut(conv_dim).enumerate().for_each(|(t, row)| {
        for (ch, o) in row.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for j in 0..kk {
                acc += taps[j * conv_dim + ch] * padded[(t + j) * conv_dim + ch];
            }
            *o = silu(acc);
        }
    });
    out
}

/// The whole GDN mixer for T tokens of normed input `u` (`[T][hidden]`). Returns `[T][hidden]`.
pub fn forward(w: &GdnWeights, cfg: &ModelConfig, u: &[f32], tokens: usize, st: &mut GdnState) -> Vec<f32> {
    let (nk, nv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let conv_dim = cfg.gdn_conv_dim();
    let kk = cfg.linear_conv_kernel_dim;
    let eps = cfg.rms_norm_eps as f32;
    let mixed = qmatmul_all(&w.in_qkv, u, tokens);
    let z = qmatmul_all(&w.in_z, u, tokens);
    let b = qmatmul_all(&w.in_b, u, tokens);
    let a = qmatmul_all(&w.in_a, u, tokens);

    // Causal depthwise conv over [cached K-1 inputs | new inputs], then SiLU.
    let hist = kk - 1;
    let mut padded = Vec::with_capacity((hist + tokens) * conv_dim);
    padded.extend_from_slice(&st.conv);
    padded.extend_from_slice(&mixed);
    let conv_out = causal_conv_silu(&padded, &w.conv_taps, conv_dim, kk);
    st.conv.copy_from_slice(&padded[tokens * conv_dim..]);

    // Split, normalise, gather per head: q,k are [T][nk][dk] in conv_out; v is [T][nv][dv].
    let key_dim = nk * dk;
    let q_scale = 1.0 / (dk as f32).sqrt();
    let group = nv / nk;
    let head_outputs: Vec<Vec<f32>> = st
        .state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(n, s)| {
            let kh = n / group;
            let mut q = vec![0.0f32; tokens * dk];
            let mut k = vec![0.0f32; tokens * dk];
            let mut v = vec![0.0f32; tokens * dv];
            let mut beta = vec![0.0f32; tokens];
            let mut g = vec![0.0f32; tokens];
            for t in 0..tokens {
                let row = &conv_out[t * conv_dim..(t + 1) * conv_dim];
                let qd = &mut q[t * dk..(t + 1) * dk];
                qd.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
                l2_normalize(qd, 1e-6);
                qd.iter_mut().for_each(|x| *x *= q_scale);
                let kd = &mut k[t * dk..(t + 1) * dk];
                kd.copy_from_slice(&row[key_dim + kh * dk..key_dim + (kh + 1) * dk]);
                l2_normalize(kd, 1e-6);
                v[t * dv..(t + 1) * dv].copy_from_slice(&row[2 * key_dim + n * dv..2 * key_dim + (n + 1) * dv]);
                beta[t] = sigmoid(b[t * nv + n]);
                g[t] = w.neg_a[n] * softplus(a[t * nv + n] + w.dt_bias[n]);
            }
            let mut o = vec![0.0f32; tokens * dv];
            if tokens == 1 {
                recurrent_step(s, &q, &k, &v, beta[0], g[0], dv, &mut o);
            } else {
                chunked(s, &HeadInputs { q: &q, k: &k, v: &v, beta: &beta, g: &g }, dk, dv, &mut o);
            }
            o
        })
        .collect();

    // Gated RMSNorm per (token, head): norm(o) * w * silu(z).
    let value_dim = nv * dv;
    let mut y = vec![0.0f32; tokens * value_dim];
    for t in 0..tokens {
        for (n, o) in head_outputs.iter().enumerate() {
            let dst = &mut y[t * value_dim + n * dv..t * value_dim + (n + 1) * dv];
            rms_norm(&o[t * dv..(t + 1) * dv], &w.norm, eps, dst);
            for (x, &zz) in dst.iter_mut().zip(&z[t * value_dim + n * dv..t * value_dim + (n + 1) * dv]) {
                *x *= silu(zz);
            }
        }
    }
    qmatmul_all(&w.out, &y, tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1).
    fn rnd(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Plain f64 recurrence, the definition.
    fn reference(q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], dk: usize, dv: usize, s0: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let t_total = beta.len();
        let mut s: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let mut out = vec![0.0f64; t_total * dv];
        for t in 0..t_total {
            let a = (g[t] as f64).exp();
            s.iter_mut().for_each(|x| *x *= a);
            for j in 0..dv {
                let kv: f64 = (0..dk).map(|i| s[i * dv + j] * k[t * dk + i] as f64).sum();
                let d = beta[t] as f64 * (v[t * dv + j] as f64 - kv);
                for i in 0..dk {
                    s[i * dv + j] += k[t * dk + i] as f64 * d;
                }
            }
            for j in 0..dv {
                out[t * dv + j] = (0..dk).map(|i| s[i * dv + j] * q[t * dk + i] as f64).sum();
            }
        }
        (out, s)
    }

    fn normalized(mut x: Vec<f32>, d: usize) -> Vec<f32> {
        for row in x.chunks_exact_mut(d) {
            l2_normalize(row, 1e-6);
        }
        x
    }

    #[test]
    fn chunked_and_recurrent_match_f64_definition() {
        let (dk, dv) = (16, 8);
        for &t in &[1usize, 5, 64, 65, 150] {
            let q = normalized(rnd(1, t * dk), dk);
            let k = normalized(rnd(2, t * dk), dk);
            let v = rnd(3, t * dv);
            let beta: Vec<f32> = rnd(4, t).iter().map(|x| 0.5 + 0.5 * x).collect();
            let g: Vec<f32> = rnd(5, t).iter().map(|x| -0.3 * (1.0 + x)).collect();
            let s0 = rnd(6, dk * dv);
            let (want_o, want_s) = reference(&q, &k, &v, &beta, &g, dk, dv, &s0);

            let mut s = s0.clone();
            let mut o = vec![0.0; t * dv];
            chunked(&mut s, &HeadInputs { q: &q, k: &k, v: &v, beta: &beta, g: &g }, dk, dv, &mut o);
            let mut s2 = s0.clone();
            let mut o2 = vec![0.0; t * dv];
            for i in 0..t {
                recurrent_step(&mut s2, &q[i * dk..(i + 1) * dk], &k[i * dk..(i + 1) * dk], &v[i * dv..(i + 1) * dv], beta[i], g[i], dv, &mut o2[i * dv..(i + 1) * dv]);
            }
            for (name, got_o, got_s) in [("chunked", &o, &s), ("recurrent", &o2, &s2)] {
                let eo = got_o.iter().zip(&want_o).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                let es = got_s.iter().zip(&want_s).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(eo < 2e-5 && es < 2e-5, "{name} T={t}: out err {eo}, state err {es}");
            }
        }
    }
}
