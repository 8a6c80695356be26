// Gated full attention, decode (T = 1). Same math as src/backend/cpu/attention.rs.
//
// attn_prep: one block of hd threads per q head and per kv head. q heads: split the per-head
// interleaved [q | gate] rows, RMSNorm(q_norm), partial NeoX RoPE; kv heads: RMSNorm(k_norm),
// RoPE, append k and v to the cache at the current position (read from the device step buffer).
// RoPE angles in f64 like the CPU (pos * inv_freq can be ~2.6e5 rad at long context).
template <typename KV>
__device__ void attn_prep_impl(const float* __restrict__ qg, const float* __restrict__ kraw,
                               const float* __restrict__ vraw, const float* __restrict__ q_norm,
                               const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
                               float* __restrict__ qout, float* __restrict__ gate, KV* __restrict__ kcache,
                               KV* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv, int hd,
                               int half_rot, float eps) {
    extern __shared__ float sm[];
    float* xs = sm;         // hd
    float* red = sm + hd;   // 33
    // Trigger before waiting: attn_split may then start (and prefetch its K/V rows, which only
    // depend on earlier steps) while the q|k|v GEMV before this kernel still runs. The norm
    // weight and the RoPE angle (position and inverse frequencies only) are done before the wait.
    pdl_trigger_early();
    const int h = blockIdx.x, j = threadIdx.x, pos = step[1];
    const bool is_q = h < nh;
    const int kvh = h - nh;
    const float nwj = is_q ? q_norm[j] : k_norm[j];
    float c, sn;
    rope_cos_sin(pos, inv_freq, j, half_rot, c, sn);
    pdl_wait();
    const float v = is_q ? qg[(size_t)h * 2 * hd + j] : kraw[(size_t)kvh * hd + j];
    const float out = head_norm_rope(v, nwj, c, sn, hd, half_rot, eps, xs, red);
    if (is_q) {
        qout[(size_t)h * hd + j] = out;
        gate[(size_t)h * hd + j] = qg[(size_t)h * 2 * hd + hd + j];
    } else {
        size_t kv_dim = (size_t)nkv * hd;
        kv_st(kcache + (size_t)pos * kv_dim + kvh * hd + j, out);
        kv_st(vcache + (size_t)pos * kv_dim + kvh * hd + j, vraw[(size_t)kvh * hd + j]);
    }
}
#define ATTN_PREP_ENTRY(NAME, KV)                                                                                \
    extern "C" __global__ void NAME(const float* qg, const float* kraw, const float* vraw, const float* q_norm,   \
                                    const float* k_norm, const double* inv_freq, float* qout, float* gate,        \
                                    KV* kcache, KV* vcache, const int* step, int nh, int nkv, int hd,             \
                                    int half_rot, float eps) {                                                    \
        attn_prep_impl<KV>(qg, kraw, vraw, q_norm, k_norm, inv_freq, qout, gate, kcache, vcache, step, nh, nkv,  \
                           hd, half_rot, eps);                                                                    \
    }
ATTN_PREP_ENTRY(attn_prep, float)
ATTN_PREP_ENTRY(attn_prep_bf16, u16)

// Split-KV decode attention: grid (kv heads, splits); one warp per q head of the GQA group (so
// the group's warps read each K/V row once from DRAM and share it through L1/L2). Each split walks
// its slice of positions 0..=pos with an online softmax and writes (max, sum, partial output).
// Lane owns HD/32 dims: float4 pieces (dims t*128 + 4*lane + c) for HD >= 128, a float2 for 64.
template <int HD>
__device__ __forceinline__ int attn_dim(int lane, int i) {
    if constexpr (HD % 128 == 0) return (i >> 2) * 128 + lane * 4 + (i & 3);
    else return lane * 2 + i;
}
// `global`: read through the read-only path (__ldg faults on shared memory, so the shared-memory
// stage reads with plain loads). KV is float or u16 (bf16).
template <int HD, typename KV>
__device__ __forceinline__ void attn_ld(const KV* __restrict__ row, int lane, float (&r)[HD / 32], bool global = true) {
    if constexpr (HD % 128 == 0) {
#pragma unroll
        for (int t = 0; t < HD / 128; ++t) {
            float4 v = kv_ld4(row + t * 128 + lane * 4, global);
            r[4 * t] = v.x; r[4 * t + 1] = v.y; r[4 * t + 2] = v.z; r[4 * t + 3] = v.w;
        }
    } else {
        float2 v = kv_ld2(row + lane * 2, global);
        r[0] = v.x; r[1] = v.y;
    }
}

