// Gated full attention (q/k RMSNorm, partial NeoX RoPE, KV cache append, causal softmax
// attention, sigmoid output gate). Same math as src/backend/cpu/attention.rs.
//   decode (T = 1):     attn_prep, attn_prep_bf16, attn_split_{64,128,256}, attn_split_{64,128,256}_bf16,
//                       attn_combine
//   batched decode:     attn_prep_batch[_bf16], attn_split_batch_{64,128,256}[_bf16], attn_combine_batch
//   prefill (T tokens): pf_attn_prep, pf_attn_prep_bf16, pf_attn_{64,128,256}, pf_attn_{64,128,256}_bf16,
//                       pf_attn_tc_{64,128,256}[_bf16], pf_attn_wg_{64,128,256} (bf16 cache)
// The `_bf16` entry points read and write a bf16 KV cache instead of an f32 one.

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- KV cache elements: f32, or bf16 (u16) for sequences made with the bf16 KV cache
// (CudaBackend::set_kv_bf16). The attention kernels are templates over the element type; these
// load 4 (or 2) consecutive elements as floats and store one, rounding to nearest even exactly as
// the CPU reference does when its KV cache is bf16.
__device__ __forceinline__ float4 kv_ld4(const float* p, bool global) {
    return global ? __ldg(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 kv_ld4(const u16* p, bool global) {
    const uint2 v = global ? __ldg(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float2 kv_ld2(const float* p, bool global) {
    return global ? __ldg(reinterpret_cast<const float2*>(p)) : *reinterpret_cast<const float2*>(p);
}
__device__ __forceinline__ float2 kv_ld2(const u16* p, bool global) {
    const u32 v = global ? __ldg(reinterpret_cast<const unsigned int*>(p)) : *reinterpret_cast<const u32*>(p);
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ void kv_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_st(u16* p, float v) { *p = (u16)(pack_bf16(v, 0.f) & 0xffffu); }
// Two adjacent outputs of the prefill attention (idx even) into out, or, where its out-projection
// runs on cuBLAS (`staged` set), only as that GEMM's bf16 operand (pf_to_bf16's rounding).
__device__ __forceinline__ void attn_out2(float* __restrict__ out, u32* __restrict__ staged, size_t idx, float v0,
                                          float v1) {
    if (staged) {
        staged[idx / 2] = pack_bf16(v0, v1);
    } else {
        out[idx] = v0;
        out[idx + 1] = v1;
    }
}
// Every attention entry point exists for each head dim and cache element; the `_bf16` suffix is
// the one the host appends for bf16-KV sequences (kernels::kv_suffix). M(HD, KV, SUFFIX).
#define FOR_EACH_ATTN_INSTANCE(M) \
    M(64, float, ) M(128, float, ) M(256, float, ) M(64, u16, _bf16) M(128, u16, _bf16) M(256, u16, _bf16)

// Partial NeoX RoPE angle of element j of a head (the first 2*half_rot elements rotate), in f64
// like the CPU (pos * inv_freq can be ~2.6e5 rad at long context). c = 1, sn = 0 outside.
__device__ __forceinline__ void rope_cos_sin(int pos, const double* __restrict__ inv_freq, int j, int half_rot,
                                             float& c, float& sn) {
    c = 1.f;
    sn = 0.f;
    if (j < 2 * half_rot) {
        const int i = j < half_rot ? j : j - half_rot;
        const double ang = (double)pos * inv_freq[i];
        c = (float)cos(ang);
        sn = (float)sin(ang);
    }
}

// One attention head row over a block of hd threads (thread j owns element j, value v): RMSNorm
// with gain nwj, then the partial NeoX rotation with this thread's (c, sn) from rope_cos_sin.
// xs: hd floats, red: 33 floats of shared memory. Returns element j of the result.
__device__ float head_norm_rope(float v, float nwj, float c, float sn, int hd, int half_rot, float eps, float* xs,
                                float* red) {
    const int j = threadIdx.x;
    const float ss = block_sum(v * v, red);
    const float inv = inv_rms_from(ss, hd, eps);
    xs[j] = v * inv * nwj;
    __syncthreads();
    float out = xs[j];
    if (j < 2 * half_rot) {
        const int i = j < half_rot ? j : j - half_rot;
        const float a = xs[i], b = xs[i + half_rot];
        out = j < half_rot ? a * c - b * sn : b * c + a * sn;
    }
    return out;
}

// ================================ decode (T = 1) ================================
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
    pdl_trigger();
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
// Batched decode: blockIdx.y = row b (one token of sequence b): its projections at row b, its
// caches from the per-row pointer tables, its [token, position] at steps[2b].
#define ATTN_PREP_BATCH_ENTRY(NAME, KV)                                                                          \
    extern "C" __global__ void NAME(const float* qg, const float* kraw, const float* vraw, const float* q_norm,   \
                                    const float* k_norm, const double* inv_freq, float* qout, float* gate,        \
                                    KV* const* ktab, KV* const* vtab, const int* steps, int nh, int nkv, int hd,  \
                                    int half_rot, float eps) {                                                    \
        const size_t b = blockIdx.y, q = (size_t)nh * hd, kv = (size_t)nkv * hd;                                  \
        attn_prep_impl<KV>(qg + b * 2 * q, kraw + b * kv, vraw + b * kv, q_norm, k_norm, inv_freq, qout + b * q,  \
                           gate + b * q, ktab[b], vtab[b], steps + 2 * b, nh, nkv, hd, half_rot, eps);            \
    }
ATTN_PREP_BATCH_ENTRY(attn_prep_batch, float)
ATTN_PREP_BATCH_ENTRY(attn_prep_batch_bf16, u16)

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
// q, then o <- o * exp(m - m') + exp(s - m') v. attn_split uses it for the current position.
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

// attn_split: the K/V rows of each split stream through a ring of ATTN_NS shared-memory stages
// of ATTN_TP positions with cp.async (16-byte copies, no registers held, all the stage's rows in
// flight at once); the rows of earlier steps (every position but the current one) are issued
// before the PDL wait. The current position, written by attn_prep just before, is read directly
// after the wait by the split that owns it. Per tile each warp (q head) computes ATTN_TP scores,
// one online-softmax update and the V accumulation from shared memory.
#define ATTN_TP 16
#define ATTN_NS 3

template <int HD, typename KV>
__device__ void attn_split(const float* __restrict__ q, const KV* __restrict__ kcache,
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
            // The TP = 16 scores reduced together by recursive halving (warp_sum_scatter: 8 + 4
            // + 2 + 1 + 1 shuffles instead of 16 x 5); lanes 2u and 2u+1 end with score u (the
            // base it returns, computed here from the lane). Max and sum then run over 16
            // distinct lanes' values, one exp per lane, and P V fetches each probability from
            // lane 2u.
            static_assert(TP == 16, "the recursive halving reduces 16 scores");
            warp_sum_scatter<TP>(sc);
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
        attn_split<HD, KV>(q, kc, vc, step, nh, nkv, splits, scale, po, pml);                                     \
    }
FOR_EACH_ATTN_INSTANCE(ATTN_SPLIT_ENTRY)
// Batched decode: blockIdx.z = row b, over sequence b's cache up to its own position; partials
// at row b of [B][nh][splits].
#define ATTN_SPLIT_BATCH_ENTRY(HD, KV, SUFFIX)                                                                    \
    extern "C" __global__ void attn_split_batch_##HD##SUFFIX(const float* q, KV* const* ktab, KV* const* vtab,    \
                                                             const int* steps, int nh, int nkv, int splits,       \
                                                             float scale, float* po, float* pml) {                \
        const size_t b = blockIdx.z, rows = (size_t)nh * splits;                                                  \
        attn_split<HD, KV>(q + b * nh * HD, ktab[b], vtab[b], steps + 2 * b, nh, nkv, splits, scale,              \
                           po + b * rows * HD, pml + b * rows * 2);                                               \
    }
FOR_EACH_ATTN_INSTANCE(ATTN_SPLIT_BATCH_ENTRY)

// Batched decode on the tensor cores (bf16 KV cache): the q heads of a KV head (group <= 8) are
// the rows of one m16 tile (rows past the group zero), the split's keys stream through ATTN_TC_NS
// stages of ATTN_TC_TK keys (K and V; rows padded by 8 elements, as PFA_LD pads the prefill's
// tiles, so ldmatrix reads are conflict-free; rows past the split's last key zero-filled: 0 * a
// stale NaN would poison P V). Four warps: warp w takes the 16 keys
// 16 (w & 1) .. of each tile (S = Q K^T over the whole head, 32 mma) and the dims (w >> 1) * HD/2
// .. of the output (P V, HD/16 mma), each key half keeping its own online softmax (the two dim
// halves of a key half compute the same S, so the same m and l); the halves merge at the end.
// Q is scaled by scale * log2(e) and rounded to bf16 as the prefill's tensor-core kernel does;
// P is bf16. The current position (written by attn_prep_batch just before) is in the last tile of
// the last split, loaded after the PDL wait; the earlier tiles load before it.
#define ATTN_TC_TK 32
#define ATTN_TC_NS 3
template <int HD>
__device__ void attn_split_tc(const float* __restrict__ q, const u16* __restrict__ kcache,
                              const u16* __restrict__ vcache, const int* __restrict__ step, int nh, int nkv,
                              int splits, float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    constexpr int LD = HD + 8, TK = ATTN_TC_TK, NS = ATTN_TC_NS, C8 = HD / 8, HALF = HD / 2;
    constexpr int NTH = HALF / 8;  // n8 tiles of a dim half
    extern __shared__ __align__(16) u16 atc_sm[];
    u16* Qs = atc_sm;            // 16 x LD
    u16* KV0 = Qs + 16 * LD;     // NS x [K: TK x LD | V: TK x LD]
    const int kvh = blockIdx.x, sp = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kh = warp & 1, dh = warp >> 1, g = lane >> 2, t4 = lane & 3;
    const int group = nh / nkv;
    const int pos = step[1], len = pos + 1;
    const int chunk = (len + splits - 1) / splits;
    const int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    const int ntiles = p1 > p0 ? (p1 - p0 + TK - 1) / TK : 0;
    const size_t kv_dim = (size_t)nkv * HD;
    // The tile holding the current position (the split's last one), or -1.
    const int pos_tile = pos >= p0 && pos < p1 ? ntiles - 1 : -1;
    auto copy_tile = [&](int t) {
        const int tp0 = p0 + t * TK, nr = min(TK, p1 - tp0);
        u16* st = KV0 + (t % NS) * 2 * TK * LD;
        for (int i = tid; i < 2 * TK * C8; i += blockDim.x) {
            const int isv = i / (TK * C8), rem = i % (TK * C8), r = rem / C8, c = rem % C8;
            const u16* src = (isv ? vcache : kcache) + (size_t)(tp0 + min(r, nr - 1)) * kv_dim + kvh * HD + c * 8;
            cp_async16z(smem_u32(st + isv * TK * LD + r * LD + c * 8), src, r < nr);
        }
    };
    // One commit group per tile (empty past the last, or for the current position's tile before
    // the wait), so the waits below count tiles.
#pragma unroll
    for (int t = 0; t < NS - 1; ++t) {
        if (t < ntiles && t != pos_tile) copy_tile(t);
        cp_commit();
    }
    pdl_wait_trigger();
    if (pos_tile >= 0 && pos_tile < NS - 1) {
        copy_tile(pos_tile);
        cp_commit();
    }
    const float qscale = scale * 1.4426950408889634f;
    for (int i = tid; i < 16 * (HD / 4); i += blockDim.x) {
        const int r = i / (HD / 4), f = i % (HD / 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < group) v = reinterpret_cast<const float4*>(q + (size_t)(kvh * group + r) * HD)[f];
        *reinterpret_cast<uint2*>(Qs + r * LD + f * 4) =
            make_uint2(pack_bf16(v.x * qscale, v.y * qscale), pack_bf16(v.z * qscale, v.w * qscale));
    }
    const u32 q_addr = smem_u32(Qs) + ((lane & 15) * LD + ((lane >> 4) << 3)) * 2;
    const u32 k_off = (((lane & 7) + ((lane >> 4) << 3)) * LD + (((lane >> 3) & 1) << 3)) * 2;
    const u32 v_off = (((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + ((lane >> 4) << 3)) * 2;
    float o[NTH][4];
#pragma unroll
    for (int i = 0; i < NTH; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m = NEG_INF, l = 0.f;  // row g (rows g + 8 are padding)
    for (int t = 0; t < ntiles; ++t) {
        if (t + NS - 1 < ntiles) copy_tile(t + NS - 1);  // after the wait: the current position too
        cp_commit();
        if (t == ntiles - 1) cp_wait<0>();
        else cp_wait<NS - 1>();
        __syncthreads();
        const u32 ks = smem_u32(KV0 + (t % NS) * 2 * TK * LD), vs = ks + TK * LD * 2;
        const int nr = min(TK, p1 - (p0 + t * TK));
        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[4], b0, b1, b2, b3;
            ldsm_x4(q_addr + kk * 32, a[0], a[1], a[2], a[3]);
            ldsm_x4(ks + k_off + (kh * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
            mma_bf16(s[0], a, b0, b1);
            mma_bf16(s[1], a, b2, b3);
        }
        // Row g's online softmax over this warp's 16 keys (keys past nr masked).
        float mt = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (kh * 16 + nt * 8 + 2 * t4 + e >= nr) s[nt][e] = NEG_INF;
                mt = fmaxf(mt, s[nt][e]);
            }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float mn = fmaxf(m, mt), base = mn == NEG_INF ? 0.f : mn, corr = exp2f(m - base);
        m = mn;
        l *= corr;
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt) {
            o[nt][0] *= corr;
            o[nt][1] *= corr;
        }
        u32 pa[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float p0v = exp2f(s[nt][0] - base), p1v = exp2f(s[nt][1] - base);
            l += p0v + p1v;
            pa[2 * nt] = pack_bf16(p0v, p1v);
            pa[2 * nt + 1] = 0u;  // rows g + 8: padding
        }
#pragma unroll
        for (int dp = 0; dp < NTH / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(vs + v_off + (kh * 16 * LD + dh * HALF + dp * 16) * 2, b0, b1, b2, b3);
            mma_bf16(o[2 * dp], pa, b0, b1);
            mma_bf16(o[2 * dp + 1], pa, b2, b3);
        }
        __syncthreads();  // the stage is refilled by a later iteration's copy
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // Merge the key halves: warps of key half 1 leave (m, l, o rows g) in shared memory (the
    // first stage, free now), warps of key half 0 merge and store the split's partials.
    float* mo = reinterpret_cast<float*>(KV0);  // [2 dim halves][8 rows][HALF] then [8][2] (m, l)
    float* mml = mo + 2 * 8 * HALF;
    if (kh == 1 && g < group) {
#pragma unroll
        for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) mo[(dh * 8 + g) * HALF + nt * 8 + 2 * t4 + e] = o[nt][e];
        if (dh == 0 && t4 == 0) { mml[2 * g] = m; mml[2 * g + 1] = l; }
    }
    __syncthreads();
    if (kh == 1 || g >= group) return;
    const float m1 = mml[2 * g], l1 = mml[2 * g + 1];
    const float M = fmaxf(m, m1), bM = M == NEG_INF ? 0.f : M;
    const float w0 = exp2f(m - bM), w1 = exp2f(m1 - bM);
    const int h = kvh * group + g;
    const size_t row = (size_t)h * splits + sp;
#pragma unroll
    for (int nt = 0; nt < NTH; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int d = nt * 8 + 2 * t4 + e;
            part_o[row * HD + dh * HALF + d] = o[nt][e] * w0 + mo[(dh * 8 + g) * HALF + d] * w1;
        }
    if (dh == 0 && t4 == 0) {
        // exp2 units to natural ones: the combine weighs the splits by exp(m - M).
        part_ml[2 * row] = M == NEG_INF ? NEG_INF : M * 0.6931471805599453f;
        part_ml[2 * row + 1] = l * w0 + l1 * w1;
    }
}
#define ATTN_SPLIT_TC_BATCH(HD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attn_split_tc_batch_##HD(                                  \
        const float* q, u16* const* ktab, u16* const* vtab, const int* steps, int nh, int nkv, int splits,       \
        float scale, float* po, float* pml) {                                                                      \
        const size_t b = blockIdx.z, rows = (size_t)nh * splits;                                                   \
        attn_split_tc<HD>(q + b * nh * HD, ktab[b], vtab[b], steps + 2 * b, nh, nkv, splits, scale,               \
                          po + b * rows * HD, pml + b * rows * 2);                                                 \
    }
ATTN_SPLIT_TC_BATCH(64)
ATTN_SPLIT_TC_BATCH(128)
ATTN_SPLIT_TC_BATCH(256)

#define ATTN_MAX_SPLITS 256
// The merge weights of q head h's splits, exp(m_s - M) into wsh, and their sum L (returned),
// computed by the whole block; its last barrier publishes wsh.
__device__ __forceinline__ float attn_combine_weights(const float* __restrict__ ml, int splits, float* wsh, float* red) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
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
    return block_sum(lsum, red);
}

// Merges the splits of each q head and applies the sigmoid output gate. Grid (nh, hd / 32),
// 256 threads: lane = one of the block's 32 dims, warp w sums splits w, w + 8, ... (the loads of
// all splits are in flight together instead of one dependent load per split); the 8 warp sums are
// added in a fixed order. Weights exp(m_s - M) and L are computed by the whole block first.
__device__ __forceinline__ void attn_combine_impl(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                  const float* __restrict__ gate, int splits, int hd,
                                                  float* __restrict__ out) {
    __shared__ float wsh[ATTN_MAX_SPLITS];
    __shared__ float red[33];
    __shared__ float accs[8][32];
    pdl_wait_trigger();
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float L = attn_combine_weights(part_ml + 2 * (size_t)h * splits, splits, wsh, red);
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

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        const float* __restrict__ gate, int splits, int hd, float* __restrict__ out) {
    attn_combine_impl(part_o, part_ml, gate, splits, hd, out);
}

// Batched decode: grid (nh, rows), 256 threads, one block per (q head, row) for all hd columns
// (attn_combine's shape, a block per 32 columns, made 8 x nh x rows small blocks, each paying
// the weights' two barriers). Thread j takes columns j, j + 256, ... and sums each of them
// exactly as attn_combine does (splits w, w + 8, ... per w, then w = 0..7 in order), so the
// output is bit-identical to it.
extern "C" __global__ void __launch_bounds__(256) attn_combine_batch(const float* __restrict__ part_o,
                                              const float* __restrict__ part_ml,
                                              const float* __restrict__ gate, int splits, int hd,
                                              float* __restrict__ out) {
    __shared__ float wsh[ATTN_MAX_SPLITS];
    __shared__ float red[33];
    pdl_wait_trigger();
    const size_t b = blockIdx.y, nh = gridDim.x, h = blockIdx.x;
    const size_t rows = nh * splits, head = (b * nh + h) * hd;
    const float L = attn_combine_weights(part_ml + (b * rows + h * splits) * 2, splits, wsh, red);
    const float* po = part_o + (b * rows + h * splits) * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            float acc = 0.f;
            for (int s = w; s < splits; s += 8) acc += wsh[s] * po[(size_t)s * hd + j];
            a += acc;
        }
        out[head + j] = (a / L) * sigmoid_f(gate[head + j]);
    }
}

// ============================== prefill (T tokens) ==============================
// Activations are token-major f32 [T][dim] (docs/cuda-prefill.md, src/backend/cuda/prefill.rs).

// The sequences of a prefill chunk as its attention launches see them, passed by value
// (attention.rs `segs_arg`): segment z's KV caches of the layer, its first row of the chunk, its
// rows and the position of its first row. One launch takes up to PF_ATTN_SEGS segments, so the
// short prompts of a burst fill the GPU together instead of one small grid each.
#define PF_ATTN_SEGS 16
struct AttnSegs {
    void* kc[PF_ATTN_SEGS];
    void* vc[PF_ATTN_SEGS];
    int r0[PF_ATTN_SEGS];
    int n[PF_ATTN_SEGS];
    int pos0[PF_ATTN_SEGS];
};
// The segment holding chunk row r (the launch's segments are back to back in row order).
__device__ __forceinline__ int attn_seg_of_row(const AttnSegs& s, int nseg, int r) {
    int z = 0;
    while (z + 1 < nseg && r >= s.r0[z + 1]) ++z;
    return z;
}
// The segment of query block x when each segment z takes ceil(n[z] / qt) consecutive blocks;
// x becomes the block's index within its segment.
__device__ __forceinline__ int attn_seg_of_block(const AttnSegs& s, int nseg, int qt, int& x) {
    int z = 0;
    for (; z + 1 < nseg; ++z) {
        const int tiles = (s.n[z] + qt - 1) / qt;
        if (x < tiles) break;
        x -= tiles;
    }
    return z;
}

// q/k RMSNorm + partial NeoX RoPE + KV append of chunk row t at position pos: block hd threads.
// KV: the cache element (float, or u16 = bf16 for bf16-KV sequences; kv_st above). With Q16 (for
// pf_attn_wg_q16, which reads the gate from qg itself) q goes out as the wgmma core's operand,
// bf16(q * qscale) in qout's memory, and the gate is not copied.
template <typename KV, bool Q16 = false>
__device__ void pf_attn_prep_impl(const float* __restrict__ qg, const float* __restrict__ kraw,
                                  const float* __restrict__ vraw, const float* __restrict__ q_norm,
                                  const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
                                  float* __restrict__ qout, float* __restrict__ gate, KV* __restrict__ kcache,
                                  KV* __restrict__ vcache, int t, int pos, int nh, int nkv, int hd, int half_rot,
                                  float eps, float qscale = 0.f) {
    extern __shared__ float sm[];
    float* xs = sm;
    float* red = sm + hd;
    const int h = blockIdx.y, j = threadIdx.x;
    const bool is_q = h < nh;
    const int kvh = h - nh;
    const size_t kv_dim = (size_t)nkv * hd;
    const float* qrow = qg + (size_t)t * 2 * nh * hd;
    const float v = is_q ? qrow[(size_t)h * 2 * hd + j] : kraw[(size_t)t * kv_dim + kvh * hd + j];
    float c, sn;
    rope_cos_sin(pos, inv_freq, j, half_rot, c, sn);
    const float out = head_norm_rope(v, is_q ? q_norm[j] : k_norm[j], c, sn, hd, half_rot, eps, xs, red);
    if (is_q && Q16) {
        reinterpret_cast<u16*>(qout)[((size_t)t * nh + h) * hd + j] = (u16)(pack_bf16(out * qscale, 0.f) & 0xffffu);
    } else if (is_q) {
        qout[((size_t)t * nh + h) * hd + j] = out;
        gate[((size_t)t * nh + h) * hd + j] = qrow[(size_t)h * 2 * hd + hd + j];
    } else {
        kv_st(kcache + (size_t)pos * kv_dim + kvh * hd + j, out);
        kv_st(vcache + (size_t)pos * kv_dim + kvh * hd + j, vraw[(size_t)t * kv_dim + kvh * hd + j]);
    }
}
// The rows of nseg segments (from segs.r0[0]; the pointers are the chunk's first rows): grid
// (their rows, nh + nkv), block hd.
#define PF_ATTN_PREP(NAME, KV)                                                                                   \
    extern "C" __global__ void NAME(const AttnSegs segs, int nseg, const float* qg, const float* kraw,          \
                                    const float* vraw, const float* q_norm, const float* k_norm,                 \
                                    const double* inv_freq, float* qout, float* gate, int nh, int nkv, int hd,   \
                                    int half_rot, float eps) {                                                   \
        const int r = segs.r0[0] + blockIdx.x, z = attn_seg_of_row(segs, nseg, r);                               \
        pf_attn_prep_impl<KV>(qg, kraw, vraw, q_norm, k_norm, inv_freq, qout, gate,                              \
                              static_cast<KV*>(segs.kc[z]), static_cast<KV*>(segs.vc[z]), r,                     \
                              segs.pos0[z] + r - segs.r0[z], nh, nkv, hd, half_rot, eps);                        \
    }
PF_ATTN_PREP(pf_attn_prep, float)
PF_ATTN_PREP(pf_attn_prep_bf16, u16)
// The same for pf_attn_wg_q16 (bf16 cache): q as bf16(q * qscale) into q16, no gate copy.
extern "C" __global__ void pf_attn_prep_q16(const AttnSegs segs, int nseg, const float* qg, const float* kraw,
                                            const float* vraw, const float* q_norm, const float* k_norm,
                                            const double* inv_freq, u16* q16, int nh, int nkv, int hd, int half_rot,
                                            float eps, float qscale) {
    const int r = segs.r0[0] + blockIdx.x, z = attn_seg_of_row(segs, nseg, r);
    pf_attn_prep_impl<u16, true>(qg, kraw, vraw, q_norm, k_norm, inv_freq, reinterpret_cast<float*>(q16), nullptr,
                                 static_cast<u16*>(segs.kc[z]), static_cast<u16*>(segs.vc[z]), r,
                                 segs.pos0[z] + r - segs.r0[z], nh, nkv, hd, half_rot, eps, qscale);
}

// Causal attention over the cache (positions 0..=pos0+t), flash style: block = (64 / group query
// tokens) x (the group's q heads) = 64 rows of one kv head; 8 warps, 8 rows each. K/V tiles of 32
// positions in shared memory are shared by all 64 rows; lane = key for the scores (one max and one
// sum reduction per tile per row), lane = dims for the output. Online softmax, then the sigmoid
// output gate. grid (ceil(T / (64/group)), nkv), block 256,
// dynamic smem (64*HD + 32*(HD+4) + 32*HD) floats.
template <int HD, typename KV>
__device__ void pf_attn(const float* __restrict__ q, const float* __restrict__ gate, const KV* __restrict__ kc,
                        const KV* __restrict__ vc, int T, int pos0, int nh, int nkv, float scale,
                        float* __restrict__ out, int tile) {
    constexpr int P = HD / 32, KS = HD + 4;
    extern __shared__ __align__(16) float pfa_sm[];
    float* Qs = pfa_sm;               // [64][HD]
    float* Ks = Qs + 64 * HD;     // [32][HD+4]
    float* Vs = Ks + 32 * KS;     // [32][HD]
    const int group = nh / nkv, qt = 64 / group;
    const int kvh = blockIdx.y, tok0 = tile * qt;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t kv_dim = (size_t)nkv * HD;
    for (int idx = threadIdx.x; idx < 64 * (HD / 4); idx += blockDim.x) {
        int r = idx / (HD / 4), f = idx % (HD / 4);
        int t = tok0 + r / group, h = kvh * group + r % group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < T) v = reinterpret_cast<const float4*>(q + ((size_t)t * nh + h) * HD)[f];
        reinterpret_cast<float4*>(Qs + r * HD)[f] = v;
    }
    float m[8], l[8], o[8][P];
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        m[rr] = NEG_INF;
        l[rr] = 0.f;
#pragma unroll
        for (int i = 0; i < P; ++i) o[rr][i] = 0.f;
    }
    const int last_t = min(T - 1, tok0 + qt - 1);
    const int nkeys = pos0 + last_t + 1;
    for (int kt = 0; kt < nkeys; kt += 32) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < 32 * (HD / 4); idx += blockDim.x) {
            int kr = idx / (HD / 4), f = idx % (HD / 4);
            int p = kt + kr;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (p < nkeys) {
                kv = kv_ld4(kc + (size_t)p * kv_dim + kvh * HD + 4 * f, false);
                vv = kv_ld4(vc + (size_t)p * kv_dim + kvh * HD + 4 * f, false);
            }
            reinterpret_cast<float4*>(Ks + kr * KS)[f] = kv;
            reinterpret_cast<float4*>(Vs + kr * HD)[f] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) {
            const int r = warp + 8 * rr;
            const int t = tok0 + r / group;
            if (t >= T) continue;
            const int pq = pos0 + t;
            if (kt > pq) continue;
            const float4* qr = reinterpret_cast<const float4*>(Qs + r * HD);
            const float4* kr = reinterpret_cast<const float4*>(Ks + lane * KS);
            float d0 = 0.f, d1 = 0.f;
#pragma unroll 8
            for (int f = 0; f < HD / 4; ++f) {
                float4 a = qr[f], bb = kr[f];
                d0 = fmaf(a.x, bb.x, d0);
                d1 = fmaf(a.y, bb.y, d1);
                d0 = fmaf(a.z, bb.z, d0);
                d1 = fmaf(a.w, bb.w, d1);
            }
            float sc = (d0 + d1) * scale;
            if (kt + lane > pq) sc = NEG_INF;
            const float mt = warp_max(sc);
            const float mn = fmaxf(m[rr], mt);
            const float corr = expf(m[rr] - mn);
            const float p = expf(sc - mn);
            l[rr] = l[rr] * corr + warp_sum(p);
            m[rr] = mn;
#pragma unroll
            for (int i = 0; i < P; ++i) o[rr][i] *= corr;
            const int jmax = min(32, pq - kt + 1);
            for (int j = 0; j < jmax; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < P; ++i) o[rr][i] = fmaf(pj, Vs[j * HD + i * 32 + lane], o[rr][i]);
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        const int r = warp + 8 * rr;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        if (t >= T) continue;
        const float il = 1.f / l[rr];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            size_t idx = ((size_t)t * nh + h) * HD + i * 32 + lane;
            out[idx] = (o[rr][i] * il) * sigmoid_f(gate[idx]);
        }
    }
}

