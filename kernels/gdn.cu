// Gated DeltaNet (linear attention with the delta rule). Same math and order as
// src/backend/cpu/gdn.rs.
//   decode (T = 1):     gdn_step
//   batched decode:     gdn_step_batch (one token of each of B sequences)
//   prefill (T tokens): pf_gdn_conv, pf_gdn_ring, pf_gdn_conv_qk, pf_gdn_scan_{32,64,128} (exact),
//                       pf_gdn_chunk_prep_{64,128} + pf_gdn_chunk_walk_{64,128} (chunked), pf_gdn_norm

// softplus as the CPU reference computes it (src/backend/cpu/ops.rs).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ================================ decode (T = 1) ================================
// Channel c of value head n's conv inputs (its key head kh's q, then k, then its own v) as
// an index into a conv row [q of every key head | k of every key head | v of every value head].
__device__ __forceinline__ int gdn_head_channel(int kh, int n, int c, int dk, int dv, int key_dim) {
    if (c < dk) return kh * dk + c;
    if (c < 2 * dk) return key_dim + kh * dk + (c - dk);
    return 2 * key_dim + n * dv + (c - 2 * dk);
}

// Gated DeltaNet decode step, one block per value head, everything fused:
// causal conv1d step + SiLU on the head's q/k/v channels, L2 norm of q and k, the gates
// (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)), the delta-rule update of the
// fp32 state S [dk][dv] and o = S^T q, then the gated RMSNorm norm(o) * w * silu(z).
// Same math and order as src/backend/cpu/gdn.rs (recurrent_step).
//
// Threads: dv * (dk / 32). Thread (j, r) owns column j and rows [32r, 32r + 32) of S, kept in
// registers across both passes (read once, written once), or in shared memory (SMEM_STATE).
//
// The conv history is a ring of KC slots indexed by position: the new input goes to slot
// pos % KC, which only held position pos - KC (no longer needed). Blocks sharing a key head read
// the q/k history while one of them writes the new value, and no block reads the slot being
// written, so there is no race without a second kernel.
#define GDN_SL 32

// The recurrent state's element in memory: f32, or f16 (u16 bits; half the bytes every decode
// step reads and writes, and half a sequence's state memory). The arithmetic is f32 either way:
// an entry is widened when loaded and rounded to nearest when stored, saturating at f16's largest
// finite value (NaN stays NaN); docs/correctness.md has what the rounding costs on the trained
// fixture.
__device__ __forceinline__ float gdn_st_widen(float x) { return x; }
__device__ __forceinline__ float gdn_st_widen(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
template <typename ST>
__device__ __forceinline__ float gdn_st_ld(const ST* p) { return gdn_st_widen(*p); }
__device__ __forceinline__ void gdn_st_st(float* p, float x) { *p = x; }
__device__ __forceinline__ void gdn_st_st(u16* p, float x) {
    u16 h;
    asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    *p = h;
}
// Two adjacent state entries (an even column and the next, 4- or 8-byte aligned) widened to f32,
// and stored back (the f16 pair as one word, `a` at the lower address).
__device__ __forceinline__ float2 gdn_st_ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 gdn_st_ld2(const u16* p) {
    const u32 w = *reinterpret_cast<const u32*>(p);
    return make_float2(gdn_st_widen((u16)(w & 0xffffu)), gdn_st_widen((u16)(w >> 16)));
}
__device__ __forceinline__ void gdn_st_st2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void gdn_st_st2(u16* p, float a, float b) {
    u32 w;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(b), "f"(a));
    *reinterpret_cast<u32*>(p) = w;
}
// A state slice's size in f32 words (the shared-memory stages count in floats).
template <typename ST>
__device__ __forceinline__ int gdn_st_words(int n) { return sizeof(ST) == 4 ? n : n >> 1; }

template <bool SMEM_STATE, typename ST>
__device__ __forceinline__ void gdn_step_tail(const ST* Ssm, float (&s)[SMEM_STATE ? 1 : GDN_SL], float* qs,
                                              ST* __restrict__ S, float bn, float an, float zj, float dtb,
                                              float nega, float nwj, float* __restrict__ y, int n, int nv, int dk,
                                              int dv, float eps, u32* __restrict__ frag, float* __restrict__ gsum,
                                              int row, int threads = 0);

// SMEM_STATE (the batched step): the state slice goes through shared memory by cp.async instead of
// registers, so a thread holds no state and three blocks fit on an SM (two with the register
// slice; four with the f16 state, whose slice is half the bytes): more of the state's reads are
// in flight while other blocks run their conv and norms.
// The same operations in the same order either way.
template <bool SMEM_STATE, typename ST>
__device__ __forceinline__ void gdn_step_impl(const float* __restrict__ qkv, const float* __restrict__ z,
                                              const float* __restrict__ braw, const float* __restrict__ araw,
                                              float* __restrict__ ring, const float* __restrict__ taps,
                                              const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                              const float* __restrict__ norm_w, ST* __restrict__ state,
                                              float* __restrict__ y, const int* __restrict__ step, int nk, int nv,
                                              int dk, int dv, int KC, float eps, u32* __restrict__ frag = nullptr,
                                              float* __restrict__ gsum = nullptr, int row = 0, int threads = 0) {
    extern __shared__ float sm[];
    ST* Ssm = reinterpret_cast<ST*>(sm);                      // dk * dv (SMEM_STATE)
    float* qs = SMEM_STATE ? sm + gdn_st_words<ST>(dk * dv) : sm;  // dk
    float* ks = qs + dk;       // dk
    float* vs = ks + dk;       // dv
    // then the scratch of gdn_step_tail: 2 * (dk/32) * dv kv / o partials, 33 floats.
    const int n = blockIdx.x, group = nv / nk, kh = n / group;
    const int key_dim = nk * dk, conv_dim = 2 * key_dim + nv * dv;
    const int pos = step[1], slot = pos % KC;
    const int tid = threadIdx.x, nt = threads ? threads : (int)blockDim.x;
    // The state slice does not depend on this step's inputs: its loads (the head's 64 KB, the
    // bulk of the kernel's traffic) are issued first and overlap the conv / norm prologue.
    const int j = tid % dv, r = tid / dv, i0 = r * GDN_SL;
    const bool active = r < dk / GDN_SL;
    ST* S = state + (size_t)n * dk * dv;
    float s[SMEM_STATE ? 1 : GDN_SL];
    if constexpr (SMEM_STATE) {
        constexpr int per16 = 16 / sizeof(ST);  // elements per 16-byte copy
#pragma unroll 4
        for (int p = tid; p < gdn_st_words<ST>(dk * dv) >> 2; p += nt) cp_async16(Ssm + per16 * p, S + per16 * p);
        cp_commit();
    } else if (active) {
#pragma unroll
        for (int ii = 0; ii < GDN_SL; ++ii) s[ii] = gdn_st_ld(S + (size_t)(i0 + ii) * dv + j);
    }
    // The state was written by this layer's step of the previous token (an earlier step), so it
    // is read before the PDL wait, like the static parameters and the conv history of this
    // thread's first channel (ring slots of earlier positions): its conv sum over the history
    // taps is formed here, in the same order as the full sum below. The projections (qkv, z, b,
    // a) are read only after the wait.
    const int nch = 2 * dk + dv;
    auto chan = [&](int idx) { return gdn_head_channel(kh, n, idx, dk, dv, key_dim); };
    float pre = 0.f, tap_last = 0.f;
    const int ch0 = tid < nch ? chan(tid) : 0;
    // Position p = pos - (KC - 1) + jj sits in ring slot p % KC = (slot + 1 + jj) % KC: the slots
    // are counted on from `slot`, not divided out per tap (a division by the run-time KC is some
    // 25 instructions).
    if (tid < nch) {
        for (int jj = 0, sl = slot; jj < KC - 1; ++jj) {
            if (++sl == KC) sl = 0;
            int p = pos - (KC - 1) + jj;
            float in = p < 0 ? 0.f : ring[(size_t)sl * conv_dim + ch0];
            pre += taps[(size_t)jj * conv_dim + ch0] * in;
        }
        tap_last = taps[(size_t)(KC - 1) * conv_dim + ch0];
    }
    const float dtb = dt_bias[n], nega = neg_a[n], nwj = norm_w[j];
    pdl_wait_trigger();
    // This step's gate inputs and the output gate z, read now so their L2 round trips overlap
    // the conv instead of adding to the tail.
    const float bn = braw[n], an = araw[n];
    const float zj = z[(size_t)n * dv + j];

    for (int idx = tid; idx < nch; idx += nt) {
        const int ch = idx == tid ? ch0 : chan(idx);
        float cur = qkv[ch];
        float acc;
        if (idx == tid) {
            acc = pre + tap_last * cur;
        } else {
            acc = 0.f;
            for (int jj = 0, sl = slot; jj < KC; ++jj) {
                if (++sl == KC) sl = 0;
                int p = pos - (KC - 1) + jj;
                float in = (jj == KC - 1) ? cur : (p < 0 ? 0.f : ring[(size_t)sl * conv_dim + ch]);
                acc += taps[(size_t)jj * conv_dim + ch] * in;
            }
        }
        float o = silu_f(acc);
        if (idx < dk) qs[idx] = o;
        else if (idx < 2 * dk) ks[idx - dk] = o;
        else vs[idx - 2 * dk] = o;
        // q/k channels are shared by `group` value heads: the first of them stores the history.
        if (idx >= 2 * dk || n % group == 0) ring[(size_t)slot * conv_dim + ch] = cur;
    }
    if constexpr (SMEM_STATE) cp_wait<0>();
    __syncthreads();
    gdn_step_tail<SMEM_STATE, ST>(Ssm, s, qs, S, bn, an, zj, dtb, nega, nwj, y, n, nv, dk, dv, eps, frag, gsum, row, threads);
}