// One position's online-softmax update of a warp's running (m, l, o): the K row's score against
// q, then o <- o * exp(m - m') + exp(s - m') v. Both split kernels use it for single positions.
template <int HD, typename KV>
__device__ __forceinline__ void attn_one(const float (&qr)[HD / 32], const KV* krow, const KV* vrow, int lane,
                                         float scale, float& m, float& l, float (&o)[HD / 32]) {
    constexpr int P = HD / 32;
    float kr[P], vr[P];
    attn_ld<HD>(krow, lane, kr);
    attn_ld<HD>(vrow, lane, vr);
    float d = 0.f;
#pragma unroll
    for (int t = 0; t < P; ++t) d += qr[t] * kr[t];
    const float sc = warp_sum(d) * scale;
    const float mn = fmaxf(m, sc);
    const float corr = expf(m - mn), e = expf(sc - mn);
    l = l * corr + e;
#pragma unroll
    for (int t = 0; t < P; ++t) o[t] = o[t] * corr + e * vr[t];
    m = mn;
}

// A split's partial result: o (this lane's dims) and, from lane 0, (m, l).
template <int HD>
__device__ __forceinline__ void attn_store_partial(const float (&o)[HD / 32], float m, float l, int h, int sp,
                                                   int splits, int lane, float* __restrict__ part_o,
                                                   float* __restrict__ part_ml) {
    const size_t base = (size_t)h * splits + sp;
#pragma unroll
    for (int t = 0; t < HD / 32; ++t) part_o[base * HD + attn_dim<HD>(lane, t)] = o[t];
    if (lane == 0) { part_ml[2 * base] = m; part_ml[2 * base + 1] = l; }
}

// Positions prefetched into L2 ahead of the loop (before the PDL wait: rows of earlier steps
// never change; the row attn_prep is writing now may be prefetched stale-free, L2 is coherent).
#define ATTN_PF 32

