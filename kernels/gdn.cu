// Gated DeltaNet (linear attention with the delta rule). Same math and order as
// src/backend/cpu/gdn.rs.
//   decode (T = 1):     gdn_step
//   batched decode:     gdn_step_batch (one token of each of B sequences)
//   prefill (T tokens): pf_gdn_conv, pf_gdn_ring, pf_gdn_qk, pf_gdn_scan_32, pf_gdn_scan_64,
//                       pf_gdn_scan_128 (exact), pf_gdn_chunk_prep_{64,128} +
//                       pf_gdn_chunk_scan_{64,128} (chunked), pf_gdn_norm

// softplus as the CPU reference computes it (src/backend/cpu/ops.rs).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ================================ decode (T = 1) ================================
// Gated DeltaNet decode step, one block per value head, everything fused:
// causal conv1d step + SiLU on the head's q/k/v channels, L2 norm of q and k, the gates
// (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)), the delta-rule update of the
// fp32 state S [dk][dv] and o = S^T q, then the gated RMSNorm norm(o) * w * silu(z).
// Same math and order as src/backend/cpu/gdn.rs (recurrent_step).
//
// Threads: dv * (dk / 32). Thread (j, r) owns column j and rows [32r, 32r + 32) of S, kept in
// registers across both passes (read once, written once).
//
// The conv history is a ring of KC slots indexed by position: the new input goes to slot
// pos % KC, which only held position pos - KC (no longer needed). Blocks sharing a key head read
// the q/k history while one of them writes the new value, and no block reads the slot being
// written, so there is no race without a second kernel.
#define GDN_SL 32