// nseg segments' query blocks (each segment's in order): grid (their blocks, nkv), block 256.
#define PF_ATTN(HD, KV, SUFFIX)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) pf_attn_##HD##SUFFIX(const AttnSegs segs, int nseg,         \
                                                                           const float* q, const float* gate,     \
                                                                           int nh, int nkv, float scale,          \
                                                                           float* out) {                          \
        int x = blockIdx.x;                                                                                        \
        const int z = attn_seg_of_block(segs, nseg, 64 / (nh / nkv), x);                                          \
        const size_t off = (size_t)segs.r0[z] * nh * HD;                                                           \
        pf_attn<HD, KV>(q + off, gate + off, static_cast<const KV*>(segs.kc[z]), static_cast<const KV*>(segs.vc[z]), \
                        segs.n[z], segs.pos0[z], nh, nkv, scale, out + off, x);                                    \
    }
FOR_EACH_ATTN_INSTANCE(PF_ATTN)

// One online-softmax step (exp2 units) of a warp's 16 query rows over a 64-key tile, s in the
// mma accumulator layout (this thread's rows g: s[nt][0..1], g + 8: s[nt][2..3]; keys 8 nt + 2 t,
// + 1) and already masked, mt this thread's maxima of its two rows' scores. First the rows: their
// running maxima m take the tile's, corr gets the factor the rows' earlier sums l (and O) take,
// base the maxima the tile's exponents subtract. pf_attn_tc and pf_attn_wg share both halves, so
// their results are the same bits.
__device__ __forceinline__ void flash_softmax_rows(float (&mt)[2], float (&m)[2], float (&l)[2], float (&base)[2],
                                                   float (&corr)[2]) {
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        mt[hv] = fmaxf(mt[hv], __shfl_xor_sync(0xffffffffu, mt[hv], 1));
        mt[hv] = fmaxf(mt[hv], __shfl_xor_sync(0xffffffffu, mt[hv], 2));
        const float mn = fmaxf(m[hv], mt[hv]);
        base[hv] = mn == NEG_INF ? 0.f : mn;
        corr[hv] = exp2f(m[hv] - base[hv]);
        m[hv] = mn;
        l[hv] *= corr[hv];
    }
}
// Then the tile's P: exp2(s - base) into the sums l and, rounded to bf16, the A fragments pa
// (k step kk: keys 16 kk .. 16 kk + 15).
__device__ __forceinline__ void flash_softmax_p(const float (&s)[8][4], const float (&base)[2], float (&l)[2],
                                                u32 (&pa)[4][4]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float p0 = exp2f(s[nt][0] - base[0]), p1 = exp2f(s[nt][1] - base[0]);
        const float p2 = exp2f(s[nt][2] - base[1]), p3 = exp2f(s[nt][3] - base[1]);
        l[0] += p0 + p1;
        l[1] += p2 + p3;
        pa[nt >> 1][(nt & 1) * 2] = pack_bf16(p0, p1);
        pa[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
    }
}

