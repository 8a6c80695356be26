//! Sparse MoE block: softmax router over all experts, top-k, renormalise; routed SwiGLU experts
//! (tokens grouped by expert so each expert's weights are read once per call); shared expert
//! scaled by a scalar sigmoid gate.

use super::ops::{sigmoid, silu, softmax};
use super::qmatmul::{qmatmul, qmatmul_all};
use crate::checkpoint::ModelConfig;
use crate::model::MoeWeights;

/// Top-k routing of one token: (expert ids ascending by probability rank, renormalised weights).
pub fn route(logits: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
    let mut p = logits.to_vec();
    softmax(&mut p);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Highest probability first; ties go to the lower expert id (deterministic).
    idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    let total: f32 = idx.iter().map(|&e| p[e]).sum();
    let w = idx.iter().map(|&e| p[e] / total).collect();
    (idx, w)
}

/// SwiGLU of gate/up halves: `silu(g) * u`.
fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

pub fn forward(w: &MoeWeights, cfg: &ModelConfig, u: &[f32], tokens: usize) -> Vec<f32> {
    let h = cfg.hidden_size;
    let (e_count, top_k, inter) = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size);
    let router = qmatmul_all(&w.router, u, tokens);
    // Tokens (and their weights) per expert.
    let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
    for t in 0..tokens {
        let (ids, weights) = route(&router[t * e_count..(t + 1) * e_count], top_k);
        for (e, wt) in ids.into_iter().zip(weights) {
            assigned[e].push((t, wt));
        }
    }
    let mut out = vec![0.0f32; tokens * h];
    // Ascending expert id, as the reference accumulates.
    for (e, list) in assigned.iter().enumerate() {
        if list.is_empty() {
            continue;
        }
        let n = list.len();
        let mut x = Vec::with_capacity(n * h);
        for &(t, _) in list {
            x.extend_from_slice(&u[t * h..(t + 1) * h]);
        }
        let mut gate = vec![0.0f32; n * inter];
        let mut up = vec![0.0f32; n * inter];
        qmatmul(&w.gate_exps, e * inter, inter, &x, n, &mut gate);
        qmatmul(&w.up_exps, e * inter, inter, &x, n, &mut up);
        let act = swiglu(&gate, &up);
        let mut down = vec![0.0f32; n * h];
        qmatmul(&w.down_exps, e * h, h, &act, n, &mut down);
        for (i, &(t, wt)) in list.iter().enumerate() {
            for (o, &d) in out[t * h..(t + 1) * h].iter_mut().zip(&down[i * h..(i + 1) * h]) {
                *o += wt * d;
            }
        }
    }
    let sg = qmatmul_all(&w.shared_gate, u, tokens);
    let su = qmatmul_all(&w.shared_up, u, tokens);
    let shared = qmatmul_all(&w.shared_down, &swiglu(&sg, &su), tokens);
    let gate_logit = qmatmul_all(&w.shared_expert_gate, u, tokens);
    for t in 0..tokens {
        let s = sigmoid(gate_logit[t]);
        for (o, &v) in out[t * h..(t + 1) * h].iter_mut().zip(&shared[t * h..(t + 1) * h]) {
            *o += s * v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_is_softmax_topk_renormalised() {
        let logits = [0.1f32, 2.0, -1.0, 1.5, 0.3];
        let (ids, w) = route(&logits, 2);
        assert_eq!(ids, vec![1, 3]);
        let (a, b) = ((2.0f64).exp(), (1.5f64).exp());
        assert!((w[0] as f64 - a / (a + b)).abs() < 1e-6);
        assert!((w[1] as f64 - b / (a + b)).abs() < 1e-6);
    }
}