__device__ __forceinline__ void gdn_step_impl(const float* __restrict__ qkv, const float* __restrict__ z,
                                              const float* __restrict__ braw, const float* __restrict__ araw,
                                              float* __restrict__ ring, const float* __restrict__ taps,
                                              const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                              const float* __restrict__ norm_w, float* __restrict__ state,
                                              float* __restrict__ y, const int* __restrict__ step, int nk, int nv,
                                              int dk, int dv, int KC, float eps) {
    extern __shared__ float sm[];
    float* qs = sm;            // dk
    float* ks = qs + dk;       // dk
    float* vs = ks + dk;       // dv
    float* part = vs + dv;     // 2 * (dk/32) * dv: kv partials, then o partials
    float* red = part + 2 * (dk / GDN_SL) * dv;  // 33
    const int n = blockIdx.x, group = nv / nk, kh = n / group;
    const int key_dim = nk * dk, conv_dim = 2 * key_dim + nv * dv;
    const int pos = step[1], slot = pos % KC;
    const int tid = threadIdx.x, nt = blockDim.x;
    // The state slice does not depend on this step's inputs: its loads (the head's 64 KB, the
    // bulk of the kernel's traffic) are issued first and overlap the conv / norm prologue.
    const int j = tid % dv, r = tid / dv, i0 = r * GDN_SL;
    const bool active = r < dk / GDN_SL;
    float* S = state + (size_t)n * dk * dv;
    float s[GDN_SL];
    if (active) {
#pragma unroll
        for (int ii = 0; ii < GDN_SL; ++ii) s[ii] = S[(size_t)(i0 + ii) * dv + j];
    }
    // The state was written by this layer's step of the previous token (an earlier step), so it
    // is read before the PDL wait, like the static parameters and the conv history of this
    // thread's first channel (ring slots of earlier positions): its conv sum over the history
    // taps is formed here, in the same order as the full sum below. The projections (qkv, z, b,
    // a) are read only after the wait.
    const int nch = 2 * dk + dv;
    auto chan = [&](int idx) {
        if (idx < dk) return kh * dk + idx;
        if (idx < 2 * dk) return key_dim + kh * dk + (idx - dk);
        return 2 * key_dim + n * dv + (idx - 2 * dk);
    };
    float pre = 0.f, tap_last = 0.f;
    const int ch0 = tid < nch ? chan(tid) : 0;
    if (tid < nch) {
        for (int jj = 0; jj < KC - 1; ++jj) {
            int p = pos - (KC - 1) + jj;
            float in = p < 0 ? 0.f : ring[(size_t)(p % KC) * conv_dim + ch0];
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
            for (int jj = 0; jj < KC; ++jj) {
                int p = pos - (KC - 1) + jj;
                float in = (jj == KC - 1) ? cur : (p < 0 ? 0.f : ring[(size_t)(p % KC) * conv_dim + ch]);
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
    __syncthreads();
    // L2 norms (eps 1e-6, as HF's l2norm) and the 1/sqrt(dk) query scale: the first dk threads
    // (whole warps) reduce q*q and k*k, one barrier publishes the warp sums, and every thread
    // forms the same factors. q and k are normalised where they are read (the same products,
    // qs[i] * iq * qscale and ks[i] * ik, as a separate normalisation pass, without its barrier).
    const int lane = tid & 31, warp = tid >> 5, kw = dk >> 5;
    if (tid < dk) {
        const float q = qs[tid], k = ks[tid];
        const float wq = warp_sum(q * q), wk = warp_sum(k * k);
        if (lane == 0) { red[warp] = wq; red[kw + warp] = wk; }
    }
    __syncthreads();
    float sq = 0.f, sk = 0.f;
    for (int w = 0; w < kw; ++w) { sq += red[w]; sk += red[kw + w]; }
    const float iq = (float)(1.0 / sqrt((double)sq + 1e-6)), ik = (float)(1.0 / sqrt((double)sk + 1e-6));
    const float qscale = 1.f / sqrtf((float)dk);

    const float beta = sigmoid_f(bn);
    const float g = nega * softplus_f(an + dtb);
    const float alpha = expf(g);
    float kv = 0.f;
    if (active) {
#pragma unroll
        for (int ii = 0; ii < GDN_SL; ++ii) {
            s[ii] = s[ii] * alpha;
            kv += s[ii] * (ks[i0 + ii] * ik);
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
            s[ii] += (ks[i0 + ii] * ik) * delta;
            o += s[ii] * (qs[i0 + ii] * iq * qscale);
            S[(size_t)(i0 + ii) * dv + j] = s[ii];
        }
        part_o[r * dv + j] = o;
    }
    __syncthreads();
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
        y[(size_t)n * dv + j] = o * inv * nwj * silu_f(zj);
    }
}

extern "C" __global__ void gdn_step(const float* __restrict__ qkv, const float* __restrict__ z,
                                    const float* __restrict__ braw, const float* __restrict__ araw,
                                    float* __restrict__ ring, const float* __restrict__ taps,
                                    const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                    const float* __restrict__ norm_w, float* __restrict__ state, float* __restrict__ y,
                                    const int* __restrict__ step, int nk, int nv, int dk, int dv, int KC, float eps) {
    gdn_step_impl(qkv, z, braw, araw, ring, taps, dt_bias, neg_a, norm_w, state, y, step, nk, nv, dk, dv, KC, eps);
}

// The step of a batch of sequences (batched decode): blockIdx.y = row b, one token of sequence b,
// its projections at row b of the token-major activations, its conv ring and state from the
// per-row pointer tables, its [token, position] at steps[2b]. Each row is exactly gdn_step.
extern "C" __global__ void __launch_bounds__(512, 2) gdn_step_batch(const float* __restrict__ qkv, const float* __restrict__ z,
                                          const float* __restrict__ braw, const float* __restrict__ araw,
                                          float* const* __restrict__ rings, const float* __restrict__ taps,
                                          const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                          const float* __restrict__ norm_w, float* const* __restrict__ states,
                                          float* __restrict__ y, const int* __restrict__ steps, int nk, int nv,
                                          int dk, int dv, int KC, float eps) {
    const int b = blockIdx.y;
    const size_t conv_dim = 2 * (size_t)nk * dk + (size_t)nv * dv, vd = (size_t)nv * dv;
    gdn_step_impl(qkv + b * conv_dim, z + b * vd, braw + (size_t)b * nv, araw + (size_t)b * nv, rings[b], taps,
                  dt_bias, neg_a, norm_w, states[b], y + b * vd, steps + 2 * b, nk, nv, dk, dv, KC, eps);
}

// ============================== prefill (T tokens) ==============================
// Activations are token-major f32 [T][dim] (docs/cuda-prefill.md, src/backend/cuda/prefill.rs).
// The scan is the exact recurrence (gdn::recurrent_step) run over the chunk with the state in
// registers.

// Causal depthwise conv + SiLU over T tokens at positions pos0.. (history from the ring):
// grid (ceil(C/256), T).
extern "C" __global__ void pf_gdn_conv(const float* __restrict__ qkv, const float* __restrict__ ring,
                                       const float* __restrict__ taps, int T, int C, int KC, int pos0,
                                       float* __restrict__ out) {
    const int t = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float acc = 0.f;
    for (int j = 0; j < KC; ++j) {
        int p = pos0 + t - (KC - 1) + j;
        float in = p >= pos0 ? qkv[(size_t)(p - pos0) * C + ch] : (p < 0 ? 0.f : ring[(size_t)(p % KC) * C + ch]);
        acc += taps[(size_t)j * C + ch] * in;
    }
    out[(size_t)t * C + ch] = silu_f(acc);
}

// After the conv: the ring slots of the last min(T, KC) positions get their pre-conv inputs.
// grid (ceil(C/256), min(T, KC)).
extern "C" __global__ void pf_gdn_ring(const float* __restrict__ qkv, float* __restrict__ ring, int T, int C, int KC,
                                       int pos0) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int t = T - 1 - blockIdx.y, p = pos0 + t;
    ring[(size_t)(p % KC) * C + ch] = qkv[(size_t)t * C + ch];
}

// L2 norm of q and k per (token, key head) (eps 1e-6, in f64 like ops::l2_normalize), q scaled
// by dk^-1/2: grid (T, nk), block dk.
extern "C" __global__ void pf_gdn_qk(const float* __restrict__ conv, int C, int nk, int dk, float* __restrict__ qn,
                                     float* __restrict__ kn) {
    __shared__ float red[33];
    const int t = blockIdx.x, kh = blockIdx.y, i = threadIdx.x, key_dim = nk * dk;
    float q = conv[(size_t)t * C + kh * dk + i];
    float k = conv[(size_t)t * C + key_dim + kh * dk + i];
    float sq = block_sum(q * q, red);
    float sk = block_sum(k * k, red);
    float iq = (float)(1.0 / sqrt((double)sq + 1e-6)), ik = (float)(1.0 / sqrt((double)sk + 1e-6));
    qn[(size_t)t * key_dim + kh * dk + i] = q * iq * (1.f / sqrtf((float)dk));
    kn[(size_t)t * key_dim + kh * dk + i] = k * ik;
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
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

template <int DK>
__device__ void gdn_scan(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ conv,
                         const float* __restrict__ braw, const float* __restrict__ araw,
                         const float* __restrict__ dt_bias, const float* __restrict__ neg_a, float* __restrict__ state,
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
    float* S = state + (size_t)n * DK * dv;
    float sreg[R];
#pragma unroll
    for (int i = 0; i < R; ++i) sreg[i] = cvalid ? S[(size_t)(part * R + i) * dv + c] : 0.f;
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
        cp_async_commit();
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
        cp_async_wait_all();
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
        for (int i = 0; i < R; ++i) S[(size_t)(part * R + i) * dv + c] = sreg[i];
    }
}

#define PF_GDN_SCAN(DK)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) pf_gdn_scan_##DK(                                           \
        const float* qn, const float* kn, const float* conv, const float* braw, const float* araw,                 \
        const float* dt_bias, const float* neg_a, float* state, float* o, int T, int nk, int nv, int dv, int C) {   \
        gdn_scan<DK>(qn, kn, conv, braw, araw, dt_bias, neg_a, state, o, T, nk, nv, dv, C);                        \
    }
