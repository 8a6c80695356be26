// Gated DeltaNet (linear attention with the delta rule). Same math and order as
// src/backend/cpu/gdn.rs.
//   decode (T = 1):     gdn_step
//   batched decode:     gdn_step_batch (one token of each of B sequences)
//   prefill (T tokens): pf_gdn_conv, pf_gdn_ring, pf_gdn_qk, pf_gdn_scan_32, pf_gdn_scan_64,
//                       pf_gdn_scan_128, pf_gdn_norm

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

// Up to GDN_SCAN_SEGS sequences' scans in one launch (blockIdx.z = segment): segment z is rows
// r0[z] .. r0[z] + n[z] of the chunk's inputs and outputs, with its own state. The recurrence is
// a chain of dependent steps per token, so segments side by side run in the time of the longest
// instead of the sum. Passed by value (gdn.rs ScanSegments has this layout).
#define GDN_SCAN_SEGS 16
struct ScanSegs {
    float* state[GDN_SCAN_SEGS];
    int r0[GDN_SCAN_SEGS];
    int n[GDN_SCAN_SEGS];
};
#define PF_GDN_SCAN(DK)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) pf_gdn_scan_##DK(                                           \
        const float* qn, const float* kn, const float* conv, const float* braw, const float* araw,                 \
        const float* dt_bias, const float* neg_a, const ScanSegs segs, float* o, int nk, int nv, int dv, int C) {   \
        const size_t r0 = segs.r0[blockIdx.z];                                                                     \
        const size_t kd = (size_t)nk * DK;                                                                         \
        gdn_scan<DK>(qn + r0 * kd, kn + r0 * kd, conv + r0 * C, braw + r0 * nv, araw + r0 * nv, dt_bias, neg_a,    \
                     segs.state[blockIdx.z], o + r0 * nv * dv, segs.n[blockIdx.z], nk, nv, dv, C);                 \
    }
PF_GDN_SCAN(32)
PF_GDN_SCAN(64)
PF_GDN_SCAN(128)

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