// Tensor-core causal attention (bf16 mma.sync, f32 accumulate and softmax), flash style: the f32
// cache's prefill, and the bf16 cache's launches whose keys are split over blocks (a few tokens
// over a long cache: bound by the cache's bytes, where two 64-row blocks per SM keep more of them
// in flight than one 128-row pf_attn_wg block); pf_attn_wg below gives the same bits. Same
// block shape as pf_attn: 64 rows = (64/group query tokens) x (the group's q heads) of one kv
// head, 4 warps of 16 rows. Q is scaled by scale*log2(e) and rounded to bf16 once; per tile of
// 64 keys, K and V go to shared memory in bf16 (copied or rounded, below); S = Q K^T
// and O += P V run on mma (P re-used from the S accumulators as bf16 A fragments), online
// softmax in exp2. Block `tile` takes tokens from tile * (64/group); grid y = nkv, z = splits,
// block 128, dynamic smem 3*64*(HD+8) bf16. With splits > 1 (a few tokens over a long cache, where
// T/(64/group) x nkv blocks would leave most SMs idle), block z takes the z-th run of `kchunk` keys
// (a multiple of 64) and writes unnormalised partials (o, and m in natural-log units with l) as
// attn_combine_batch reads them: rows [T][nh][splits]. The entry point runs the longest query rows
// first (the last tile first): the causal blocks' work grows with their tokens, and the last wave
// of a grid in launch order would otherwise hold only the longest ones.
//
// The bf16 cache's tiles need no rounding, so they are copied straight into shared memory with
// 16-byte cp.async (rows past the last key zero-filled): the next tile's K is in flight while this
// tile's softmax and PV run, its V while the next S runs. The f32 cache's tiles are rounded on the
// way, through registers, one tile at a time. Both give the same bf16 operands.
#define PFA_LD(HD) ((HD) + 8)