// Everything after the conv: q, k (normalised here) and v of the head in qs | ks | vs (then the
// scratch of GdnDims::step_smem), the state slice in Ssm (SMEM_STATE, loaded and synchronised)
// or in s (this thread's 32 entries), written back to S; the head's gated-norm outputs to y
// and, with `frag`, staged for the out-projection at row `row`.
template <bool SMEM_STATE, typename ST>
__device__ __forceinline__ void gdn_step_tail(const ST* Ssm, float (&s)[SMEM_STATE ? 1 : GDN_SL], float* qs,
                                              ST* __restrict__ S, float bn, float an, float zj, float dtb,
                                              float nega, float nwj, float* __restrict__ y, int n, int nv, int dk,
                                              int dv, float eps, u32* __restrict__ frag, float* __restrict__ gsum,
                                              int row, int threads) {
    float* ks = qs + dk;
    float* vs = ks + dk;
    float* part = vs + dv;
    float* red = part + 2 * (dk / GDN_SL) * dv;
    const int tid = threadIdx.x, nt = threads ? threads : (int)blockDim.x;
    const int j = tid % dv, r = tid / dv, i0 = r * GDN_SL;
    const bool active = r < dk / GDN_SL;
    // L2 norms (eps 1e-6, as HF's l2norm) and the 1/sqrt(dk) query scale: the first dk threads
    // (whole warps) reduce q*q and k*k, one barrier publishes the warp sums, and every thread
    // forms the same factors. The single-sequence step normalises q and k where they are read
    // (qs[i] * iq * qscale and ks[i] * ik: a separate pass's products without its barrier, which
    // would sit on its latency path); the batched step scales them once below.
    const int lane = tid & 31, warp = tid >> 5, kw = dk >> 5;
    if (tid < dk) {
        const float q = qs[tid], k = ks[tid];
        const float wq = warp_sum(q * q), wk = warp_sum(k * k);
        if (lane == 0) { red[warp] = wq; red[kw + warp] = wk; }
    }
    __syncthreads();
    // The norms' factors and the gates: the same values in every thread that forms them.
    auto factors = [&](float& iq, float& ik) {
        float sq = 0.f, sk = 0.f;
        for (int w = 0; w < kw; ++w) { sq += red[w]; sk += red[kw + w]; }
        iq = (float)(1.0 / sqrt((double)sq + 1e-6));
        ik = (float)(1.0 / sqrt((double)sk + 1e-6));
    };
    auto gates = [&](float& beta, float& alpha) {
        beta = sigmoid_f(bn);
        alpha = expf(nega * softplus_f(an + dtb));
    };
    float iq = 0.f, ik = 0.f, beta, alpha;
    if constexpr (!SMEM_STATE) factors(iq, ik);
    const float qscale = 1.f / sqrtf((float)dk);
    // The batched step (SMEM_STATE) runs several blocks per SM, where the instruction streams,
    // not one block's latency, set the pace: q and k are scaled once, in place, behind one more
    // barrier, instead of in every thread's both passes (the same products either way), and the
    // factors and gates are formed by the dk threads that scale them (thread 0 leaving the gates
    // in o's partial-sum buffer, which the passes write only after their first barrier) rather
    // than by each of the block's threads.
    if constexpr (SMEM_STATE) {
        float* gate_sm = part + (dk / GDN_SL) * dv;
        if (tid < dk) {
            factors(iq, ik);
            qs[tid] = qs[tid] * iq * qscale;
            ks[tid] = ks[tid] * ik;
            if (tid == 0) {
                gates(beta, alpha);
                gate_sm[0] = beta;
                gate_sm[1] = alpha;
            }
        }
        __syncthreads();
        beta = gate_sm[0];
        alpha = gate_sm[1];
    } else {
        gates(beta, alpha);
    }
    auto qn = [&](int i) { return SMEM_STATE ? qs[i] : qs[i] * iq * qscale; };
    auto kn = [&](int i) { return SMEM_STATE ? ks[i] : ks[i] * ik; };

    if constexpr (SMEM_STATE) {
        float* part_o = part + (dk / GDN_SL) * dv;  // o's partial sums: no barrier before writing them
        // Two adjacent columns per thread (one 4- or 8-byte access for both entries of a row, and
        // one k / q read for both), the first (dv / 2) * (dk / 32) threads: each column's sums
        // are the one-column form's, in the same order, so the same bits.
        const int hv = dv >> 1, jp = 2 * (tid % hv), rp = tid / hv, ip0 = rp * GDN_SL;
        if (rp < dk / GDN_SL) {
            float kv0 = 0.f, kv1 = 0.f;
#pragma unroll
            for (int ii = 0; ii < GDN_SL; ++ii) {
                const float2 e = gdn_st_ld2(Ssm + (ip0 + ii) * dv + jp);
                const float k = kn(ip0 + ii);
                kv0 = fmaf(__fmul_rn(e.x, alpha), k, kv0);
                kv1 = fmaf(__fmul_rn(e.y, alpha), k, kv1);
            }
            part[rp * dv + jp] = kv0;
            part[rp * dv + jp + 1] = kv1;
        }
        __syncthreads();
        if (rp < dk / GDN_SL) {
            float kv0 = 0.f, kv1 = 0.f;
            for (int rr = 0; rr < dk / GDN_SL; ++rr) {
                kv0 += part[rr * dv + jp];
                kv1 += part[rr * dv + jp + 1];
            }
            const float d0 = beta * (vs[jp] - kv0), d1 = beta * (vs[jp + 1] - kv1);
            float o0 = 0.f, o1 = 0.f;
            // k and q four rows at a time (one 16-byte load each: the compiler does not move
            // shared loads past the state's stores, which it cannot tell apart from them).
#pragma unroll
            for (int i4 = 0; i4 < GDN_SL; i4 += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(ks + ip0 + i4);
                const float4 q4 = *reinterpret_cast<const float4*>(qs + ip0 + i4);
                const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int ii = i4 + u;
                    const float2 e = gdn_st_ld2(Ssm + (ip0 + ii) * dv + jp);
                    const float k = kk[u], q = qq[u];
                    const float sn0 = fmaf(k, d0, __fmul_rn(e.x, alpha)), sn1 = fmaf(k, d1, __fmul_rn(e.y, alpha));
                    o0 = fmaf(sn0, q, o0);
                    o1 = fmaf(sn1, q, o1);
                    gdn_st_st2(S + (size_t)(ip0 + ii) * dv + jp, sn0, sn1);
                }
            }
            part_o[rp * dv + jp] = o0;
            part_o[rp * dv + jp + 1] = o1;
        }
    } else {
        float kv = 0.f;
        if (active) {
#pragma unroll
            for (int ii = 0; ii < GDN_SL; ++ii) {
                s[ii] = s[ii] * alpha;  // the decayed entry, S * alpha (one rounding, never fused)
                kv = fmaf(s[ii], kn(i0 + ii), kv);
            }
            part[r * dv + j] = kv;
        }
        __syncthreads();
        // o's partial sums go to a second buffer, so no barrier is needed before writing them.
        float* part_o = part + (dk / GDN_SL) * dv;
        if (active) {
            kv = 0.f;
            for (int rr = 0; rr < dk / GDN_SL; ++rr) kv += part[rr * dv + j];
            const float delta = beta * (vs[j] - kv);
            float o = 0.f;
#pragma unroll
            for (int ii = 0; ii < GDN_SL; ++ii) {
                const float sn = fmaf(kn(i0 + ii), delta, s[ii]);
                o = fmaf(sn, qn(i0 + ii), o);
                gdn_st_st(S + (size_t)(i0 + ii) * dv + j, sn);
            }
            part_o[r * dv + j] = o;
        }
    }
    __syncthreads();
    float* part_o = part + (dk / GDN_SL) * dv;
    // Gated RMSNorm over the head's dv outputs: threads r = 0 (the first dv threads, whole warps).
    float o = 0.f;
    if (r == 0) {
        for (int rr = 0; rr < dk / GDN_SL; ++rr) o += part_o[rr * dv + j];
        const float w = warp_sum(o * o);
        if (lane == 0) red[2 * kw + warp] = w;
    }
    __syncthreads();
    if (r == 0) {
        float ss = 0.f;
        for (int w = 0; w < (dv >> 5); ++w) ss += red[2 * kw + w];
        const float inv = inv_rms_from(ss, dv, eps);
        const float yj = o * inv * nwj * silu_f(zj);
        y[(size_t)n * dv + j] = yj;
        if (frag) vs[j] = yj;  // v is no longer read
    }
    if (frag) {
        // The head's outputs staged for the out-projection's batched GEMV as stage_tcb stages a
        // row without a gain (same pairs, bf16 words and group sums): one warp per 64-column
        // group of the head (dv % 64 == 0), group n * dv / 64 + G of the row. The rows past the
        // step's (which stage_tcb zeroes) are left as they are: the GEMVs copy only the step's rows.
        __syncthreads();
        const int gpr = (nv * dv) >> 6, q = lane, i = q >> 3, t = (q >> 1) & 3, reg = q & 1;
        for (int G = warp; G < (dv >> 6); G += nt >> 5) {
            const int c = 64 * G + 16 * t + 8 * (i >> 1) + 2 * (i & 1) + reg, Gr = n * (dv >> 6) + G;
            const u32 w = pack_bf16(vs[c], vs[c + 4]);
            const float gs = warp_sum(__uint_as_float(w << 16) + __uint_as_float(w & 0xffff0000u));
            if (lane == 0) gsum[(size_t)row * gpr + Gr] = gs;
            frag[tcb_word(row, gpr, Gr, i, t, reg)] = w;
        }
    }
}

// Every GDN kernel that reads or writes the recurrent state comes in two instances: the f32 state
// (the name alone) and the f16 one (`_f16`), the same operations on the widened entries.
#define GDN_STEP_ARGS(ST)                                                                                   \
    const float *__restrict__ qkv, const float *__restrict__ z, const float *__restrict__ braw,              \
        const float *__restrict__ araw, float *__restrict__ ring, const float *__restrict__ taps,            \
        const float *__restrict__ dt_bias, const float *__restrict__ neg_a, const float *__restrict__ norm_w, \
        ST *__restrict__ state, float *__restrict__ y, const int *__restrict__ step, int nk, int nv, int dk,  \
        int dv, int KC, float eps
#define GDN_STEP_CALL qkv, z, braw, araw, ring, taps, dt_bias, neg_a, norm_w, state, y, step, nk, nv, dk, dv, KC, eps
extern "C" __global__ void gdn_step(GDN_STEP_ARGS(float)) { gdn_step_impl<false, float>(GDN_STEP_CALL); }
extern "C" __global__ void gdn_step_f16(GDN_STEP_ARGS(u16)) { gdn_step_impl<false, u16>(GDN_STEP_CALL); }
// The 35B's GDN head shapes as the step bodies' (nk, nv, dk, dv, KC) arguments, and the block
// size at those shapes (dv * dk / 32 threads): the _35b instances' constants (gdn.rs
// SHAPED_STEP_DIMS on the host).
#define GDN_35B_DIMS 16, 32, 128, 128, 4
#define GDN_35B_THREADS 512
// gdn_step at the 35B's head shapes as compile-time constants (see gdn_step_batch_35b below):
// the index arithmetic ahead of the state loads folds. The host launches it only at those dims.
#define GDN_STEP_35B(NAME, ST)                                                                                 \
    extern "C" __global__ void NAME(GDN_STEP_ARGS(ST)) {                                                      \
        gdn_step_impl<false, ST>(qkv, z, braw, araw, ring, taps, dt_bias, neg_a, norm_w, state, y, step,      \
                                 GDN_35B_DIMS, eps, nullptr, nullptr, 0, GDN_35B_THREADS);                    \
    }
