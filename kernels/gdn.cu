// Gated DeltaNet decode step (T = 1), one block per value head, everything fused:
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

extern "C" __global__ void gdn_step(const float* __restrict__ qkv, const float* __restrict__ z,
                                    const float* __restrict__ braw, const float* __restrict__ araw,
                                    float* __restrict__ ring, const float* __restrict__ taps,
                                    const float* __restrict__ dt_bias, const float* __restrict__ neg_a,
                                    const float* __restrict__ norm_w, float* __restrict__ state, float* __restrict__ y,
                                    const int* __restrict__ step, int nk, int nv, int dk, int dv, int KC, float eps) {
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