template <typename KV>
struct KvIsBf16 {
    static constexpr bool value = false;
};
template <>
struct KvIsBf16<u16> {
    static constexpr bool value = true;
};

// The bf16 cache's rows kt .. kt + 63 of one kv head into a tile of shared memory (row stride LD
// bf16): 16-byte asynchronous copies, rows at or past `nkeys` zero-filled (their source clamped to
// the last key, never read).
template <int HD>
__device__ __forceinline__ void pfa_tile_async(const u16* __restrict__ src, size_t kv_dim, int kt, int nkeys, u16* dst) {
    constexpr int LD = PFA_LD(HD), P = HD / 8;
    for (int idx = threadIdx.x; idx < 64 * P; idx += 128) {
        const int kr = idx / P, c = idx % P;
        cp_async16z(smem_u32(dst + kr * LD + c * 8), src + (size_t)min(kt + kr, nkeys - 1) * kv_dim + c * 8,
                    kt + kr < nkeys);
    }
}

template <int HD, typename KV>
__device__ void pf_attn_tc(const float* __restrict__ q, const float* __restrict__ gate, const KV* __restrict__ kc,
                           const KV* __restrict__ vc, int T, int pos0, int nh, int nkv, float scale,
                           float* __restrict__ out, int kchunk, float* __restrict__ part_o,
                           float* __restrict__ part_ml, int tile, u32* __restrict__ staged) {
    constexpr int LD = PFA_LD(HD), NT = HD / 8, F4 = HD / 4;
    extern __shared__ __align__(16) u16 pfa_tc_sm[];
    u16* Qs = pfa_tc_sm;
    u16* Ks = Qs + 64 * LD;
    u16* Vs = Ks + 64 * LD;
    const int group = nh / nkv, qt = 64 / group;
    const int kvh = blockIdx.y, tok0 = tile * qt;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t kv_dim = (size_t)nkv * HD;
    const float qscale = scale * 1.4426950408889634f;
    for (int idx = tid; idx < 64 * F4; idx += 128) {
        const int r = idx / F4, f = idx % F4;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < T) v = reinterpret_cast<const float4*>(q + ((size_t)t * nh + h) * HD)[f];
        uint2 pk;
        pk.x = pack_bf16(v.x * qscale, v.y * qscale);
        pk.y = pack_bf16(v.z * qscale, v.w * qscale);
        *reinterpret_cast<uint2*>(Qs + r * LD + f * 4) = pk;
    }
    // This lane's two rows (g and g+8 of the warp's 16) and their query positions.
    const int g = lane >> 2;
    int pq[2];
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int t = tok0 + (warp * 16 + g + 8 * hv) / group;
        pq[hv] = t < T ? pos0 + t : -1;
    }
    const int warp_last_t = min(T - 1, tok0 + (warp * 16 + 15) / group);
    const int warp_pq = pos0 + warp_last_t;
    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int last_t = min(T - 1, tok0 + qt - 1);
    const int nkeys = pos0 + last_t + 1;
    const int splits = gridDim.z, k_lo = blockIdx.z * kchunk, k_hi = splits > 1 ? min(nkeys, k_lo + kchunk) : nkeys;
    const u32 q_addr = smem_u32(Qs) + ((warp * 16 + (lane & 15)) * LD + ((lane >> 4) << 3)) * 2;
    const u32 k_addr = smem_u32(Ks) + (((lane & 7) + ((lane >> 4) << 3)) * LD + (((lane >> 3) & 1) << 3)) * 2;
    const u32 v_addr = smem_u32(Vs) + (((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + ((lane >> 4) << 3)) * 2;
    // The f32 cache's tile loads in batches of KB: every load of a batch is issued before the first
    // is used. The rows past the last key are read clamped to it (always valid memory, no branch
    // around the load, which would serialise the batch) and zeroed by a select.
    constexpr int KB = 4, KITER = 64 * F4 / 128;
    static_assert(KITER % KB == 0, "tile load batches");
    auto load_tiles_f32 = [&](int kt) {
#pragma unroll 2
        for (int i0 = 0; i0 < KITER; i0 += KB) {
            float4 kv[KB], vv[KB];
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                const int idx = tid + (i0 + j) * 128, kr = idx / F4, f = idx % F4;
                const size_t off = (size_t)min(kt + kr, nkeys - 1) * kv_dim + kvh * HD + 4 * f;
                kv[j] = kv_ld4(kc + off, false);
                vv[j] = kv_ld4(vc + off, false);
            }
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                const int idx = tid + (i0 + j) * 128, kr = idx / F4, f = idx % F4;
                const bool ok = kt + kr < nkeys;
                const float4 k4 = ok ? kv[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float4 v4 = ok ? vv[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                *reinterpret_cast<uint2*>(Ks + kr * LD + f * 4) =
                    make_uint2(pack_bf16(k4.x, k4.y), pack_bf16(k4.z, k4.w));
                *reinterpret_cast<uint2*>(Vs + kr * LD + f * 4) =
                    make_uint2(pack_bf16(v4.x, v4.y), pack_bf16(v4.z, v4.w));
            }
        }
    };
    constexpr bool ASYNC = KvIsBf16<KV>::value;
    // bf16 cache: commit groups K(k_lo), V(k_lo), then per tile K(next) after the S products and
    // V(next) after PV (empty past the last tile, so every wait below sees the same count).
    auto load_tile = [&](const KV* cache, u16* tile, int kt) {
        if constexpr (ASYNC) {
            if (kt < k_hi) pfa_tile_async<HD>(reinterpret_cast<const u16*>(cache) + kvh * HD, kv_dim, kt, nkeys, tile);
            cp_commit();
        }
    };
    load_tile(kc, Ks, k_lo);
    load_tile(vc, Vs, k_lo);
    for (int kt = k_lo; kt < k_hi; kt += 64) {
        if constexpr (ASYNC) {
            cp_wait<1>();  // K(kt); V(kt) may still be in flight
        } else {
            __syncthreads();  // every warp is done with the previous tile
            load_tiles_f32(kt);
        }
        __syncthreads();
        // A warp whose rows are all before the whole tile skips its products (not the barriers).
        const bool active = kt <= warp_pq;
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        if (active) {
#pragma unroll 4
            for (int ks = 0; ks < HD / 16; ++ks) {
                u32 a[4];
                ldsm_x4(q_addr + ks * 32, a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_addr + (np * 16 * LD + ks * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], a, b0, b1);
                    mma_bf16(s[2 * np + 1], a, b2, b3);
                }
            }
        }
        if constexpr (ASYNC) {
            __syncthreads();  // every warp is done with K(kt)
            load_tile(kc, Ks, kt + 64);
        }
        u32 pa[4][4];
        if (active) {
            // Mask, online softmax (rows g: s[.][0..1], g+8: s[.][2..3]).
            float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt + nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (key > pq[e >> 1]) s[nt][e] = NEG_INF;
                    mt[e >> 1] = fmaxf(mt[e >> 1], s[nt][e]);
                }
            float base[2], corr[2];
            flash_softmax_rows(mt, m, l, base, corr);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                o[nt][0] *= corr[0];
                o[nt][1] *= corr[0];
                o[nt][2] *= corr[1];
                o[nt][3] *= corr[1];
            }
            flash_softmax_p(s, base, l, pa);
        }
        if constexpr (ASYNC) {
            cp_wait<1>();  // V(kt); K(kt + 64) may still be in flight
            __syncthreads();
        }
        if (active) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dp = 0; dp < HD / 16; ++dp) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_addr + (kk * 16 * LD + dp * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(o[2 * dp], pa[kk], b0, b1);
                    mma_bf16(o[2 * dp + 1], pa[kk], b2, b3);
                }
            }
        }
        if constexpr (ASYNC) {
            __syncthreads();  // every warp is done with V(kt)
            load_tile(vc, Vs, kt + 64);
        }
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 1);
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 2);
    }
    if (splits > 1) {
#pragma unroll
        for (int hv = 0; hv < 2; ++hv) {
            const int r = warp * 16 + g + 8 * hv;
            const int t = tok0 + r / group, h = kvh * group + r % group;
            if (t >= T) continue;
            const size_t row = ((size_t)t * nh + h) * splits + blockIdx.z;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) part_o[row * HD + nt * 8 + 2 * (lane & 3) + cc] = o[nt][hv * 2 + cc];
            if ((lane & 3) == 0) {
                // exp2 units to natural ones: the partial weights are exp(m - M) in the combine.
                part_ml[2 * row] = m[hv] == NEG_INF ? NEG_INF : m[hv] * 0.6931471805599453f;
                part_ml[2 * row + 1] = l[hv];
            }
        }
        return;
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int r = warp * 16 + g + 8 * hv;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        if (t >= T) continue;
        const float il = 1.f / l[hv];
        const size_t rb = ((size_t)t * nh + h) * HD;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const size_t idx = rb + nt * 8 + 2 * (lane & 3);
            attn_out2(out, staged, idx, (o[nt][hv * 2] * il) * sigmoid_f(gate[idx]),
                      (o[nt][hv * 2 + 1] * il) * sigmoid_f(gate[idx + 1]));
        }
    }
}