GDN_STEP_35B(gdn_step_35b, float)
GDN_STEP_35B(gdn_step_35b_f16, u16)

// The step of a batch of sequences (batched decode): blockIdx.y = row b, one token of sequence b,
// its projections at row b of the token-major activations, its conv ring and state from the
// per-row pointer tables, its [token, position] at steps[2b]. Each row is exactly gdn_step.
// The parameters both batched steps take (gdn_step_persist adds the row count).
#define GDN_STEP_BATCH_ARGS(ST)                                                                                \
    const float *__restrict__ qkv, const float *__restrict__ z, const float *__restrict__ braw,                 \
        const float *__restrict__ araw, float *const *__restrict__ rings, const float *__restrict__ taps,        \
        const float *__restrict__ dt_bias, const float *__restrict__ neg_a, const float *__restrict__ norm_w,   \
        ST *const *__restrict__ states, float *__restrict__ y, const int *__restrict__ steps, int nk, int nv,    \
        int dk, int dv, int KC, float eps, u32 *__restrict__ frag, float *__restrict__ gsum
#define GDN_STEP_BATCH_CALL \
    qkv, z, braw, araw, rings, taps, dt_bias, neg_a, norm_w, states, y, steps, nk, nv, dk, dv, KC, eps, frag, gsum
template <typename ST>
__device__ __forceinline__ void gdn_step_batch_impl(GDN_STEP_BATCH_ARGS(ST), int threads = 0) {
    const int b = blockIdx.y;
    const size_t conv_dim = 2 * (size_t)nk * dk + (size_t)nv * dv, vd = (size_t)nv * dv;
    gdn_step_impl<true, ST>(qkv + b * conv_dim, z + b * vd, braw + (size_t)b * nv, araw + (size_t)b * nv, rings[b],
                            taps, dt_bias, neg_a, norm_w, states[b], y + b * vd, steps + 2 * b, nk, nv, dk, dv, KC, eps,
                            frag, gsum, b, threads);
}
extern "C" __global__ void __launch_bounds__(512, 3) gdn_step_batch(GDN_STEP_BATCH_ARGS(float)) {
    gdn_step_batch_impl<float>(GDN_STEP_BATCH_CALL);
}
// Four blocks per SM (32 registers, a few bytes of spills): 38 KB of shared memory each with the
// f16 slice, and a 16-row step's 512 blocks of the 35B in one wave of 528 where three left 116.
extern "C" __global__ void __launch_bounds__(512, 4) gdn_step_batch_f16(GDN_STEP_BATCH_ARGS(u16)) {
    gdn_step_batch_impl<u16>(GDN_STEP_BATCH_CALL);
}
// gdn_step_batch at the 35B's head shapes (16 key and 32 value heads of 128 x 128, 4 conv taps,
// 512 threads) as compile-time constants, so its index arithmetic folds (a division or modulo by
// a kernel parameter is some 25 instructions, and every warp of an item ran several) and its
// loops have known trip counts. The same operations on the same values as gdn_step_batch; the
// host launches it only at those dims (the dims in its argument list are not read).
//
// Its block is 256 threads, not 512: the batched step's two passes take two adjacent columns per
// thread, (dv / 2) * (dk / 32) threads, and everything else of the step is written for any block
// size (the conv's channels, the copies and the norms in strides of the block), so in a block of
// 512 the other 256 threads ran only the prologue and the barriers. Half the block runs the
// same values (each channel, entry and sum as before), leaves the per-item prologue to half the
// warps, and fits five blocks per SM with the f16 slice (38.5 KB each) where four fitted: more
// items' state loads in flight.
#define GDN_35B_BATCH_THREADS 256
#define GDN_STEP_BATCH_35B(NAME, ST, MINB)                                                                      \
    extern "C" __global__ void __launch_bounds__(GDN_35B_BATCH_THREADS, MINB) NAME(GDN_STEP_BATCH_ARGS(ST)) { \
        gdn_step_batch_impl<ST>(qkv, z, braw, araw, rings, taps, dt_bias, neg_a, norm_w, states, y, steps,      \
                                GDN_35B_DIMS, eps, frag, gsum, GDN_35B_BATCH_THREADS);                         \
    }
GDN_STEP_BATCH_35B(gdn_step_batch_35b, float, 3)
GDN_STEP_BATCH_35B(gdn_step_batch_35b_f16, u16, 5)

// The batched step on one wave of persistent blocks: block i takes the (row, head) items i,
// i + gridDim.x, ... (item = row * nv + head) and copies what an item reads (its state slice,
// the conv history and inputs of its channels, z, its gate inputs) into a ring of stages in
// shared memory by cp.async, GDN_PS_STAGES - 1 items ahead, so the next items' 64 KB are loading
// while this one computes and this one's arithmetic waits on no global load. (A gdn_step_batch
// block's slice is the only load it has in flight, and each of its small loads queues behind
// the state traffic.) Each item is exactly gdn_step_batch's block for that (row, head): the
// same operations in the same order.
//
// Shared memory (GdnDims::step_persist_smem): GDN_PS_STAGES stages of [state dk*dv (f32 or f16) | history
// (KC-1)*nch | this step's inputs nch | z dv | b, a, dt_bias, neg_a], nch = 2dk + dv (the q, k
// and v channels of the head, in that order), the rows' ring and state pointers, then
// gdn_step_tail's scratch, then the rows' positions.
#define GDN_PS_STAGES 3
// A stage's size in f32 words.
template <typename ST>
__device__ __forceinline__ int gdn_ps_stage(int dk, int dv, int KC) {
    return gdn_st_words<ST>(dk * dv) + KC * (2 * dk + dv) + dv + 4;
}
__device__ __forceinline__ void cp_async4(unsigned s, const void* g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(g) : "memory");
}
template <typename ST>
__device__ __forceinline__ void gdn_step_persist_impl(GDN_STEP_BATCH_ARGS(ST), int rows, int threads = 0) {
    extern __shared__ __align__(16) float gps_sm[];
    const int tid = threadIdx.x, nt = threads ? threads : (int)blockDim.x, items = rows * nv;
    const int nch = 2 * dk + dv, key_dim = nk * dk, conv_dim = 2 * key_dim + nv * dv, group = nv / nk;
    const int stage = gdn_ps_stage<ST>(dk, dv, KC);
    float** sring = reinterpret_cast<float**>(gps_sm + GDN_PS_STAGES * stage);
    ST** sstate = reinterpret_cast<ST**>(sring + rows);
    float* scratch = reinterpret_cast<float*>(sstate + rows);
    int* spos = reinterpret_cast<int*>(scratch + 2 * dk + dv + 2 * (dk / GDN_SL) * dv + 33);
    // The rows' tables and positions (the positions written by the previous step's token choice,
    // as gdn_step_batch reads them before its wait) and this thread's norm weight.
    for (int i = tid; i < rows; i += nt) {
        spos[i] = steps[2 * i + 1];
        sring[i] = rings[i];
        sstate[i] = states[i];
    }
    const float nwj = norm_w[tid % dv];
    __syncthreads();
    // Channel c (0..nch) of head n: its index in a conv row.
    auto chan = [&](int n, int c) { return gdn_head_channel(n / group, n, c, dk, dv, key_dim); };
    auto stage_of = [&](int k) { return gps_sm + (k % GDN_PS_STAGES) * stage; };
    auto copy_state = [&](int k, int it) {
        constexpr int per16 = 16 / sizeof(ST);  // elements per 16-byte copy
        const ST* S = sstate[it / nv] + (size_t)(it % nv) * dk * dv;
        const u32 dst = smem_u32(stage_of(k));
        for (int p = tid; p < gdn_st_words<ST>(dk * dv) >> 2; p += nt) cp_async16(dst + 16 * p, S + per16 * p);
    };
    // Everything else of the item (after the wait: qkv, z, b and a are the previous kernel's).
    auto copy_inputs = [&](int k, int it) {
        const int b = it / nv, n = it % nv, pos = spos[b];
        float* in = stage_of(k) + gdn_st_words<ST>(dk * dv);
        const int q4 = nch >> 2;
        for (int p = tid; p < KC * q4; p += nt) {
            const int rr = p / q4, c4 = 4 * (p % q4), ch = chan(n, c4);
            const float* src;
            if (rr < KC - 1) {  // history: position pos - (KC - 1) + rr, nothing before position 0
                const int ps = pos - (KC - 1) + rr;
                if (ps < 0) continue;
                src = sring[b] + (size_t)(ps % KC) * conv_dim + ch;
            } else {
                src = qkv + (size_t)b * conv_dim + ch;
            }
            cp_async16(smem_u32(in + rr * nch + c4), src);
        }
        float* zs = in + KC * nch;
        for (int p = tid; p < dv >> 2; p += nt) cp_async16(smem_u32(zs + 4 * p), z + (size_t)b * nv * dv + (size_t)n * dv + 4 * p);
        if (tid < 4) {
            const float* src = tid == 0 ? braw + (size_t)b * nv + n : tid == 1 ? araw + (size_t)b * nv + n
                             : tid == 2 ? dt_bias + n : neg_a + n;
            cp_async4(smem_u32(zs + dv + tid), src);
        }
    };
    // Items 0 .. STAGES - 2 of the block, one commit group each (empty past the last item, so the
    // number of groups in flight stays what the wait below expects).
    const int first = blockIdx.x, grid = gridDim.x;
    for (int k = 0; k < GDN_PS_STAGES - 1; ++k)
        if (first + k * grid < items) copy_state(k, first + k * grid);
    pdl_wait_trigger();
    for (int k = 0; k < GDN_PS_STAGES - 1; ++k) {
        if (first + k * grid < items) copy_inputs(k, first + k * grid);
        cp_commit();
    }
    for (int k = 0;; ++k) {
        const int it = first + k * grid, ahead = it + (GDN_PS_STAGES - 1) * grid;
        if (it >= items) break;
        const int b = it / nv, n = it % nv, pos = spos[b], slot = pos % KC;
        // This thread's conv channel's taps (static), before the wait.
        float tp[8];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) tp[jj] = jj < KC && tid < nch ? taps[(size_t)jj * conv_dim + chan(n, tid)] : 0.f;
        // The stage of item k + STAGES - 1 held item k - 1, finished before the barrier at the
        // end of its turn.
        if (ahead < items) {
            copy_state(k + GDN_PS_STAGES - 1, ahead);
            copy_inputs(k + GDN_PS_STAGES - 1, ahead);
        }
        cp_commit();
        cp_wait<GDN_PS_STAGES - 1>();
        __syncthreads();
        const ST* Ssm = reinterpret_cast<const ST*>(stage_of(k));
        const float* in = stage_of(k) + gdn_st_words<ST>(dk * dv);
        const float* cur = in + (KC - 1) * nch;
        const float* zs = in + KC * nch;
        // The conv + SiLU of the head's channels: gdn_step_impl's sum, in the same order.
        for (int c = tid; c < nch; c += nt) {
            float acc = 0.f;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                if (jj >= KC) break;
                const int ps = pos - (KC - 1) + jj;
                const float x = jj == KC - 1 ? cur[c] : (ps < 0 ? 0.f : in[jj * nch + c]);
                const float t = c == tid ? tp[jj] : taps[(size_t)jj * conv_dim + chan(n, c)];
                acc += t * x;
            }
            scratch[c] = silu_f(acc);
            if (c >= 2 * dk || n % group == 0) sring[b][(size_t)slot * conv_dim + chan(n, c)] = cur[c];
        }
        __syncthreads();
        float unused[1];
        gdn_step_tail<true, ST>(Ssm, unused, scratch, sstate[b] + (size_t)n * dk * dv, zs[dv], zs[dv + 1], zs[tid % dv],
                            zs[dv + 2], zs[dv + 3], nwj, y + (size_t)b * nv * dv, n, nv, dk, dv, eps, frag, gsum, b, threads);
        __syncthreads();  // the stage and the scratch are free for the next items
    }
}
extern "C" __global__ void __launch_bounds__(512, 1) gdn_step_persist(GDN_STEP_BATCH_ARGS(float), int rows) {
    gdn_step_persist_impl<float>(GDN_STEP_BATCH_CALL, rows);
}
extern "C" __global__ void __launch_bounds__(512, 1) gdn_step_persist_f16(GDN_STEP_BATCH_ARGS(u16), int rows) {
    gdn_step_persist_impl<u16>(GDN_STEP_BATCH_CALL, rows);
}
// gdn_step_persist at the 35B's head shapes as compile-time constants (see gdn_step_batch_35b);
// the host launches it only at those dims.
#define GDN_STEP_PERSIST_35B(NAME, ST)                                                                            \
    extern "C" __global__ void __launch_bounds__(GDN_35B_THREADS, 1) NAME(GDN_STEP_BATCH_ARGS(ST), int rows) {   \
        gdn_step_persist_impl<ST>(qkv, z, braw, araw, rings, taps, dt_bias, neg_a, norm_w, states, y, steps,      \
                                  GDN_35B_DIMS, eps, frag, gsum, rows, GDN_35B_THREADS);                        \
    }