PF_GDN_SCAN(32)
PF_GDN_SCAN(64)
PF_GDN_SCAN(128)

// ---- the chunked scan (default mode): chunks of GC tokens in the WY form ----
// Within a chunk whose state starts at S0, with g_t = log a_t and G_t = sum_{s<=t} g_s:
//   d_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) d_s)
//   o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) d_s
//   S   = exp(G_last) S0 + sum_s exp(G_last - G_s) k_s d_s^T
// (unrolling gdn::recurrent_step's S = aS; d = b(v - S^T k); S += k d^T; o = S^T q). So
// D = U - W S0, where (I + A) U = diag(beta) V and (I + A) W = diag(beta exp(G)) K with
// A[t][s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t: everything but the product with S0 is
// local to the chunk. pf_gdn_chunk_prep computes it for every (chunk, value head) at once: U, W,
// M[t][s] = exp(G_t - G_s) (q_t . k_s) for s <= t, and G; pf_gdn_chunk_scan then walks the chunks
// in order per (value head, GCV state columns), three small matrix products per chunk in f32.
// Same math as the exact scan in another order (rounding differences only), so the exact mode
// keeps pf_gdn_scan_* and the default takes this for longer inputs (gdn.rs select_scan_path).
// Chunk c of a launch covers tokens c*GC .. of the `T` given; scratch is indexed by that chunk.
#define GC 64
#define GCV 32