template <int HD, typename KV>
__device__ void attn_split(const float* __restrict__ q, const KV* __restrict__ kcache,
                           const KV* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv,
                           int splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int P = HD / 32;
    constexpr int EPL = 128 / (int)sizeof(KV);        // elements per 128-byte line
    constexpr int LPR = HD / EPL > 0 ? HD / EPL : 1;  // 128-byte lines per K or V row
    const int kvh = blockIdx.x, sp = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = nh / nkv, h = kvh * group + warp;
    const int len = step[1] + 1;
    const int chunk = (len + splits - 1) / splits;
    const int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    const size_t kv_dim = (size_t)nkv * HD;
    auto pf = [&](int pa, int pb, int t, int nt) {  // lines of positions [pa, pb) over threads t of nt
        for (int i = t; i < (pb - pa) * 2 * LPR; i += nt) {
            int pp = pa + i / (2 * LPR), rem = i % (2 * LPR);
            const KV* base = rem < LPR ? kcache : vcache;
            prefetch_l2(base + (size_t)pp * kv_dim + kvh * HD + (rem % LPR) * EPL);
        }
    };
    pf(p0, min(p1, p0 + ATTN_PF), threadIdx.x, blockDim.x);
    pdl_wait_trigger();
    if (warp >= group) return;
    float qr[P], o[P];
#pragma unroll
    for (int t = 0; t < P; ++t) { qr[t] = q[(size_t)h * HD + attn_dim<HD>(lane, t)]; o[t] = 0.f; }
    float m = NEG_INF, l = 0.f;
    // Four positions per iteration: their K and V rows are loaded together (one round trip per 4
    // positions), then one online-softmax update; positions ATTN_PF ahead go into L2 meanwhile.
    constexpr int U = 4;
    int p = p0;
    for (; p + U <= p1; p += U) {
        if (p + ATTN_PF < p1) pf(p + ATTN_PF, min(p1, p + ATTN_PF + U), threadIdx.x, group * 32);
        float kr[U][P], vr[U][P], sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            attn_ld<HD, KV>(kcache + (size_t)(p + u) * kv_dim + kvh * HD, lane, kr[u]);
            attn_ld<HD, KV>(vcache + (size_t)(p + u) * kv_dim + kvh * HD, lane, vr[u]);
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
    for (; p < p1; ++p)
        attn_one<HD>(qr, kcache + (size_t)p * kv_dim + kvh * HD, vcache + (size_t)p * kv_dim + kvh * HD, lane, scale,
                     m, l, o);
    attn_store_partial<HD>(o, m, l, h, sp, splits, lane, part_o, part_ml);
}

// Tiled variant (the default): K/V rows of each split stream through a ring of ATTN_NS shared
// memory stages of ATTN_TP positions with cp.async (16-byte copies, no registers held, all the
// stage's rows in flight at once); the rows of earlier steps (every position but the current one)
// are issued before the PDL wait. The current position, written by attn_prep just before, is
// read directly after the wait by the split that owns it. Per tile each warp (q head) computes
// ATTN_TP scores, one online-softmax update and the V accumulation from shared memory.
#define ATTN_TP 16
#define ATTN_NS 3
// The tile's 16 score reductions by recursive halving (16 shuffles instead of 80, one exp per
// lane): the default since the H200 A/B (decode +1% at 4K, +7% at 32K and +21% at 131K with the
// bf16 cache). -DATTN_XRED=0 keeps the per-score butterfly reductions.
#ifndef ATTN_XRED
#define ATTN_XRED 1
#endif
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(unsigned s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// One recursive-halving step over xor distance MSK: the lane keeps values [0, H) or [H, 2H)
// (by its MSK bit) in slots [0, H), each plus the partner's copy (ATTN_XRED).
template <int H, int MSK>
__device__ __forceinline__ void halve_scores(float (&sc)[ATTN_TP], int lane) {
    const bool up = lane & MSK;
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const float send = up ? sc[j] : sc[j + H];
        const float keep = up ? sc[j + H] : sc[j];
        sc[j] = keep + __shfl_xor_sync(0xffffffffu, send, MSK);
    }
}

template <int HD, typename KV>
__device__ void attn_split_tiled(const float* __restrict__ q, const KV* __restrict__ kcache,
                                 const KV* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv,
                                 int splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    extern __shared__ float4 attn_sm4[];
    KV* sm = reinterpret_cast<KV*>(attn_sm4);
    // C4: 16-byte copies per K or V row, EPC: elements per copy; the stage holds KV elements.
    // A bf16 cache gets twice the stages in the same shared memory (ATTN_NS f32 stages' bytes):
    // at long context a split streams ~64 tiles one after the other and the tiles in flight, not
    // the bytes per tile, set its pace.
    constexpr int P = HD / 32, TP = ATTN_TP, NS = ATTN_NS * 4 / (int)sizeof(KV), EPC = 16 / (int)sizeof(KV),
                  C4 = HD / EPC,
                  STAGE = 2 * TP * HD;
    const int kvh = blockIdx.x, sp = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = nh / nkv, h = kvh * group + warp;
    const bool active = warp < group;
    const int pos = step[1], len = pos + 1;
    const int chunk = (len + splits - 1) / splits;
    const int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    const int pe = min(p1, pos);  // tiled part [p0, pe): rows of earlier steps only
    const int ntiles = pe > p0 ? (pe - p0 + TP - 1) / TP : 0;
    const size_t kv_dim = (size_t)nkv * HD;
    auto issue = [&](int t) {
        if (t < ntiles) {
            const int tp0 = p0 + t * TP, nr = min(TP, pe - tp0);
            KV* st = sm + (t % NS) * STAGE;
            for (int i = threadIdx.x; i < 2 * TP * C4; i += blockDim.x) {
                const int isv = i / (TP * C4), rem = i % (TP * C4), r = rem / C4, c = rem % C4;
                if (r < nr) {
                    const KV* g = (isv ? vcache : kcache) + (size_t)(tp0 + r) * kv_dim + kvh * HD + c * EPC;
                    cp_async16(smem_u32(st + isv * TP * HD + r * HD + c * EPC), g);
                }
            }
        }
        cp_commit();  // always (possibly empty), so wait_group counts tiles
    };
#pragma unroll
    for (int t = 0; t < NS - 1; ++t) issue(t);
    pdl_wait_trigger();
    float qr[P], o[P];
#pragma unroll
    for (int t = 0; t < P; ++t) {
        qr[t] = active ? q[(size_t)h * HD + attn_dim<HD>(lane, t)] : 0.f;
        o[t] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int t = 0; t < ntiles; ++t) {
        issue(t + NS - 1);
        cp_wait<NS - 1>();
        __syncthreads();
        if (active) {
            const KV* ks = sm + (t % NS) * STAGE;
            const KV* vs = ks + TP * HD;
            const int nr = min(TP, pe - (p0 + t * TP));
            float sc[TP];
#pragma unroll
            for (int u = 0; u < TP; ++u) {
                float kr[P];
                attn_ld<HD>(ks + u * HD, lane, kr, false);
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < P; ++i) d += qr[i] * kr[i];
                sc[u] = d;
            }
#if ATTN_XRED
            // The TP = 16 scores reduced together by recursive halving: at each xor distance a
            // lane keeps half of its values and adds its partner's copy of them (8 + 4 + 2 + 1 + 1
            // shuffles instead of 16 x 5); lanes 2u and 2u+1 end with score u. Max and sum then
            // run over 16 distinct lanes' values, one exp per lane, and P V fetches each
            // probability from lane 2u.
            static_assert(TP == 16, "ATTN_XRED reduces 16 scores");
            halve_scores<8, 16>(sc, lane);
            halve_scores<4, 8>(sc, lane);
            halve_scores<2, 4>(sc, lane);
            halve_scores<1, 2>(sc, lane);
            sc[0] += __shfl_xor_sync(0xffffffffu, sc[0], 1);
            const int my_u = (lane >> 1) & 15;
            const float su = my_u < nr ? sc[0] * scale : NEG_INF;
            float tmx = su;
#pragma unroll
            for (int msk = 2; msk <= 16; msk <<= 1) tmx = fmaxf(tmx, __shfl_xor_sync(0xffffffffu, tmx, msk));
            const float mx = fmaxf(m, tmx);
            const float corr = expf(m - mx);
            const float eu = expf(su - mx);
            float es = eu;
#pragma unroll
            for (int msk = 2; msk <= 16; msk <<= 1) es += __shfl_xor_sync(0xffffffffu, es, msk);
#pragma unroll
            for (int u = 0; u < TP; ++u) sc[u] = __shfl_sync(0xffffffffu, eu, 2 * u);
#else
#pragma unroll
            for (int u = 0; u < TP; ++u) sc[u] = u < nr ? warp_sum(sc[u]) * scale : NEG_INF;
            float mx = m;
#pragma unroll
            for (int u = 0; u < TP; ++u) mx = fmaxf(mx, sc[u]);
            const float corr = expf(m - mx);
            float es = 0.f;
#pragma unroll
            for (int u = 0; u < TP; ++u) {
                sc[u] = expf(sc[u] - mx);
                es += sc[u];
            }
#endif
            l = l * corr + es;
            float acc[P];
#pragma unroll
            for (int i = 0; i < P; ++i) acc[i] = 0.f;
#pragma unroll
            for (int u = 0; u < TP; ++u) {
                if (u < nr) {  // rows past nr hold stale or uninitialised data (0 * NaN = NaN)
                    float vr[P];
                    attn_ld<HD>(vs + u * HD, lane, vr, false);
#pragma unroll
                    for (int i = 0; i < P; ++i) acc[i] += sc[u] * vr[i];
                }
            }
#pragma unroll
            for (int i = 0; i < P; ++i) o[i] = o[i] * corr + acc[i];
            m = mx;
        }
        __syncthreads();  // the stage is refilled by the next iteration's issue
    }
    if (!active) return;
    if (pos >= p0 && pos < p1)
        attn_one<HD>(qr, kcache + (size_t)pos * kv_dim + kvh * HD, vcache + (size_t)pos * kv_dim + kvh * HD, lane,
                     scale, m, l, o);
    attn_store_partial<HD>(o, m, l, h, sp, splits, lane, part_o, part_ml);
}