GDN_STEP_PERSIST_35B(gdn_step_persist_35b, float)
GDN_STEP_PERSIST_35B(gdn_step_persist_35b_f16, u16)

// ============================== prefill (T tokens) ==============================
// Activations are token-major f32 [T][dim] (docs/cuda-prefill.md, src/backend/cuda/prefill.rs).
// The scan is the exact recurrence (gdn::recurrent_step) run over the chunk with the state in
// registers.

// Causal depthwise conv + SiLU of 4 channels ch..ch + 3 of token t at position pos0 + t (history
// from the ring): sum over taps j of taps[j] * input(pos0 + t - (KC - 1) + j), in that order.
__device__ __forceinline__ float4 gdn_conv4(const float* __restrict__ qkv, const float* __restrict__ ring,
                                            const float* __restrict__ taps, int t, int ch, int C, int KC, int pos0) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < KC; ++j) {
        const int p = pos0 + t - (KC - 1) + j;
        float4 in = make_float4(0.f, 0.f, 0.f, 0.f);
        if (p >= pos0) in = *reinterpret_cast<const float4*>(qkv + (size_t)(p - pos0) * C + ch);
        else if (p >= 0) in = *reinterpret_cast<const float4*>(ring + (size_t)(p % KC) * C + ch);
        const float4 w = *reinterpret_cast<const float4*>(taps + (size_t)j * C + ch);
        acc.x += w.x * in.x;
        acc.y += w.y * in.y;
        acc.z += w.z * in.z;
        acc.w += w.w * in.w;
    }
    return make_float4(silu_f(acc.x), silu_f(acc.y), silu_f(acc.z), silu_f(acc.w));
}

// The conv kernels take up to GDN_CONV_SEGS sequences in one launch: segment z is rows
// r0[z] .. r0[z + 1] of the chunk (the last one up to the launch's end), back to back, at
// positions pos0[z].., with its own conv ring. A chunk of many short prompts (a burst of
// requests) is then three launches per layer instead of three per prompt. Passed by value
// (gdn.rs conv_segs_arg has this layout).
#define GDN_CONV_SEGS 16
struct ConvSegs {
    float* ring[GDN_CONV_SEGS];
    int r0[GDN_CONV_SEGS];
    int pos0[GDN_CONV_SEGS];
};
// The segment holding chunk row t.
__device__ __forceinline__ int conv_seg(const ConvSegs& s, int nseg, int t) {
    int z = 0;
    while (z + 1 < nseg && t >= s.r0[z + 1]) ++z;
    return z;
}

// The conv of the value channels [c0, C) of the T rows from segs.r0[0] into out (rows of the
// chunk, same layout as qkv; the q and k channels go through pf_gdn_conv_qk): each thread 4
// channels of one row. grid (ceil((C - c0) / 1024), T), block 256. The outputs f32, or bf16
// (`_bf16`) where every segment of the launch takes the chunked scan, whose prep rounds its
// operands to bf16 anyway: half the bytes written and read back.
template <typename OT>
__device__ __forceinline__ void gdn_conv_v(const float* __restrict__ qkv, const ConvSegs& segs, int nseg,
                                           const float* __restrict__ taps, int C, int KC, int c0, OT* __restrict__ out) {
    const int t = segs.r0[0] + blockIdx.y, ch = c0 + 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (ch >= C) return;
    const int z = conv_seg(segs, nseg, t), r0 = segs.r0[z];
    act_st4(out + (size_t)t * C + ch, gdn_conv4(qkv + (size_t)r0 * C, segs.ring[z], taps, t - r0, ch, C, KC, segs.pos0[z]));
}
extern "C" __global__ void pf_gdn_conv(const float* __restrict__ qkv, const ConvSegs segs, int nseg,
                                       const float* __restrict__ taps, int T, int C, int KC, int c0,
                                       float* __restrict__ out) {
    gdn_conv_v(qkv, segs, nseg, taps, C, KC, c0, out);
}
extern "C" __global__ void pf_gdn_conv_bf16(const float* __restrict__ qkv, const ConvSegs segs, int nseg,
                                            const float* __restrict__ taps, int T, int C, int KC, int c0,
                                            u16* __restrict__ out) {
    gdn_conv_v(qkv, segs, nseg, taps, C, KC, c0, out);
}

// After the conv: each segment's ring slots of its last min(n, KC) positions get their pre-conv
// inputs. grid (ceil(C/256), KC, nseg); T rows in all from segs.r0[0].
extern "C" __global__ void pf_gdn_ring(const float* __restrict__ qkv, const ConvSegs segs, int nseg, int T, int C,
                                       int KC) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x, z = blockIdx.z;
    const int r0 = segs.r0[z], n = (z + 1 < nseg ? segs.r0[z + 1] : segs.r0[0] + T) - r0;
    if (ch >= C || (int)blockIdx.y >= min(n, KC)) return;
    const int t = n - 1 - blockIdx.y, p = segs.pos0[z] + t;
    segs.ring[z][(size_t)(p % KC) * C + ch] = qkv[(size_t)(r0 + t) * C + ch];
}

// The conv of the q and k channels of one (row, key head) per warp, then their L2 norms (eps
// 1e-6, the sum of squares in f64 like ops::l2_normalize), q scaled by dk^-1/2, into qn and kn
// [rows][nk * dk] of the chunk (f32, or bf16 as pf_gdn_conv_bf16's): lane l holds channels
// 4l..4l + 3 of the head (dk <= 128). T rows from segs.r0[0]; grid (ceil(T * nk / 8)), block 256.
template <typename OT>
__device__ __forceinline__ void gdn_conv_qk(const float* __restrict__ qkv, const ConvSegs& segs, int nseg,
                                            const float* __restrict__ taps, int T, int C, int KC, int nk, int dk,
                                            OT* __restrict__ qn, OT* __restrict__ kn) {
    const int lane = threadIdx.x & 31, pair = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (pair >= T * nk) return;
    const int t = segs.r0[0] + pair / nk, kh = pair % nk, key_dim = nk * dk, c = 4 * lane;
    const int z = conv_seg(segs, nseg, t), r0 = segs.r0[z], pos0 = segs.pos0[z];
    const float* ring = segs.ring[z];
    const bool on = c < dk;
    float4 q = make_float4(0.f, 0.f, 0.f, 0.f), k = q;
    if (on) {
        const float* xs = qkv + (size_t)r0 * C;
        q = gdn_conv4(xs, ring, taps, t - r0, kh * dk + c, C, KC, pos0);
        k = gdn_conv4(xs, ring, taps, t - r0, key_dim + kh * dk + c, C, KC, pos0);
    }
    auto sq = [](float4 v) { return (double)v.x * v.x + (double)v.y * v.y + (double)v.z * v.z + (double)v.w * v.w; };
    double sqq = sq(q), sqk = sq(k);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sqq += __shfl_xor_sync(0xffffffffu, sqq, o);
        sqk += __shfl_xor_sync(0xffffffffu, sqk, o);
    }
    if (!on) return;
    const float iq = (float)(1.0 / sqrt(sqq + 1e-6)) * (1.f / sqrtf((float)dk)), ik = (float)(1.0 / sqrt(sqk + 1e-6));
    const size_t off = (size_t)t * key_dim + kh * dk + c;
    act_st4(qn + off, make_float4(q.x * iq, q.y * iq, q.z * iq, q.w * iq));
    act_st4(kn + off, make_float4(k.x * ik, k.y * ik, k.z * ik, k.w * ik));
}
extern "C" __global__ void pf_gdn_conv_qk(const float* __restrict__ qkv, const ConvSegs segs, int nseg,
                                          const float* __restrict__ taps, int T, int C, int KC, int nk,
                                          int dk, float* __restrict__ qn, float* __restrict__ kn) {
    gdn_conv_qk(qkv, segs, nseg, taps, T, C, KC, nk, dk, qn, kn);
}
extern "C" __global__ void pf_gdn_conv_qk_bf16(const float* __restrict__ qkv, const ConvSegs segs, int nseg,
                                               const float* __restrict__ taps, int T, int C, int KC, int nk,
                                               int dk, u16* __restrict__ qn, u16* __restrict__ kn) {
    gdn_conv_qk(qkv, segs, nseg, taps, T, C, KC, nk, dk, qn, kn);
}