// nseg segments' query blocks, each segment's longest rows first: grid (their blocks, nkv,
// splits), block 128. With splits > 1 the launch holds one segment (the partials' rows are its).
#define PF_ATTN_TC(HD, KV, SUFFIX)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) pf_attn_tc_##HD##SUFFIX(                                    \
        const AttnSegs segs, int nseg, const float* q, const float* gate, int nh, int nkv, float scale, float* out, \
        int kchunk, float* part_o, float* part_ml, u32* staged) {                                                  \
        const int qt = 64 / (nh / nkv);                                                                            \
        int x = blockIdx.x;                                                                                        \
        const int z = attn_seg_of_block(segs, nseg, qt, x);                                                        \
        const size_t off = (size_t)segs.r0[z] * nh * HD;                                                           \
        pf_attn_tc<HD, KV>(q + off, gate + off, static_cast<const KV*>(segs.kc[z]),                                \
                           static_cast<const KV*>(segs.vc[z]), segs.n[z], segs.pos0[z], nh, nkv, scale, out + off, \
                           kchunk, part_o, part_ml, (segs.n[z] + qt - 1) / qt - 1 - x, staged ? staged + off / 2 : nullptr); \
    }
FOR_EACH_ATTN_INSTANCE(PF_ATTN_TC)

