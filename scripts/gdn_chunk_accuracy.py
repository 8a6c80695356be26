#!/usr/bin/env python3
"""How precise the operands of a chunked Gated DeltaNet prefill scan must be (numpy, CPU).

The chunked (WY / UT) form of the scan does its work as small matrix products per chunk of 64
tokens; on tensor cores those take bf16 (or tf32) operands with f32 accumulation. This models the
rounding of each operand class against the exact recurrence in f64 (the CUDA backend's
pf_gdn_scan and the CPU reference are exact f32 recurrences), at the 35B model's head shape
(dk = dv = 128), over T tokens, with q and k L2-normalised (q / sqrt(dk)), random beta and decays
in [lo, 1). Per chunk with start state S0 (docs/cuda-prefill.md):

    A = tril(beta_t exp(G_t - G_s) k_t . k_s, -1),   T = (I + A)^-1   (f32 here)
    U = T diag(beta) V,   W = T diag(beta exp(G)) K,   D = U - W S0
    O = exp(G) (Q S0) + tril(exp(G_t - G_s) q_t . k_s) D
    S = exp(G_last) S0 + (K exp(G_last - G))^T D

    python3 scripts/gdn_chunk_accuracy.py [--tokens 4096]
"""
import argparse

import numpy as np

DK, DV, GC = 128, 128, 64


def rnd(x, bits):
    """x rounded to nearest-even with `bits` mantissa bits (bf16: 7, tf32: 10); None: f32."""
    x = np.asarray(x, dtype=np.float32)
    if bits is None:
        return x
    u = x.view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    u = (u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) >> drop << drop
    return u.astype(np.uint32).view(np.float32)


def inputs(rng, t, decay_lo):
    q = rng.standard_normal((t, DK)).astype(np.float32)
    k = rng.standard_normal((t, DK)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True) * np.sqrt(DK)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((t, DV)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal(t)))).astype(np.float32)
    g = np.log(rng.uniform(decay_lo, 1.0, t)).astype(np.float32)
    return q, k, v, beta, g


def exact(q, k, v, beta, g, s0):
    s = s0.astype(np.float64).copy()
    o = np.zeros((len(q), DV))
    for t in range(len(q)):
        s *= np.exp(g[t])
        d = beta[t] * (v[t] - s.T @ k[t])
        s += np.outer(k[t], d)
        o[t] = s.T @ q[t]
    return o, s


def chunked(q, k, v, beta, g, s0, in_bits, mid_bits):
    """in_bits: q, k, v as the kernel reads them; mid_bits: W, M, D, the state and K's decayed
    rows as the products take them (the state is carried across chunks in f32)."""
    ri, rm = (lambda x: rnd(x, in_bits)), (lambda x: rnd(x, mid_bits))
    s = s0.astype(np.float32).copy()
    o = np.zeros((len(q), DV), np.float32)
    for c0 in range(0, len(q), GC):
        qc, kc, vc = ri(q[c0:c0 + GC]), ri(k[c0:c0 + GC]), ri(v[c0:c0 + GC])
        b, G = beta[c0:c0 + GC], np.cumsum(g[c0:c0 + GC]).astype(np.float32)
        e = np.exp(G[:, None] - G[None, :]).astype(np.float32)
        a = np.tril(b[:, None] * e * (kc @ kc.T), -1).astype(np.float32)
        tm = np.linalg.inv(np.eye(len(b)) + a).astype(np.float32)
        u = tm @ (b[:, None] * vc)
        w = tm @ ((b * np.exp(G))[:, None] * kc)
        d = u - rm(w) @ rm(s)
        m = np.tril(e * (qc @ kc.T)).astype(np.float32)
        o[c0:c0 + GC] = np.exp(G)[:, None] * (qc @ rm(s)) + rm(m) @ rm(d)
        es = np.exp(G[-1] - G).astype(np.float32)
        s = np.exp(G[-1]) * s + rm(kc * es[:, None]).T @ rm(d)
    return o, s


def rel(x, y):
    return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(y ** 2)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for lo in (0.9, 0.3):
        q, k, v, beta, g = inputs(rng, args.tokens, lo)
        s0 = (0.1 * rng.standard_normal((DK, DV))).astype(np.float32)
        oe, se = exact(q, k, v, beta, g, s0)
        ob, _ = exact(rnd(q, 7), rnd(k, 7), rnd(v, 7), beta, g, s0)
        print(f"decays in [{lo}, 1), T = {args.tokens}: error of the outputs (and the final state), relative RMS")
        print(f"  {'exact recurrence, q k v rounded to bf16':44s} {rel(ob, oe):.2e}")
        for name, ib, mb in [("chunked, f32", None, None), ("chunked, tf32 operands", 10, 10),
                             ("chunked, bf16 q k v, f32 products", 7, None), ("chunked, bf16 q k v, tf32 products", 7, 10),
                             ("chunked, bf16 operands", 7, 7)]:
            oc, sc = chunked(q, k, v, beta, g, s0, ib, mb)
            print(f"  {name:44s} {rel(oc, oe):.2e} (last chunk {rel(oc[-GC:], oe[-GC:]):.2e}, state {rel(sc, se):.2e})", flush=True)


if __name__ == "__main__":
    main()