// The delta-rule recurrence over T tokens (gdn::recurrent_step: S = aS; d = b(v - S^T k);
// S += k d^T; o = S^T q). Every state column evolves on its own, so a column is split over PARTS
// lanes, each holding R = DK/PARTS rows of it in registers (read once, written once; no spills),
// and the dot products are reduced with PARTS-wide shuffles. One pass over the state per token:
// S_t = a_t S_{t-1} + k_t d_t, then o_t = S_t^T q_t and p = S_t^T k_{t+1} (the next token's
// S^T k is a_{t+1} p) in the same loop, both reduced together. Block = 4 warps = 4*32/PARTS
// columns of one value head; q/k of PF_GDN_TB tokens are copied into shared memory with
// cp.async a block of tokens ahead (double buffer), v and the raw gates through registers, so no
// global load sits on the per-token chain. q/k rows are stored padded per part (stride R+4
// floats) so the PARTS distinct float4 reads of a step hit distinct banks.
// grid (nv, ceil(dv / (128/PARTS))), block 128.
#define PF_GDN_TB 16

template <int DK, typename ST>
__device__ void gdn_scan(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ conv,
                         const float* __restrict__ braw, const float* __restrict__ araw,
                         const float* __restrict__ dt_bias, const float* __restrict__ neg_a, ST* __restrict__ state,
                         float* __restrict__ o, int T, int nk, int nv, int dv, int C) {
    constexpr int PARTS = DK >= 128 ? 8 : (DK >= 64 ? 4 : 2);
    constexpr int R = DK / PARTS, RS = R + 4, KS = PARTS * RS, CPW = 32 / PARTS, BC = 4 * CPW;
    constexpr int TB = PF_GDN_TB, NV = TB * BC / 128;
    __shared__ __align__(16) float qs[2][TB][KS];
    __shared__ __align__(16) float ks[2][TB][KS];
    __shared__ float vs[2][TB][BC];
    __shared__ float gb[2][TB], ga[2][TB];
    const int n = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int part = lane % PARTS, cl = warp * CPW + lane / PARTS;
    const int c0 = blockIdx.y * BC, c = c0 + cl;
    const bool cvalid = c < dv;
    const int kh = n / (nv / nk), key_dim = nk * DK;
    ST* S = state + (size_t)n * DK * dv;
    float sreg[R];
#pragma unroll
    for (int i = 0; i < R; ++i) sreg[i] = cvalid ? gdn_st_ld(S + (size_t)(part * R + i) * dv + c) : 0.f;
    const float nega = neg_a[n], dtb = dt_bias[n];
    const float* vsrc = conv + 2 * key_dim + (size_t)n * dv + c0;
    float pv[NV];
    float pb = 0.f, pa = 0.f;
    // Starts the copies of block tb into buffer bf (q/k by cp.async, v and raw gates to registers).
    auto issue = [&](int tb, int bf) {
        const int nt = min(TB, T - tb);
        for (int idx = tid; idx < nt * (DK / 4); idx += 128) {
            const int tt = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
            const int d = (i / R) * RS + (i % R);
            const size_t off = (size_t)(tb + tt) * key_dim + kh * DK + i;
            cp_async16(&qs[bf][tt][d], qn + off);
            cp_async16(&ks[bf][tt][d], kn + off);
        }
        cp_commit();
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int idx = tid + 128 * j, tt = idx / BC, cc = idx % BC;
            pv[j] = (tt < nt && c0 + cc < dv) ? vsrc[(size_t)(tb + tt) * C + cc] : 0.f;
        }
        if (tid < nt) {
            pb = braw[(size_t)(tb + tid) * nv + n];
            pa = araw[(size_t)(tb + tid) * nv + n];
        }
    };
    // Completes block tb in buffer bf: waits for its copies, stores v and the gates. Ends synced.
    auto stage = [&](int tb, int bf) {
        const int nt = min(TB, T - tb);
        cp_wait<0>();
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int idx = tid + 128 * j;
            vs[bf][idx / BC][idx % BC] = pv[j];
        }
        if (tid < nt) {
            gb[bf][tid] = sigmoid_f(pb);
            ga[bf][tid] = expf(nega * softplus_f(pa + dtb));
        }
        __syncthreads();
    };
    issue(0, 0);
    stage(0, 0);
    if (TB < T) issue(TB, 1);
    // p = S_0^T k_0.
    float p;
    {
        const float4* k4 = reinterpret_cast<const float4*>(&ks[0][0][part * RS]);
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int f = 0; f < R / 4; ++f) {
            const float4 kk = k4[f];
            a0 = fmaf(sreg[4 * f], kk.x, a0);
            a1 = fmaf(sreg[4 * f + 1], kk.y, a1);
            a2 = fmaf(sreg[4 * f + 2], kk.z, a2);
            a3 = fmaf(sreg[4 * f + 3], kk.w, a3);
        }
        p = (a0 + a1) + (a2 + a3);
#pragma unroll
        for (int m = 1; m < PARTS; m <<= 1) p += __shfl_xor_sync(0xffffffffu, p, m);
    }
    int bf = 0;
    for (int tb = 0; tb < T; tb += TB) {
        const int nt = min(TB, T - tb);
        const bool more = tb + TB < T;
        for (int tt = 0; tt < nt; ++tt) {
            const bool last = tt == nt - 1;
            if (last && more) stage(tb + TB, bf ^ 1);  // the next token's k lives there
            const float alpha = ga[bf][tt], beta = gb[bf][tt], v = vs[bf][tt][cl];
            const float delta = beta * (v - alpha * p);
            const float4* k4 = reinterpret_cast<const float4*>(&ks[bf][tt][part * RS]);
            const float4* q4 = reinterpret_cast<const float4*>(&qs[bf][tt][part * RS]);
            const float4* n4 = reinterpret_cast<const float4*>(last ? &ks[bf ^ 1][0][part * RS]
                                                                    : &ks[bf][tt + 1][part * RS]);
            float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f, p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
            for (int f = 0; f < R / 4; ++f) {
                const float4 kk = k4[f], qq = q4[f], nn = n4[f];
                sreg[4 * f] = fmaf(sreg[4 * f], alpha, kk.x * delta);
                sreg[4 * f + 1] = fmaf(sreg[4 * f + 1], alpha, kk.y * delta);
                sreg[4 * f + 2] = fmaf(sreg[4 * f + 2], alpha, kk.z * delta);
                sreg[4 * f + 3] = fmaf(sreg[4 * f + 3], alpha, kk.w * delta);
                o0 = fmaf(sreg[4 * f], qq.x, o0);
                o1 = fmaf(sreg[4 * f + 1], qq.y, o1);
                o2 = fmaf(sreg[4 * f + 2], qq.z, o2);
                o3 = fmaf(sreg[4 * f + 3], qq.w, o3);
                p0 = fmaf(sreg[4 * f], nn.x, p0);
                p1 = fmaf(sreg[4 * f + 1], nn.y, p1);
                p2 = fmaf(sreg[4 * f + 2], nn.z, p2);
                p3 = fmaf(sreg[4 * f + 3], nn.w, p3);
            }
            float ov = (o0 + o1) + (o2 + o3);
            p = (p0 + p1) + (p2 + p3);
#pragma unroll
            for (int m = 1; m < PARTS; m <<= 1) {
                ov += __shfl_xor_sync(0xffffffffu, ov, m);
                p += __shfl_xor_sync(0xffffffffu, p, m);
            }
            if (part == 0 && cvalid) o[(size_t)(tb + tt) * nv * dv + (size_t)n * dv + c] = ov;
        }
        __syncthreads();  // buffer bf is free again
        if (tb + 2 * TB < T) issue(tb + 2 * TB, bf);
        bf ^= 1;
    }
    if (cvalid) {
#pragma unroll
        for (int i = 0; i < R; ++i) gdn_st_st(S + (size_t)(part * R + i) * dv + c, sreg[i]);
    }
}

// Up to GDN_SCAN_SEGS sequences' scans in one launch (blockIdx.z = segment): segment z is rows
// r0[z] .. r0[z] + n[z] of the chunk's inputs and outputs, with its own state (f32 or f16 as the
// kernel's instance reads it; the table holds untyped addresses). The recurrence is
// a chain of dependent steps per token, so segments side by side run in the time of the longest
// instead of the sum. Passed by value (gdn.rs ScanSegments has this layout).
#define GDN_SCAN_SEGS 16
struct ScanSegs {
    float* state[GDN_SCAN_SEGS];
    int r0[GDN_SCAN_SEGS];
    int n[GDN_SCAN_SEGS];
};
#define PF_GDN_SCAN(DK, NAME, ST)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                        \
        const float* qn, const float* kn, const float* conv, const float* braw, const float* araw,                 \
        const float* dt_bias, const float* neg_a, const ScanSegs segs, float* o, int nk, int nv, int dv, int C) {   \
        const size_t r0 = segs.r0[blockIdx.z];                                                                     \
        const size_t kd = (size_t)nk * DK;                                                                         \
        gdn_scan<DK, ST>(qn + r0 * kd, kn + r0 * kd, conv + r0 * C, braw + r0 * nv, araw + r0 * nv, dt_bias,       \
                         neg_a, reinterpret_cast<ST*>(segs.state[blockIdx.z]), o + r0 * nv * dv, segs.n[blockIdx.z], \
                         nk, nv, dv, C);                                                                           \
    }
PF_GDN_SCAN(32, pf_gdn_scan_32, float)
PF_GDN_SCAN(64, pf_gdn_scan_64, float)
PF_GDN_SCAN(128, pf_gdn_scan_128, float)
PF_GDN_SCAN(32, pf_gdn_scan_32_f16, u16)
PF_GDN_SCAN(64, pf_gdn_scan_64_f16, u16)
PF_GDN_SCAN(128, pf_gdn_scan_128_f16, u16)