// grid (ceil(T / GC), nv), block 256 (dv + DK <= 256: thread j solves column j of [U | W]).
// Dynamic shared memory: (2 GC (DK + 1) + GC (GC + 1) + 2 GC) floats.
template <int DK>
__device__ void gdn_chunk_prep(const float* __restrict__ qn, const float* __restrict__ kn,
                               const float* __restrict__ conv, const float* __restrict__ braw,
                               const float* __restrict__ araw, const float* __restrict__ dt_bias,
                               const float* __restrict__ neg_a, int T, int nk, int nv, int dv, int C,
                               float* __restrict__ u, float* __restrict__ w, float* __restrict__ mq,
                               float* __restrict__ gsc) {
    extern __shared__ float cp_sm[];
    constexpr int LD = DK + 1;
    float* Ks = cp_sm;
    float* Qs = Ks + GC * LD;
    float* As = Qs + GC * LD;
    float* bs = As + GC * (GC + 1);
    float* Gs = bs + GC;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int t0 = c * GC, nt = min(GC, T - t0);
    const int kh = h / (nv / nk), key_dim = nk * DK;
    for (int idx = tid; idx < GC * DK; idx += blockDim.x) {
        const int t = idx / DK, i = idx % DK;
        const size_t off = (size_t)(t0 + t) * key_dim + kh * DK + i;
        Ks[t * LD + i] = t < nt ? kn[off] : 0.f;
        Qs[t * LD + i] = t < nt ? qn[off] : 0.f;
    }
    if (tid < GC) {
        float b = 0.f, g = 0.f;  // padding: beta 0 (nothing written), no decay
        if (tid < nt) {
            b = sigmoid_f(braw[(size_t)(t0 + tid) * nv + h]);
            g = neg_a[h] * softplus_f(araw[(size_t)(t0 + tid) * nv + h] + dt_bias[h]);
        }
        bs[tid] = b;
        Gs[tid] = g;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int t = 0; t < GC; ++t) {
            acc += Gs[t];
            Gs[t] = acc;
        }
    }
    __syncthreads();
    float* m_out = mq + ((size_t)c * nv + h) * GC * GC;
    for (int p = tid; p < GC * GC; p += blockDim.x) {
        const int t = p / GC, s = p % GC;
        float a = 0.f, m = 0.f;
        if (s <= t) {
            float kk = 0.f, qk = 0.f;
#pragma unroll 8
            for (int i = 0; i < DK; ++i) {
                const float ks = Ks[s * LD + i];
                kk = fmaf(Ks[t * LD + i], ks, kk);
                qk = fmaf(Qs[t * LD + i], ks, qk);
            }
            const float e = expf(Gs[t] - Gs[s]);
            m = e * qk;
            if (s < t) a = bs[t] * e * kk;
        }
        As[t * (GC + 1) + s] = a;
        m_out[p] = m;
    }
    __syncthreads();
    const int j = tid;
    if (j < dv + DK) {
        const bool is_u = j < dv;
        float X[GC];
#pragma unroll
        for (int t = 0; t < GC; ++t) {
            float r = 0.f;
            if (t < nt) r = is_u ? bs[t] * conv[(size_t)(t0 + t) * C + 2 * key_dim + h * dv + j]
                                 : bs[t] * expf(Gs[t]) * Ks[t * LD + j - dv];
            X[t] = r;
        }
#pragma unroll
        for (int t = 1; t < GC; ++t) {
            float x = X[t];
#pragma unroll
            for (int s = 0; s < t; ++s) x = fmaf(-As[t * (GC + 1) + s], X[s], x);
            X[t] = x;
        }
        const size_t row0 = ((size_t)c * nv + h) * GC;
#pragma unroll
        for (int t = 0; t < GC; ++t) {
            if (is_u) u[(row0 + t) * dv + j] = X[t];
            else w[(row0 + t) * DK + j - dv] = X[t];
        }
    }
    if (tid < GC) gsc[((size_t)c * nv + h) * GC + tid] = Gs[tid];
}