// Hopper causal attention on warpgroup MMAs (bf16 cache, head dims 64 / 128 / 256): the same math
// as pf_attn_tc (Q scaled by scale*log2(e) and rounded to bf16 once, bf16 P, f32 accumulation and
// exp2 online softmax), but 128 rows per block, (128/group) tokens x the group's q heads of one kv
// head: two warpgroups of 64 rows share each K/V tile, so a tile read from L2 serves twice the rows.
// Q, K and V sit in shared memory in 128-byte swizzled atoms (pfw_off): S = Q K^T reads Q and K
// K-major, O += P V reads V N-major (the same bytes: an atom row is 64 consecutive head values of
// one key either way), P from the S accumulators as register A fragments. K and V tiles of 64 keys
// are double-buffered and copied by all 256 threads with cp.async (8 threads per 128 contiguous
// bytes of a key's row, so every request fills whole sectors), one barrier per tile. Per
// warpgroup and tile j, S_j and P_{j-1} V_{j-1} are issued together; the softmax of S_j runs while
// the tensor cores do PV, and O is rescaled once PV is done. Splits and partials as pf_attn_tc
// (the host sends split launches, a few tokens over a long cache, to pf_attn_tc, whose two blocks
// per SM keep more of the cache's bytes in flight; the path stays for the shared launch shape).
// Dynamic smem (128 + 4*64)*HD*2 + 1024 (the atoms' 1024-byte alignment).
#define PFW_THREADS 256