// ---- the chunked scan (default mode): 64-token chunks in the WY form on the tensor cores ----
// Within a chunk whose state starts at S0, with g_t = log a_t and G_t = sum_{s<=t} g_s, unrolling
// the recurrence above (S = aS; d = b(v - S^T k); S += k d^T; o = S^T q) gives
//   (I + A) D = diag(b) V - diag(b e^G) K S0,   A[t][s] = b_t e^(G_t - G_s) k_t.k_s (s < t)
//   O = diag(e^G) Q S0 + M D,                    M[t][s] = e^(G_t - G_s) q_t.k_s  (s <= t)
//   S = e^(G_last) S0 + K^T diag(e^(G_last - G)) D
// so with T = (I + A)^-1, U = T diag(b) V and W = T diag(b e^G) K: D = U - W S0. Everything but
// the products with S0 is local to the chunk: pf_gdn_chunk_prep computes it for every (chunk,
// value head) at once, pf_gdn_chunk_walk then carries the state through the chunks in order per
// (value head, GCV state columns), four mma products per chunk. Operands are bf16 with f32
// accumulation (T by forward substitution in f32; the state and the outputs stay f32): within
// 1.5x of the error the bf16 rounding of q, k and v alone gives (scripts/gdn_chunk_accuracy.py).
// The walk applies the decays of Q and K to the products' rows (the rows of Q S, and of D before
// the state update), so q and k go to the scratch as they are, once per key head, and every
// (chunk, value head) adds only U, W, M (bf16) and G: the scratch is written once and read once
// from DRAM at long chunks (~56 KB per chunk and value head at the 35B's heads), and its bytes
// are much of the scan's time there.
// Padding past a segment's last token has b = 0, k = q = 0 and no decay, so it changes nothing.
// Scratch per chunk index ch = (chunk of the launch) * nv + h (q and k: * nk + key head), the
// chunks of a launch's segments one after the other (gdn.rs ChunkedScratch).
#define GC 64      // tokens per chunk
#define GCV 32     // state columns per walk block
#define GC_LDM 72  // row stride (bf16) of the 64 x 64 tiles (T, M)
#define GC_LDC 40  // row stride (bf16) of the 32-column tiles (S, D)
#define GCW_STAGES 3  // chunks of the walk's tiles in shared memory

__device__ __forceinline__ u16 bf16_rn(float x) { return (u16)(pack_bf16(x, 0.f) & 0xffffu); }
__device__ __forceinline__ float4 scale4(float s, float4 v) { return make_float4(s * v.x, s * v.y, s * v.z, s * v.w); }
// Eight bf16 values each times s, rounded back to bf16 (scale4 and act_st4 on their floats).
__device__ __forceinline__ uint4 scale_bf16x8(float s, uint4 v) {
    const auto sc = [s](u32 w) {
        return pack_bf16(s * __uint_as_float(w << 16), s * __uint_as_float(w & 0xffff0000u));
    };
    return make_uint4(sc(v.x), sc(v.y), sc(v.z), sc(v.w));
}

// acc (this warp's 16 rows x 32 columns) += A B over the k-steps below ks_end (KMAX at most): A
// row-major in shared memory at this lane's ldmatrix address aA of the rows (32 bytes per k-step),
// B stored [k][n] with row stride ldb elements at this lane's transposed-ldmatrix address bB.
template <int KMAX>
__device__ __forceinline__ void mma_rows16_cols32(float (&acc)[4][4], u32 aA, u32 bB, int ldb, int ks_end) {
#pragma unroll
    for (int ks = 0; ks < KMAX; ++ks) {
        if (ks >= ks_end) continue;
        u32 a[4];
        ldsm_x4(aA + ks * 32, a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int cp = 0; cp < 2; ++cp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(bB + (ks * 16 * ldb + cp * 16) * 2, b0, b1, b2, b3);
            mma_bf16(acc[2 * cp], a, b0, b1);
            mma_bf16(acc[2 * cp + 1], a, b2, b3);
        }
    }
}

// First chunk index of segment z: the chunks of the segments before it.
__device__ __forceinline__ int seg_chunk_base(const ScanSegs& s, int z) {
    int b = 0;
    for (int i = 0; i < z; ++i) b += (s.n[i] + GC - 1) / GC;
    return b;
}

// One (chunk, value head): grid (chunks of the longest segment, nv, segments), block 128.
// Dynamic shared memory (gdn.rs chunked_smem): a region that holds q and k (bf16) for the k.k and
// q.k products, then A (f32) and T (bf16); b e^G k and b v (bf16); b and G (f32).
// q, k and v (IT) are f32, or bf16 where the conv wrote them so (pf_gdn_conv_qk_bf16,
// pf_gdn_conv_bf16): the products take them rounded to bf16 either way.
template <int DK, typename IT>
__device__ void gdn_chunk_prep(const IT* __restrict__ qn, const IT* __restrict__ kn,
                               const IT* __restrict__ conv, const float* __restrict__ braw,
                               const float* __restrict__ araw, const float* __restrict__ dt_bias,
                               const float* __restrict__ neg_a, int T, int cg0, int nk, int nv, int dv, int C,
                               u16* __restrict__ u_out, u16* __restrict__ w_out, u16* __restrict__ q_out,
                               u16* __restrict__ k_out, u16* __restrict__ m_out, float* __restrict__ g_out) {
    constexpr int LDK = DK + 8, LDA = 68;
    constexpr int REGION = (2 * GC * LDK * 2 > GC * LDA * 4 + GC * GC_LDM * 2) ? 2 * GC * LDK * 2 : GC * LDA * 4 + GC * GC_LDM * 2;
    extern __shared__ __align__(16) unsigned char gcp_sm[];
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t0 = c * GC;
    if (t0 >= T) return;
    const int nt = min(GC, T - t0), ldv = dv + 8;
    u16* Qb = reinterpret_cast<u16*>(gcp_sm);              // q                 [GC][LDK]
    u16* Kb = Qb + GC * LDK;                                // k                 [GC][LDK]
    float* Af = reinterpret_cast<float*>(gcp_sm);           // A (f32), after q.k and k.k   [GC][LDA]
    u16* Tb = reinterpret_cast<u16*>(Af + GC * LDA);        // T                 [GC][GC_LDM]
    u16* Xk = reinterpret_cast<u16*>(gcp_sm + REGION);      // b e^G k           [GC][LDK]
    u16* Xv = Xk + GC * LDK;                                // b v               [GC][ldv]
    float* bs = reinterpret_cast<float*>(Xv + GC * ldv);
    float* Gs = bs + GC;
    const int kh = h / (nv / nk), key_dim = nk * DK;
    constexpr bool BF16_IN = sizeof(IT) == 2;
    if constexpr (BF16_IN) {
        // q, k and v are bf16 already, as the products take them: all of the chunk's rows copied
        // in at once (zeros past the segment), in flight under the gates' loads and prefix sums.
        for (int idx = tid; idx < GC * (DK / 8); idx += 128) {
            const int t = idx / (DK / 8), i = (idx % (DK / 8)) * 8;
            const size_t off = (size_t)(t0 + min(t, nt - 1)) * key_dim + kh * DK + i;
            cp_async16z(smem_u32(Qb + t * LDK + i), qn + off, t < nt);
            cp_async16z(smem_u32(Kb + t * LDK + i), kn + off, t < nt);
        }
        for (int idx = tid; idx < GC * (dv / 8); idx += 128) {
            const int t = idx / (dv / 8), j = (idx % (dv / 8)) * 8;
            const size_t off = (size_t)(t0 + min(t, nt - 1)) * C + 2 * key_dim + (size_t)h * dv + j;
            cp_async16z(smem_u32(Xv + t * ldv + j), conv + off, t < nt);
        }
        cp_commit();
    }
    if (tid < GC) {
        float b = 0.f, g = 0.f;
        if (tid < nt) {
            b = sigmoid_f(braw[(size_t)(t0 + tid) * nv + h]);
            g = neg_a[h] * softplus_f(araw[(size_t)(t0 + tid) * nv + h] + dt_bias[h]);
        }
        bs[tid] = b;
        Gs[tid] = g;
    }
    __syncthreads();
    if (warp == 0) {  // G: inclusive prefix sums of the log decays
        float lo = Gs[lane], hi = Gs[32 + lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float a = __shfl_up_sync(0xffffffffu, lo, o), b = __shfl_up_sync(0xffffffffu, hi, o);
            if (lane >= o) {
                lo += a;
                hi += b;
            }
        }
        hi += __shfl_sync(0xffffffffu, lo, 31);
        Gs[lane] = lo;
        Gs[32 + lane] = hi;
    }
    __syncthreads();
    const size_t ch = (size_t)(cg0 + c) * nv + h, chk = (size_t)(cg0 + c) * nk + kh;
    if (tid < GC) g_out[ch * GC + tid] = Gs[tid];
    // q and k as they are, once per key head: its first value head writes them.
    const bool writes_qk = h % (nv / nk) == 0;
    if constexpr (BF16_IN) {
        cp_wait<0>();
        __syncthreads();
        // b e^G k beside k, and b v in place of v, each rounded once from the bf16 values (the
        // f32 path's roundings of the same products).
        for (int idx = tid; idx < GC * (DK / 8); idx += 128) {
            const int t = idx / (DK / 8), i = (idx % (DK / 8)) * 8;
            const uint4 kq = *reinterpret_cast<const uint4*>(Kb + t * LDK + i);
            const float s = bs[t] * expf(Gs[t]);
            *reinterpret_cast<uint4*>(Xk + t * LDK + i) = scale_bf16x8(s, kq);
            if (writes_qk) {
                *reinterpret_cast<uint4*>(q_out + (chk * GC + t) * DK + i) = *reinterpret_cast<const uint4*>(Qb + t * LDK + i);
                *reinterpret_cast<uint4*>(k_out + (chk * GC + t) * DK + i) = kq;
            }
        }
        for (int idx = tid; idx < GC * (dv / 8); idx += 128) {
            const int t = idx / (dv / 8), j = (idx % (dv / 8)) * 8;
            uint4* xv = reinterpret_cast<uint4*>(Xv + t * ldv + j);
            *xv = scale_bf16x8(bs[t], *xv);
        }
    } else {
        const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
        // Unrolled so that each thread's loads are in flight together.
#pragma unroll 4
        for (int idx = tid; idx < GC * (DK / 4); idx += 128) {
            const int t = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
            float4 q4 = zero4, k4 = zero4;
            if (t < nt) {
                const size_t off = (size_t)(t0 + t) * key_dim + kh * DK + i;
                q4 = act_ld4(qn + off);
                k4 = act_ld4(kn + off);
            }
            const float eg = expf(Gs[t]);
            act_st4(Kb + t * LDK + i, k4);
            act_st4(Qb + t * LDK + i, q4);
            act_st4(Xk + t * LDK + i, scale4(bs[t] * eg, k4));
            if (writes_qk) {
                act_st4(q_out + (chk * GC + t) * DK + i, q4);
                act_st4(k_out + (chk * GC + t) * DK + i, k4);
            }
        }
#pragma unroll 4
        for (int idx = tid; idx < GC * (dv / 4); idx += 128) {
            const int t = idx / (dv / 4), j = (idx % (dv / 4)) * 4;
            float4 v4 = zero4;
            if (t < nt) v4 = act_ld4(conv + (size_t)(t0 + t) * C + 2 * key_dim + (size_t)h * dv + j);
            act_st4(Xv + t * ldv + j, scale4(bs[t], v4));
        }
    }
    __syncthreads();
    const int g = lane >> 2, q = lane & 3;
    {  // k.k and q.k for this warp's 16 rows and the columns up to them
        float kk[8][4], qk[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) kk[i][e] = qk[i][e] = 0.f;
        const u32 kA = smem_u32(Kb) + ((warp * 16 + (lane & 15)) * LDK + ((lane >> 4) << 3)) * 2;
        const u32 qA = smem_u32(Qb) + ((warp * 16 + (lane & 15)) * LDK + ((lane >> 4) << 3)) * 2;
        const u32 kB = smem_u32(Kb) + (((lane & 7) + ((lane >> 4) << 3)) * LDK + (((lane >> 3) & 1) << 3)) * 2;
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            u32 ak[4], aq[4];
            ldsm_x4(kA + ks * 32, ak[0], ak[1], ak[2], ak[3]);
            ldsm_x4(qA + ks * 32, aq[0], aq[1], aq[2], aq[3]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                if (np <= warp) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kB + (np * 16 * LDK + ks * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(kk[2 * np], ak, b0, b1);
                    mma_bf16(kk[2 * np + 1], ak, b2, b3);
                    mma_bf16(qk[2 * np], aq, b0, b1);
                    mma_bf16(qk[2 * np + 1], aq, b2, b3);
                }
            }
        }
        __syncthreads();  // q and k are read: A takes their place
        // A (strictly lower) into shared memory, M (lower) to the scratch; zeros above the diagonal.
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
            if (n8 > 2 * warp + 1) continue;
#pragma unroll
            for (int hv = 0; hv < 2; ++hv) {
                const int t = warp * 16 + g + 8 * hv, s = n8 * 8 + 2 * q;
                float av[2], mv[2];
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const float ex = s + x <= t ? expf(Gs[t] - Gs[s + x]) : 0.f;
                    av[x] = s + x < t ? bs[t] * ex * kk[n8][2 * hv + x] : 0.f;
                    mv[x] = ex * qk[n8][2 * hv + x];
                }
                *reinterpret_cast<float2*>(Af + t * LDA + s) = make_float2(av[0], av[1]);
                *reinterpret_cast<u32*>(m_out + (ch * GC + t) * GC + s) = pack_bf16(mv[0], mv[1]);
            }
        }
    }
    __syncthreads();
    if (tid < GC) {  // column tid of T = (I + A)^-1 by forward substitution (unit lower triangular)
        // Four partial sums per row: a quarter of the dependent chain.
        float x[GC];
#pragma unroll
        for (int i = 0; i < GC; ++i) {
            float acc[4] = {i == tid ? 1.f : 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < i; j += 4) {
                const float4 a = *reinterpret_cast<const float4*>(Af + i * LDA + j);
                acc[0] = fmaf(-a.x, x[j], acc[0]);
                if (j + 1 < i) acc[1] = fmaf(-a.y, x[j + 1], acc[1]);
                if (j + 2 < i) acc[2] = fmaf(-a.z, x[j + 2], acc[2]);
                if (j + 3 < i) acc[3] = fmaf(-a.w, x[j + 3], acc[3]);
            }
            x[i] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
#pragma unroll
        for (int i = 0; i < GC; ++i) Tb[i * GC_LDM + tid] = bf16_rn(x[i]);
    }
    __syncthreads();
    // U = T (b V) and W = T (b e^G K): this warp's 16 rows; T is lower triangular, so only the
    // k-steps up to them.
    u32 ta[4][4];
    const u32 tA = smem_u32(Tb) + ((warp * 16 + (lane & 15)) * GC_LDM + ((lane >> 4) << 3)) * 2;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
        if (ks <= warp) ldsm_x4(tA + ks * 32, ta[ks][0], ta[ks][1], ta[ks][2], ta[ks][3]);
    const int row = warp * 16 + g;
    const int xoff = ((lane & 7) + (((lane >> 3) & 1) << 3));
    const u32 vB = smem_u32(Xv) + (xoff * ldv + ((lane >> 4) << 3)) * 2;
    const u32 kB = smem_u32(Xk) + (xoff * LDK + ((lane >> 4) << 3)) * 2;
    for (int cb = 0; cb < dv + DK; cb += 32) {
        const bool is_u = cb < dv;
        const int col0 = is_u ? cb : cb - dv, ld = is_u ? ldv : LDK;
        const u32 xB = is_u ? vB : kB;
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if (ks > warp) continue;
#pragma unroll
            for (int cp = 0; cp < 2; ++cp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(xB + (ks * 16 * ld + col0 + cp * 16) * 2, b0, b1, b2, b3);
                mma_bf16(acc[2 * cp], ta[ks], b0, b1);
                mma_bf16(acc[2 * cp + 1], ta[ks], b2, b3);
            }
        }
#pragma unroll
        for (int n8 = 0; n8 < 4; ++n8) {
            const int col = col0 + n8 * 8 + 2 * q;
            const size_t r0 = ch * GC + row, r1 = r0 + 8;
            u16* out = is_u ? u_out : w_out;
            const int ldo = is_u ? dv : DK;
            *reinterpret_cast<u32*>(out + r0 * ldo + col) = pack_bf16(acc[n8][0], acc[n8][1]);
            *reinterpret_cast<u32*>(out + r1 * ldo + col) = pack_bf16(acc[n8][2], acc[n8][3]);
        }
    }
}