#define ATTN_SPLIT_ENTRY(HD, KV, SUFFIX)                                                                          \
    extern "C" __global__ void attn_split_##HD##SUFFIX(const float* q, const KV* kc, const KV* vc,                \
                                                       const int* step, int nh, int nkv, int splits, float scale, \
                                                       float* po, float* pml) {                                   \
        attn_split_tiled<HD, KV>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);                               \
    }                                                                                                             \
    extern "C" __global__ void attn_split_reg_##HD##SUFFIX(const float* q, const KV* kc, const KV* vc,            \
                                                           const int* step, int nh, int nkv, int splits,          \
                                                           float scale, float* po, float* pml) {                  \
        attn_split<HD, KV>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);                                     \
    }
FOR_EACH_ATTN_INSTANCE(ATTN_SPLIT_ENTRY)

// Merges the splits of each q head and applies the sigmoid output gate. Grid (nh, hd / 32),
// 256 threads: lane = one of the block's 32 dims, warp w sums splits w, w + 8, ... (the loads of
// all splits are in flight together instead of one dependent load per split); the 8 warp sums are
// added in a fixed order. Weights exp(m_s - M) and L are computed by the whole block first.
#define ATTN_MAX_SPLITS 256
extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        const float* __restrict__ gate, int splits, int hd, float* __restrict__ out) {
    __shared__ float wsh[ATTN_MAX_SPLITS];
    __shared__ float red[33];
    __shared__ float accs[8][32];
    pdl_wait_trigger();
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    const float* ml = part_ml + 2 * (size_t)h * splits;
    float mx = NEG_INF;
    for (int s = tid; s < splits; s += nt) mx = fmaxf(mx, ml[2 * s]);
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (nt >> 5); ++w) M = fmaxf(M, red[w]);
    float lsum = 0.f;
    for (int s = tid; s < splits; s += nt) {
        float m = ml[2 * s];
        float w = m == NEG_INF ? 0.f : expf(m - M);  // empty split
        wsh[s] = w;
        lsum += w * ml[2 * s + 1];
    }
    const float L = block_sum(lsum, red);  // its barriers also publish wsh
    const int j = blockIdx.y * 32 + lane;
    const float* po = part_o + (size_t)h * splits * hd + j;
    float acc = 0.f;
#pragma unroll 8
    for (int s = warp; s < splits; s += 8) acc += wsh[s] * po[(size_t)s * hd];
    accs[warp][lane] = acc;
    __syncthreads();
    if (warp == 0) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) a += accs[w][lane];
        out[(size_t)h * hd + j] = (a / L) * sigmoid_f(gate[(size_t)h * hd + j]);
    }
}