// Byte offset of (row r, 16-byte chunk c) of a tile whose rows are `groups` groups of 8: atoms of
// 8 rows x 128 bytes (64 bf16), atom (r/8, c/8) at ((c/8)*groups + r/8)*1024, a row's chunks
// XOR-permuted by r%8 (the wgmma 128-byte swizzle), so both the copies into an atom row and the
// tensor cores' reads of a chunk down 8 rows spread over every bank.
__device__ __forceinline__ u32 pfw_off(int r, int c, int groups) {
    return (u32)(((((c >> 3) * groups) + (r >> 3)) << 10) | ((r & 7) << 7) | (((c & 7) ^ (r & 7)) << 4));
}
// Descriptor of a 128-byte-swizzled operand (layout type 1 in bits 62-63).
__device__ __forceinline__ unsigned long long pfw_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    return wgmma_desc(smem_addr, lbo_bytes, sbo_bytes) | (1ull << 62);
}

// A K or V tile: keys kt .. kt + 63 of one kv head, each thread the same 16-byte chunk of one key
// per pass (KPI keys a pass); keys at or past `nkeys` are zero-filled (their source clamped to the
// last key, never read).
template <int HD>
__device__ __forceinline__ void pfw_tile_async(const u16* __restrict__ src, size_t kv_dim, int kt, int nkeys, u32 dst) {
    constexpr int P = HD / 8, KPI = PFW_THREADS / P;
    static_assert(KPI % 8 == 0, "a pass covers whole atoms");
    const int c = threadIdx.x % P, k0 = threadIdx.x / P;
    const u32 d0 = dst + pfw_off(k0, c, 8);
    if (kt + 64 <= nkeys) {
        const u16* s0 = src + (size_t)(kt + k0) * kv_dim + c * 8;
#pragma unroll
        for (int i = 0; i < 64 / KPI; ++i) cp_async16(d0 + i * (KPI / 8) * 1024, s0 + (size_t)i * KPI * kv_dim);
    } else {
#pragma unroll
        for (int i = 0; i < 64 / KPI; ++i) {
            const int kr = kt + k0 + i * KPI;
            cp_async16z(d0 + i * (KPI / 8) * 1024, src + (size_t)min(kr, nkeys - 1) * kv_dim + c * 8, kr < nkeys);
        }
    }
}