// One (value head, GCV state columns) through all chunks of a segment: grid (nv, dv / GCV,
// segments), block 256. Warps 0-3 own the state columns in f32 mma accumulators (warp w: key
// rows w DK/4 ..) and per chunk make D = U - W S (and D with its rows decayed to the chunk's end,
// the state update's operand) and then the new state; warps 4-7 make Q S, decay its rows (e^G Q S)
// and then add M D for the outputs beside them. The state, rounded to bf16, is the products'
// operand in shared memory; each chunk's tiles are copied in with cp.async two chunks ahead, by
// the output warps only (GCW_STAGES stages).
// Dynamic shared memory: NB (3 GC (DK + 8) + GC GC_LDM) + (DK + (2 + NB) GC) GC_LDC bf16, NB GC f32
// (NB = GCW_STAGES).
template <int DK, typename ST>
__device__ void gdn_chunk_walk(const u16* __restrict__ u_in, const u16* __restrict__ w_in,
                               const u16* __restrict__ q_in, const u16* __restrict__ k_in,
                               const u16* __restrict__ m_in, const float* __restrict__ g_in,
                               ST* __restrict__ state, float* __restrict__ o, int T, int cg0, int nk, int nv,
                               int dv) {
    constexpr int LDK = DK + 8, MT = DK / 64, RW = DK / 4;
    extern __shared__ __align__(16) unsigned char gcw_sm[];
    constexpr int NB = GCW_STAGES;
    u16* Wb = reinterpret_cast<u16*>(gcw_sm);  // W          [NB][GC][LDK]
    u16* Qb = Wb + NB * GC * LDK;               // q          [NB][GC][LDK]
    u16* Kb = Qb + NB * GC * LDK;               // k          [NB][GC][LDK]
    u16* Mb = Kb + NB * GC * LDK;               // M          [NB][GC][GC_LDM]
    u16* Sb = Mb + NB * GC * GC_LDM;            // S (bf16)   [DK][GC_LDC]
    u16* Db = Sb + DK * GC_LDC;                 // D          [GC][GC_LDC]
    u16* Dd = Db + GC * GC_LDC;                 // e^(G_last - G) D   [GC][GC_LDC]
    u16* Ub = Dd + GC * GC_LDC;                 // U columns  [NB][GC][GC_LDC]
    float* Gb = reinterpret_cast<float*>(Ub + NB * GC * GC_LDC);  // G  [NB][GC]
    const int h = blockIdx.x, c0 = blockIdx.y * GCV, tid = threadIdx.x, lane = tid & 31;
    const int warp = (tid >> 5) & 3, kh = h / (nv / nk);
    const bool owns_state = tid < 128;
    const int g = lane >> 2, q = lane & 3;
    ST* S = state + (size_t)h * DK * dv + c0;
    float sacc[MT][4][4];
    if (owns_state) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                const int r = warp * RW + mi * 16 + g, col = n8 * 8 + 2 * q;
                const float2 lo = gdn_st_ld2(S + (size_t)r * dv + col);
                const float2 hi = gdn_st_ld2(S + (size_t)(r + 8) * dv + col);
                sacc[mi][n8][0] = lo.x;
                sacc[mi][n8][1] = lo.y;
                sacc[mi][n8][2] = hi.x;
                sacc[mi][n8][3] = hi.y;
                *reinterpret_cast<u32*>(Sb + r * GC_LDC + col) = pack_bf16(lo.x, lo.y);
                *reinterpret_cast<u32*>(Sb + (r + 8) * GC_LDC + col) = pack_bf16(hi.x, hi.y);
            }
    }
    const int nch = (T + GC - 1) / GC;
    // The output warps (4-7) copy every chunk's tiles in, two chunks ahead, after their Q S of the
    // chunk before (shorter than the state warps' W S and D): the state warps' chain of products
    // issues no copies.
    const int ct = tid - 128;
    auto issue = [&](int c, int bf) {
        const size_t ch = (size_t)(cg0 + c) * nv + h, chk = (size_t)(cg0 + c) * nk + kh;
        const u16* w = w_in + ch * GC * DK;
        const u16* qc = q_in + chk * GC * DK;
        const u16* kc = k_in + chk * GC * DK;
        for (int idx = ct; idx < GC * (DK / 8); idx += 128) {
            const int t = idx / (DK / 8), i = (idx % (DK / 8)) * 8;
            const int so = (bf * GC + t) * LDK + i;
            cp_async16(Wb + so, w + t * DK + i);
            cp_async16(Qb + so, qc + t * DK + i);
            cp_async16(Kb + so, kc + t * DK + i);
        }
        const u16* m = m_in + ch * GC * GC;
        for (int idx = ct; idx < GC * (GC / 8); idx += 128) {
            const int t = idx / (GC / 8), s = (idx % (GC / 8)) * 8;
            cp_async16(Mb + (bf * GC + t) * GC_LDM + s, m + t * GC + s);
        }
        const u16* u = u_in + ch * GC * dv + c0;
        for (int idx = ct; idx < GC * (GCV / 8); idx += 128) {
            const int t = idx / (GCV / 8), j = (idx % (GCV / 8)) * 8;
            cp_async16(Ub + (bf * GC + t) * GC_LDC + j, u + (size_t)t * dv + j);
        }
        if (ct < GC / 4) cp_async16(Gb + bf * GC + 4 * ct, g_in + ch * GC + 4 * ct);
        cp_commit();
    };
    const int xoff = ((lane & 7) + (((lane >> 3) & 1) << 3)), yoff = ((lane >> 4) << 3);
    const u32 sB = smem_u32(Sb) + (xoff * GC_LDC + yoff) * 2;
    const u32 dB = smem_u32(Db) + (xoff * GC_LDC + yoff) * 2;
    const u32 ddB = smem_u32(Dd) + (xoff * GC_LDC + yoff) * 2;
    const int row = warp * 16 + g;
    if (!owns_state) {
        if (nch > 0) issue(0, 0);
        if (nch > 1) issue(1, 1);
    }
    for (int c = 0; c < nch; ++c) {
        const int bf = c % NB, t0 = c * GC, nt = min(GC, T - t0);
        if (!owns_state) {  // this chunk's copies landed (the next one's may be in flight)
            if (c + 1 < nch) cp_wait<1>();
            else cp_wait<0>();
        }
        __syncthreads();
        const float* G = Gb + bf * GC;
        const float glast = G[GC - 1];
        // This warp's 16 token rows of D = U - W S (warps 0-3) or Q S (warps 4-7).
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
        const u32 aA = smem_u32(owns_state ? Wb : Qb) + ((bf * GC + warp * 16 + (lane & 15)) * LDK + ((lane >> 4) << 3)) * 2;
        mma_rows16_cols32<DK / 16>(acc, aA, sB, GC_LDC, DK / 16);
        if (owns_state) {
            const u16* U = Ub + bf * GC * GC_LDC;
            const float d0 = expf(glast - G[row]), d1 = expf(glast - G[row + 8]);
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                const int col = n8 * 8 + 2 * q;
                const u32 u0 = *reinterpret_cast<const u32*>(U + row * GC_LDC + col);
                const u32 u1 = *reinterpret_cast<const u32*>(U + (row + 8) * GC_LDC + col);
                const float a0 = __uint_as_float(u0 << 16) - acc[n8][0], a1 = __uint_as_float(u0 & 0xffff0000u) - acc[n8][1];
                const float b0 = __uint_as_float(u1 << 16) - acc[n8][2], b1 = __uint_as_float(u1 & 0xffff0000u) - acc[n8][3];
                *reinterpret_cast<u32*>(Db + row * GC_LDC + col) = pack_bf16(a0, a1);
                *reinterpret_cast<u32*>(Db + (row + 8) * GC_LDC + col) = pack_bf16(b0, b1);
                *reinterpret_cast<u32*>(Dd + row * GC_LDC + col) = pack_bf16(d0 * a0, d0 * a1);
                *reinterpret_cast<u32*>(Dd + (row + 8) * GC_LDC + col) = pack_bf16(d1 * b0, d1 * b1);
            }
        } else {
            const float e0 = expf(G[row]), e1 = expf(G[row + 8]);
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                acc[n8][0] *= e0;
                acc[n8][1] *= e0;
                acc[n8][2] *= e1;
                acc[n8][3] *= e1;
            }
            // Chunk c + 2's tiles into the stage chunk c - 1 left (free since the last barrier).
            if (c + 2 < nch) issue(c + 2, (c + 2) % NB);
        }
        __syncthreads();  // D complete; every warp is done reading S
        if (!owns_state) {
            // O = e^G Q S + M D (M is lower triangular: the k-steps up to this warp's rows).
            const u32 mA = smem_u32(Mb) + ((bf * GC + warp * 16 + (lane & 15)) * GC_LDM + ((lane >> 4) << 3)) * 2;
            mma_rows16_cols32<4>(acc, mA, dB, GC_LDC, warp + 1);
            float* orow = o + (size_t)h * dv + c0;
            const size_t ostride = (size_t)nv * dv;
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                const int col = n8 * 8 + 2 * q;
                if (row < nt) *reinterpret_cast<float2*>(orow + (size_t)(t0 + row) * ostride + col) = make_float2(acc[n8][0], acc[n8][1]);
                if (row + 8 < nt) *reinterpret_cast<float2*>(orow + (size_t)(t0 + row + 8) * ostride + col) = make_float2(acc[n8][2], acc[n8][3]);
            }
        } else {
            // S = e^(G_last) S + K^T (e^(G_last - G) D) for this warp's key rows (K^T through
            // transposed loads).
            const float eg = expf(glast);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int n8 = 0; n8 < 4; ++n8)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sacc[mi][n8][e] *= eg;
            const u32 kT = smem_u32(Kb) + ((bf * GC + (lane & 7) + ((lane >> 4) << 3)) * LDK + warp * RW + (((lane >> 3) & 1) << 3)) * 2;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                u32 bd[2][4];
