// Gated full attention, decode (T = 1). Same math as src/backend/cpu/attention.rs.
//
// attn_prep: one block of hd threads per q head and per kv head. q heads: split the per-head
// interleaved [q | gate] rows, RMSNorm(q_norm), partial NeoX RoPE; kv heads: RMSNorm(k_norm),
// RoPE, append k and v to the cache at the current position (read from the device step buffer).
// RoPE angles in f64 like the CPU (pos * inv_freq can be ~2.6e5 rad at long context).
extern "C" __global__ void attn_prep(const float* __restrict__ qg, const float* __restrict__ kraw,
                                     const float* __restrict__ vraw, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
                                     float* __restrict__ qout, float* __restrict__ gate, float* __restrict__ kcache,
                                     float* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv, int hd,
                                     int half_rot, float eps) {
    extern __shared__ float sm[];
    float* xs = sm;         // hd
    float* red = sm + hd;   // 33
    const int h = blockIdx.x, j = threadIdx.x, pos = step[1];
    const bool is_q = h < nh;
    const int kvh = h - nh;
    float v = is_q ? qg[(size_t)h * 2 * hd + j] : kraw[(size_t)kvh * hd + j];
    float ss = block_sum(v * v, red);
    float inv = inv_rms_from(ss, hd, eps);
    xs[j] = v * inv * (is_q ? q_norm[j] : k_norm[j]);
    __syncthreads();
    float out = xs[j];
    if (j < 2 * half_rot) {
        int i = j < half_rot ? j : j - half_rot;
        double ang = (double)pos * inv_freq[i];
        float c = (float)cos(ang), s = (float)sin(ang);
        float a = xs[i], b = xs[i + half_rot];
        out = j < half_rot ? a * c - b * s : b * c + a * s;
    }
    if (is_q) {
        qout[(size_t)h * hd + j] = out;
        gate[(size_t)h * hd + j] = qg[(size_t)h * 2 * hd + hd + j];
    } else {
        size_t kv_dim = (size_t)nkv * hd;
        kcache[(size_t)pos * kv_dim + kvh * hd + j] = out;
        vcache[(size_t)pos * kv_dim + kvh * hd + j] = vraw[(size_t)kvh * hd + j];
    }
}

// Split-KV decode attention: grid (kv heads, splits); one warp per q head of the GQA group (so
// the group's warps read each K/V row once from DRAM and share it through L1). Each split walks
// its slice of positions 0..=pos with an online softmax and writes (max, sum, partial output).
// Lane owns dims lane, lane + 32, ... (coalesced rows).
template <int HD>
__device__ void attn_split(const float* __restrict__ q, const float* __restrict__ kcache,
                           const float* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv,
                           int splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int P = HD / 32;
    const int kvh = blockIdx.x, sp = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = nh / nkv, h = kvh * group + warp;
    if (warp >= group) return;
    const int len = step[1] + 1;
    const int chunk = (len + splits - 1) / splits;
    const int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    const size_t kv_dim = (size_t)nkv * HD;
    float qr[P], o[P];
#pragma unroll
    for (int t = 0; t < P; ++t) { qr[t] = q[(size_t)h * HD + t * 32 + lane]; o[t] = 0.f; }
    float m = NEG_INF, l = 0.f;
    // Four positions per iteration: their K and V rows are loaded together (one DRAM round trip
    // per 4 positions instead of per position), then one online-softmax update.
    constexpr int U = 4;
    int p = p0;
    for (; p + U <= p1; p += U) {
        float kr[U][P], vr[U][P], sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float* kp = kcache + (size_t)(p + u) * kv_dim + kvh * HD;
            const float* vp = vcache + (size_t)(p + u) * kv_dim + kvh * HD;
#pragma unroll
            for (int t = 0; t < P; ++t) { kr[u][t] = kp[t * 32 + lane]; vr[u][t] = vp[t * 32 + lane]; }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float d = 0.f;
#pragma unroll
            for (int t = 0; t < P; ++t) d += qr[t] * kr[u][t];
            sc[u] = d;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) sc[u] = warp_sum(sc[u]) * scale;
        float mn = fmaxf(fmaxf(m, fmaxf(sc[0], sc[1])), fmaxf(sc[2], sc[3]));
        float corr = expf(m - mn);
        float e[U];
#pragma unroll
        for (int u = 0; u < U; ++u) e[u] = expf(sc[u] - mn);
        l = l * corr + ((e[0] + e[1]) + (e[2] + e[3]));
#pragma unroll
        for (int t = 0; t < P; ++t)
            o[t] = o[t] * corr + ((e[0] * vr[0][t] + e[1] * vr[1][t]) + (e[2] * vr[2][t] + e[3] * vr[3][t]));
        m = mn;
    }
    for (; p < p1; ++p) {
        const float* kr = kcache + (size_t)p * kv_dim + kvh * HD;
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < P; ++t) d += qr[t] * kr[t * 32 + lane];
        float sc = warp_sum(d) * scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), e = expf(sc - mn);
        l = l * corr + e;
        const float* vr = vcache + (size_t)p * kv_dim + kvh * HD;
#pragma unroll
        for (int t = 0; t < P; ++t) o[t] = o[t] * corr + e * vr[t * 32 + lane];
        m = mn;
    }
    size_t base = (size_t)h * splits + sp;
#pragma unroll
    for (int t = 0; t < P; ++t) part_o[base * HD + t * 32 + lane] = o[t];
    if (lane == 0) { part_ml[2 * base] = m; part_ml[2 * base + 1] = l; }
}

extern "C" __global__ void attn_split_256(const float* q, const float* kc, const float* vc, const int* step, int nh,
                                          int nkv, int splits, float scale, float* po, float* pml) {
    attn_split<256>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);
}
extern "C" __global__ void attn_split_128(const float* q, const float* kc, const float* vc, const int* step, int nh,
                                          int nkv, int splits, float scale, float* po, float* pml) {
    attn_split<128>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);
}
extern "C" __global__ void attn_split_64(const float* q, const float* kc, const float* vc, const int* step, int nh,
                                         int nkv, int splits, float scale, float* po, float* pml) {
    attn_split<64>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);
}

// Merges the splits of each q head (grid nh, block hd) and applies the sigmoid output gate.
extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        const float* __restrict__ gate, int splits, int hd, float* __restrict__ out) {
    const int h = blockIdx.x, j = threadIdx.x;
    float M = NEG_INF;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part_ml[2 * ((size_t)h * splits + s)]);
    float L = 0.f, acc = 0.f;
    for (int s = 0; s < splits; ++s) {
        size_t b = (size_t)h * splits + s;
        float m = part_ml[2 * b];
        if (m == NEG_INF) continue;  // empty split
        float w = expf(m - M);
        L += part_ml[2 * b + 1] * w;
        acc += part_o[b * hd + j] * w;
    }
    out[(size_t)h * hd + j] = (acc / L) * sigmoid_f(gate[(size_t)h * hd + j]);
}