// grid (nv, dv / GCV), block 256. The block's state columns live transposed in shared memory
// (St[j][i], i along the key dim). Per chunk: D = U - W S and Q S (thread: column j = tid % 32,
// rows t = tid / 32 + 8m), then O = exp(G) Q S + M D, then S = exp(G_last) S + sum_s exp(G_last -
// G_s) k_s d_s^T (thread: column j, key rows 16 (tid / 32) ..+16). Dynamic shared memory:
// (GCV (DK + 4) + 3 GC (DK + 4) + GC (GC + 4) + GC GCV + GC (GCV + 1) + 2 GC) floats.
template <int DK>
__device__ void gdn_chunk_scan(const float* __restrict__ qn, const float* __restrict__ kn,
                               const float* __restrict__ u, const float* __restrict__ w,
                               const float* __restrict__ mq, const float* __restrict__ gsc,
                               float* __restrict__ state, float* __restrict__ o, int T, int nk, int nv, int dv) {
    extern __shared__ __align__(16) float cs_sm[];
    constexpr int LD = DK + 4, MLD = GC + 4, DLD = GCV + 1;
    float* St = cs_sm;
    float* Ws = St + GCV * LD;
    float* Qs = Ws + GC * LD;
    float* Ks = Qs + GC * LD;
    float* Ms = Ks + GC * LD;
    float* Us = Ms + GC * MLD;
    float* Ds = Us + GC * GCV;
    float* Gs = Ds + GC * DLD;
    float* Es = Gs + GC;
    const int h = blockIdx.x, c0 = blockIdx.y * GCV, tid = threadIdx.x;
    const int j = tid & 31, tq = tid >> 5;
    const int kh = h / (nv / nk), key_dim = nk * DK;
    float* S = state + (size_t)h * DK * dv;
    for (int idx = tid; idx < DK * GCV; idx += blockDim.x) {
        const int i = idx / GCV, jj = idx % GCV;
        St[jj * LD + i] = S[(size_t)i * dv + c0 + jj];
    }
    const int nch = (T + GC - 1) / GC;
    for (int c = 0; c < nch; ++c) {
        const int t0 = c * GC, nt = min(GC, T - t0);
        const size_t row0 = ((size_t)c * nv + h) * GC;
        __syncthreads();  // the previous chunk is done with every buffer
        for (int idx = tid; idx < GC * (DK / 4); idx += blockDim.x) {
            const int t = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
            cp_async16(&Ws[t * LD + i], w + (row0 + t) * DK + i);
            if (t < nt) {
                const size_t off = (size_t)(t0 + t) * key_dim + kh * DK + i;
                cp_async16(&Qs[t * LD + i], qn + off);
                cp_async16(&Ks[t * LD + i], kn + off);
            } else {
                *reinterpret_cast<float4*>(&Qs[t * LD + i]) = make_float4(0.f, 0.f, 0.f, 0.f);
                *reinterpret_cast<float4*>(&Ks[t * LD + i]) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        for (int idx = tid; idx < GC * (GC / 4); idx += blockDim.x) {
            const int t = idx / (GC / 4), s = (idx % (GC / 4)) * 4;
            cp_async16(&Ms[t * MLD + s], mq + (row0 + t) * GC + s);
        }
        for (int idx = tid; idx < GC * (GCV / 4); idx += blockDim.x) {
            const int t = idx / (GCV / 4), jj = (idx % (GCV / 4)) * 4;
            cp_async16(&Us[t * GCV + jj], u + (row0 + t) * dv + c0 + jj);
        }
        cp_async_commit();
        if (tid < GC) Gs[tid] = gsc[row0 + tid];
        cp_async_wait_all();
        __syncthreads();
        const float glast = Gs[GC - 1];
        if (tid < GC) Es[tid] = expf(glast - Gs[tid]);
        // D = U - W S and Q S for rows tq + 8m.
        float dw[8], qs[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) dw[m] = qs[m] = 0.f;
#pragma unroll 2
        for (int i = 0; i < DK; i += 4) {
            const float4 s4 = *reinterpret_cast<const float4*>(&St[j * LD + i]);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int t = tq + 8 * m;
                const float4 w4 = *reinterpret_cast<const float4*>(&Ws[t * LD + i]);
                const float4 q4 = *reinterpret_cast<const float4*>(&Qs[t * LD + i]);
                dw[m] = fmaf(w4.x, s4.x, fmaf(w4.y, s4.y, fmaf(w4.z, s4.z, fmaf(w4.w, s4.w, dw[m]))));
                qs[m] = fmaf(q4.x, s4.x, fmaf(q4.y, s4.y, fmaf(q4.z, s4.z, fmaf(q4.w, s4.w, qs[m]))));
            }
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int t = tq + 8 * m;
            Ds[t * DLD + j] = Us[t * GCV + j] - dw[m];
        }
        __syncthreads();  // D complete; S no longer read until its update
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int t = tq + 8 * m;
            float acc = expf(Gs[t]) * qs[m];
            for (int s = 0; s <= t; ++s) acc = fmaf(Ms[t * MLD + s], Ds[s * DLD + j], acc);
            if (t < nt) o[(size_t)(t0 + t) * nv * dv + (size_t)h * dv + c0 + j] = acc;
        }
        // S = exp(G_last) S + sum_s exp(G_last - G_s) k_s d_s^T, rows i0 .. i0 + DK/8 of column j.
        constexpr int RI = DK / 8;
        const int i0 = tq * RI;
        const float el = expf(glast);
        float acc[RI];
#pragma unroll
        for (int r = 0; r < RI; ++r) acc[r] = el * St[j * LD + i0 + r];
        for (int s = 0; s < GC; ++s) {
            const float ds = Es[s] * Ds[s * DLD + j];
#pragma unroll
            for (int r = 0; r < RI; r += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&Ks[s * LD + i0 + r]);
                acc[r] = fmaf(k4.x, ds, acc[r]);
                acc[r + 1] = fmaf(k4.y, ds, acc[r + 1]);
                acc[r + 2] = fmaf(k4.z, ds, acc[r + 2]);
                acc[r + 3] = fmaf(k4.w, ds, acc[r + 3]);
            }
        }
#pragma unroll
        for (int r = 0; r < RI; ++r) St[j * LD + i0 + r] = acc[r];
    }
    __syncthreads();
    for (int idx = tid; idx < DK * GCV; idx += blockDim.x) {
        const int i = idx / GCV, jj = idx % GCV;
        S[(size_t)i * dv + c0 + jj] = St[jj * LD + i];
    }
}