#pragma unroll
                for (int cp = 0; cp < 2; ++cp) ldsm_x4_t(ddB + (ks * 16 * GC_LDC + cp * 16) * 2, bd[cp][0], bd[cp][1], bd[cp][2], bd[cp][3]);
#pragma unroll
                for (int mi = 0; mi < MT; ++mi) {
                    u32 a[4];
                    ldsm_x4_t(kT + (ks * 16 * LDK + mi * 16) * 2, a[0], a[1], a[2], a[3]);
#pragma unroll
                    for (int cp = 0; cp < 2; ++cp) {
                        mma_bf16(sacc[mi][2 * cp], a, bd[cp][0], bd[cp][1]);
                        mma_bf16(sacc[mi][2 * cp + 1], a, bd[cp][2], bd[cp][3]);
                    }
                }
            }
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int n8 = 0; n8 < 4; ++n8) {
                    const int r = warp * RW + mi * 16 + g, col = n8 * 8 + 2 * q;
                    *reinterpret_cast<u32*>(Sb + r * GC_LDC + col) = pack_bf16(sacc[mi][n8][0], sacc[mi][n8][1]);
                    *reinterpret_cast<u32*>(Sb + (r + 8) * GC_LDC + col) = pack_bf16(sacc[mi][n8][2], sacc[mi][n8][3]);
                }
        }
        __syncthreads();  // this chunk's buffers and D are free again
    }
    if (owns_state) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int n8 = 0; n8 < 4; ++n8) {
                const int r = warp * RW + mi * 16 + g, col = n8 * 8 + 2 * q;
                gdn_st_st2(S + (size_t)r * dv + col, sacc[mi][n8][0], sacc[mi][n8][1]);
                gdn_st_st2(S + (size_t)(r + 8) * dv + col, sacc[mi][n8][2], sacc[mi][n8][3]);
            }
    }
}

#define PF_GDN_CHUNK(DK)                                                                                           \
    PF_GDN_CHUNK_PREP(DK, pf_gdn_chunk_prep_##DK, float)                                                          \
    PF_GDN_CHUNK_PREP(DK, pf_gdn_chunk_prep_##DK##_bf16, u16)                                                     \
    PF_GDN_CHUNK_WALK(DK, pf_gdn_chunk_walk_##DK, float)                                                          \
    PF_GDN_CHUNK_WALK(DK, pf_gdn_chunk_walk_##DK##_f16, u16)
#define PF_GDN_CHUNK_PREP(DK, NAME, IT)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                        \
        const IT* qn, const IT* kn, const IT* conv, const float* braw, const float* araw,                          \
        const float* dt_bias, const float* neg_a, const ScanSegs segs, u16* u, u16* w, u16* q, u16* k, u16* m,    \
        float* g, int nk, int nv, int dv, int C) {                                                                 \
        const int z = blockIdx.z;                                                                                  \
        const size_t r0 = segs.r0[z], kd_ = (size_t)nk * DK;                                                       \
        gdn_chunk_prep<DK, IT>(qn + r0 * kd_, kn + r0 * kd_, conv + r0 * C, braw + r0 * nv, araw + r0 * nv,        \
                               dt_bias, neg_a, segs.n[z], seg_chunk_base(segs, z), nk, nv, dv, C, u, w, q, k, m,   \
                               g);                                                                                 \
    }
#define PF_GDN_CHUNK_WALK(DK, NAME, ST)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                        \
        const u16* u, const u16* w, const u16* q, const u16* k, const u16* m, const float* g,                      \
        const ScanSegs segs, float* o, int nk, int nv, int dv) {                                                   \
        const int z = blockIdx.z;                                                                                  \
        gdn_chunk_walk<DK, ST>(u, w, q, k, m, g, reinterpret_cast<ST*>(segs.state[z]),                             \
                               o + (size_t)segs.r0[z] * nv * dv, segs.n[z], seg_chunk_base(segs, z), nk, nv, dv);  \
    }
PF_GDN_CHUNK(64)
PF_GDN_CHUNK(128)

// Gated RMSNorm per (token, value head): norm(o) * w * silu(z), one warp per head row in float4s
// (lane l: channels 4l..4l + 3, dv <= 128), into y, or, where the out-projection runs on cuBLAS
// (`staged` set), only as the bf16 copy that GEMM reads (pf_to_bf16's rounding of the same
// values), so y is neither written nor read back. grid (ceil(T * nv / 8)), block 256.
template <typename ZT>
__device__ __forceinline__ void gdn_norm(const float* __restrict__ o, const ZT* __restrict__ z,
                                         const float* __restrict__ norm_w, float* __restrict__ y,
                                         uint2* __restrict__ staged, int T, int nv, int dv, float eps) {
    const int lane = threadIdx.x & 31, row = blockIdx.x * 8 + (threadIdx.x >> 5), j = 4 * lane;
    if (row >= T * nv) return;
    const bool on = j < dv;
    const size_t idx = (size_t)row * dv + j;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (on) v = *reinterpret_cast<const float4*>(o + idx);
    const float inv = inv_rms_from(warp_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w), dv, eps);
    if (!on) return;
    const float4 w = *reinterpret_cast<const float4*>(norm_w + j), g = act_ld4(z + idx);
    const float4 r = make_float4(v.x * inv * w.x * silu_f(g.x), v.y * inv * w.y * silu_f(g.y),
                                 v.z * inv * w.z * silu_f(g.z), v.w * inv * w.w * silu_f(g.w));
    if (staged) staged[idx / 4] = make_uint2(pack_bf16(r.x, r.y), pack_bf16(r.z, r.w));
    else *reinterpret_cast<float4*>(y + idx) = r;
}
// z f32, or bf16 (`_bf16`: the in-projection on cuBLAS with a bf16 output).
extern "C" __global__ void pf_gdn_norm(const float* __restrict__ o, const float* __restrict__ z,
                                       const float* __restrict__ norm_w, float* __restrict__ y,
                                       uint2* __restrict__ staged, int T, int nv, int dv, float eps) {
    gdn_norm<float>(o, z, norm_w, y, staged, T, nv, dv, eps);
}
extern "C" __global__ void pf_gdn_norm_bf16(const float* __restrict__ o, const u16* __restrict__ z,
                                            const float* __restrict__ norm_w, float* __restrict__ y,
                                            uint2* __restrict__ staged, int T, int nv, int dv, float eps) {
    gdn_norm<u16>(o, z, norm_w, y, staged, T, nv, dv, eps);
}