// Q16 (pf_attn_wg_q16): q is already the operand, bf16(q * qscale) from pf_attn_prep_q16, and
// `gate` is the q|gate projection itself (head h of row t at (t nh + h) 2 HD + HD), so the prep
// neither writes q in f32 nor copies the gate. The same values either way.
template <int HD, bool Q16 = false>
__device__ void pf_attn_wg(const float* __restrict__ q, const float* __restrict__ gate, const u16* __restrict__ kc,
                           const u16* __restrict__ vc, int T, int pos0, int nh, int nkv, float scale,
                           float* __restrict__ out, int kchunk, float* __restrict__ part_o,
                           float* __restrict__ part_ml, int tile, u32* __restrict__ staged) {
    constexpr int TILE = 64 * HD * 2, NO = HD / 2;
    extern __shared__ __align__(128) u16 pfw_sm[];
    const u32 qs = (smem_u32(pfw_sm) + 1023u) & ~1023u, ks0 = qs + 128 * HD * 2, vs0 = ks0 + 2 * TILE;
    const int group = nh / nkv, qt = 128 / group;
    const int kvh = blockIdx.y, tok0 = tile * qt;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2;
    const size_t kv_dim = (size_t)nkv * HD;
    const float qscale = scale * 1.4426950408889634f;
    char* const qp = reinterpret_cast<char*>(pfw_sm) + (qs - smem_u32(pfw_sm));
    for (int idx = tid; idx < 128 * HD / 4; idx += PFW_THREADS) {
        const int r = idx / (HD / 4), f = idx % (HD / 4);
        const int t = tok0 + r / group, h = kvh * group + r % group;
        uint2 pk = make_uint2(0u, 0u);
        if constexpr (Q16) {
            if (t < T) pk = reinterpret_cast<const uint2*>(reinterpret_cast<const u16*>(q) + ((size_t)t * nh + h) * HD)[f];
        } else {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t < T) v = reinterpret_cast<const float4*>(q + ((size_t)t * nh + h) * HD)[f];
            pk.x = pack_bf16(v.x * qscale, v.y * qscale);
            pk.y = pack_bf16(v.z * qscale, v.w * qscale);
        }
        *reinterpret_cast<uint2*>(qp + pfw_off(r, f >> 1, 16) + ((f & 1) << 3)) = pk;
    }
    // This thread's rows (64 wg + 16 warp + g and + 8) and their query positions.
    int pq[2];
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int t = tok0 + (64 * wg + 16 * warp + g + 8 * hv) / group;
        pq[hv] = t < T ? pos0 + t : -1;
    }
    const int pq_min = min(pq[0], pq[1]);
    const int last_t = min(T - 1, tok0 + qt - 1);
    const int nkeys = pos0 + last_t + 1;
    const int splits = gridDim.z, k_lo = blockIdx.z * kchunk;
    const int k_hi = splits > 1 ? min(nkeys, k_lo + kchunk) : nkeys;
    const int ntiles = k_hi > k_lo ? (k_hi - k_lo + 63) / 64 : 0;
    const u16* kh = kc + kvh * HD;
    const u16* vh = vc + kvh * HD;
    const u32 qw = qs + wg * 8 * 1024;  // this warpgroup's 64 rows: Q's row groups 8 wg .. 8 wg + 7
    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float s[32];
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    u32 pa[4][4];
    // k step ks: head columns 16 ks .. 16 ks + 15, two chunks of atom column ks / 4; the next 8
    // rows (keys) one atom (1024 bytes) on.
    auto s_products = [&](u32 kst) {
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks)
            wgmma_ss_m64n64k16(s, pfw_desc(qw + (ks >> 2) * 16 * 1024 + (ks & 3) * 32, 16, 1024),
                               pfw_desc(kst + (ks >> 2) * 8 * 1024 + (ks & 3) * 32, 16, 1024), ks > 0);
    };
    // k step kk: keys 16 kk .. 16 kk + 15 (atom rows of key groups 2 kk, 2 kk + 1: SBO), the head
    // columns in atoms of 64 (LBO: the next atom column, 8 key groups on).
    auto pv_desc = [&](u32 vst, unsigned long long (&d)[4]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            d[kk] = pfw_desc(vst + 2 * kk * 1024, 8 * 1024, 1024);
            asm volatile("" : "+l"(d[kk]));
        }
    };
    auto pv_products = [&](const unsigned long long (&d)[4]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64k16_nmajor<HD>(o, pa[kk], d[kk]);
    };
    // Mask (keys past a row's position), online softmax of s, its P as bf16 A fragments in pn;
    // corr: the factor the row's earlier sums take.
    auto softmax = [&](int kt, u32 (&pn)[4][4], float (&corr)[2]) {
        if (kt + 63 > pq_min) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (kt + nt * 8 + 2 * (lane & 3) + (e & 1) > pq[e >> 1]) s[4 * nt + e] = NEG_INF;
        }
        float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int i = 0; i < 32; ++i) mt[(i >> 1) & 1] = fmaxf(mt[(i >> 1) & 1], s[i]);
        float base[2];
        flash_softmax_rows(mt, m, l, base, corr);
        flash_softmax_p(reinterpret_cast<const float(&)[8][4]>(s), base, l, pn);
    };
    // Copy groups: K(0); then per tile j after its barrier K(j + 1) and V(j), so tile j's barrier
    // finds K(j) and V(j - 1) in, and the stages they overwrite were last read by tile j - 1's
    // products (done before any thread passed the barrier). Tile j: S_j and P_{j-1} V_{j-1} are
    // issued right after the barrier and the copies after them, so the tensor cores start at once;
    // the softmax of S_j runs under PV, and O takes its rescale once PV is done (rescaled while S_j
    // runs, ptxas serialises the products: it waits for every group before reading O).
    if (ntiles > 0) pfw_tile_async<HD>(kh, kv_dim, k_lo, nkeys, ks0);
    cp_commit();
    float corr[2];
    for (int j = 0; j < ntiles; ++j) {
        const int kt = k_lo + 64 * j;
        cp_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();
        wgmma_fence();
        s_products(ks0 + (j & 1) * TILE);
        wgmma_commit();
        if (j == 0) {
            if (ntiles > 1) pfw_tile_async<HD>(kh, kv_dim, kt + 64, nkeys, ks0 + TILE);
            pfw_tile_async<HD>(vh, kv_dim, kt, nkeys, vs0);
            cp_commit();
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < 32; ++i) wgmma_keep(s[i]);
            softmax(kt, pa, corr);
            continue;
        }
        {
            unsigned long long vd[4];
            pv_desc(vs0 + ((j - 1) & 1) * TILE, vd);
            wgmma_fence();
            pv_products(vd);
        }
        wgmma_commit();
        if (j + 1 < ntiles) pfw_tile_async<HD>(kh, kv_dim, kt + 64, nkeys, ks0 + ((j + 1) & 1) * TILE);
        pfw_tile_async<HD>(vh, kv_dim, kt, nkeys, vs0 + (j & 1) * TILE);
        cp_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int i = 0; i < 32; ++i) wgmma_keep(s[i]);
        u32 pn[4][4];
        softmax(kt, pn, corr);
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            wgmma_keep(o[i]);
            o[i] *= corr[(i >> 1) & 1];
        }
#pragma unroll
        for (int x = 0; x < 4; ++x)
#pragma unroll
            for (int y = 0; y < 4; ++y) pa[x][y] = pn[x][y];
    }
    if (ntiles > 0) {
        cp_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();
        unsigned long long vd[4];
        pv_desc(vs0 + ((ntiles - 1) & 1) * TILE, vd);
        wgmma_fence();
        pv_products(vd);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < NO; ++i) wgmma_keep(o[i]);
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 1);
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 2);
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int r = 64 * wg + 16 * warp + g + 8 * hv;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        if (t >= T) continue;
        if (splits > 1) {
            const size_t row = ((size_t)t * nh + h) * splits + blockIdx.z;
#pragma unroll
            for (int nt = 0; nt < HD / 8; ++nt)
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) part_o[row * HD + nt * 8 + 2 * (lane & 3) + cc] = o[4 * nt + hv * 2 + cc];
            if ((lane & 3) == 0) {
                // exp2 units to natural ones: the partial weights are exp(m - M) in the combine.
                part_ml[2 * row] = m[hv] == NEG_INF ? NEG_INF : m[hv] * 0.6931471805599453f;
                part_ml[2 * row + 1] = l[hv];
            }
            continue;
        }
        const float il = 1.f / l[hv];
        const size_t rb = ((size_t)t * nh + h) * HD;
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) {
            const size_t idx = rb + nt * 8 + 2 * (lane & 3), gi = Q16 ? idx + rb + HD : idx;
            attn_out2(out, staged, idx, (o[4 * nt + hv * 2] * il) * sigmoid_f(gate[gi]),
                      (o[4 * nt + hv * 2 + 1] * il) * sigmoid_f(gate[gi + 1]));
        }
    }
}

// nseg segments' 128-row query blocks, each segment's longest rows first: grid (their blocks, nkv,
// splits), block 256. With splits > 1 the launch holds one segment. q is pf_attn_prep's (f32,
// QT float) with its gate copy, or (Q16, QT u16) pf_attn_prep_q16's bf16 scaled q with the gate
// read from the q|gate projection (rows of 2 nh HD); the Q16 instances take unsplit launches only
// (no partials).
#define PF_ATTN_WG_KERNEL(NAME, HD, Q16, QT)                                                                       \
    extern "C" __global__ void __launch_bounds__(PFW_THREADS, 1) NAME(                                             \
        const AttnSegs segs, int nseg, const QT* q, const float* gate, int nh, int nkv, float scale, float* out,   \
        int kchunk, float* part_o, float* part_ml, u32* staged) {                                                  \
        const int qt = 128 / (nh / nkv);                                                                           \
        int x = blockIdx.x;                                                                                        \
        const int z = attn_seg_of_block(segs, nseg, qt, x);                                                        \
        const size_t off = (size_t)segs.r0[z] * nh * HD;                                                           \
        pf_attn_wg<HD, Q16>(reinterpret_cast<const float*>(q + off), gate + (Q16 ? 2 : 1) * off,                   \
                            static_cast<const u16*>(segs.kc[z]), static_cast<const u16*>(segs.vc[z]), segs.n[z],   \
                            segs.pos0[z], nh, nkv, scale, out + off, kchunk, part_o, part_ml,                      \
                            (segs.n[z] + qt - 1) / qt - 1 - x, staged ? staged + off / 2 : nullptr);              \
    }
#define PF_ATTN_WG(HD)                                              \
    PF_ATTN_WG_KERNEL(pf_attn_wg_##HD, HD, false, float)            \
    PF_ATTN_WG_KERNEL(pf_attn_wg_q16_##HD, HD, true, u16)
PF_ATTN_WG(64)
PF_ATTN_WG(128)
PF_ATTN_WG(256)