#define PF_GDN_CHUNK(DK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) pf_gdn_chunk_prep_##DK(                                      \
        const float* qn, const float* kn, const float* conv, const float* braw, const float* araw,                 \
        const float* dt_bias, const float* neg_a, int T, int nk, int nv, int dv, int C, float* u, float* w,        \
        float* mq, float* gsc) {                                                                                   \
        gdn_chunk_prep<DK>(qn, kn, conv, braw, araw, dt_bias, neg_a, T, nk, nv, dv, C, u, w, mq, gsc);             \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) pf_gdn_chunk_scan_##DK(                                      \
        const float* qn, const float* kn, const float* u, const float* w, const float* mq, const float* gsc,       \
        float* state, float* o, int T, int nk, int nv, int dv) {                                                   \
        gdn_chunk_scan<DK>(qn, kn, u, w, mq, gsc, state, o, T, nk, nv, dv);                                        \
    }
PF_GDN_CHUNK(64)
PF_GDN_CHUNK(128)

// Gated RMSNorm per (token, value head): norm(o) * w * silu(z). grid (T, nv), block dv.
extern "C" __global__ void pf_gdn_norm(const float* __restrict__ o, const float* __restrict__ z,
                                       const float* __restrict__ norm_w, float* __restrict__ y, int nv, int dv,
                                       float eps) {
    __shared__ float red[33];
    const int t = blockIdx.x, n = blockIdx.y, j = threadIdx.x;
    size_t idx = (size_t)t * nv * dv + n * dv + j;
    float v = o[idx];
    float ss = block_sum(v * v, red);
    float inv = inv_rms_from(ss, dv, eps);
    y[idx] = v * inv * norm_w[j] * silu_f(z[idx]);
}
