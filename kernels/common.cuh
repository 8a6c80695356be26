// Shared helpers, prepended to every kernel file by src/backend/cuda/context.rs (NVRTC gets one
// source string per module, so no include paths and no CUDA headers are needed: bf16 is handled
// as raw u16 bits, which keeps the CI compile check down to libnvrtc alone).
typedef unsigned int u32;
typedef unsigned short u16;

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; every thread gets the total. `red` holds >= 33 floats of shared
// memory. Safe to call repeatedly (it synchronises before reusing `red`).
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? red[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) red[32] = t;
    }
    __syncthreads();
    return red[32];
}

// The same formulas as the CPU reference (src/backend/cpu/ops.rs): accurate expf, no fast math.
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_f(x); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// 1/sqrt(mean + eps) from a sum of squares; the CPU does this step in f64.
__device__ __forceinline__ float inv_rms_from(float ss, int n, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
}

// Activation vectors are staged in shared memory with a float4 swizzle: logical float4 f lives
// at slot (f & ~7) | ((f + (f >> 3)) & 7). A lane reads the 8 float4s of its 32-column chunk
// (4-bit: one uint4 of codes); without the swizzle the 8 lanes of a shared-memory phase would all
// hit the same banks (128-byte stride), with it they hit 8 different ones. Vectors are multiples
// of 32 floats, so the permutation stays inside each 32-float block (and inside each group).
__device__ __forceinline__ int swz(int f) { return (f & ~7) | ((f + (f >> 3)) & 7); }
__device__ __forceinline__ int swz_elem(int c) { return (swz(c >> 2) << 2) | (c & 3); }

// Small unsigned integer (< 2^23) to float without I2F: 2^23 + v has v in the mantissa bits and
// subtracting 2^23 is exact, so code_f(v) == (float)v bit for bit. I2F runs at 16 per SM per clock
// on Hopper (a quarter of the integer pipe, an eighth of FP32); this is one LOP3 and one FADD. In
// decode it measured neutral on its own (2026-11-29: those kernels are latency-bound, not
// ALU-bound), but it is exact and takes the conversion unit out of every weight.
__device__ __forceinline__ float code_f(u32 v) { return __uint_as_float(v | 0x4B000000u) - 8388608.f; }

__device__ __forceinline__ float dot_nib(u32 q, float4 a, float4 b) {
    return code_f(q & 15u) * a.x + code_f((q >> 4) & 15u) * a.y + code_f((q >> 8) & 15u) * a.z +
           code_f((q >> 12) & 15u) * a.w + code_f((q >> 16) & 15u) * b.x + code_f((q >> 20) & 15u) * b.y +
           code_f((q >> 24) & 15u) * b.z + code_f(q >> 28) * b.w;
}
__device__ __forceinline__ float dot_byte(u32 q, float4 a) {
    return code_f(q & 255u) * a.x + code_f((q >> 8) & 255u) * a.y + code_f((q >> 16) & 255u) * a.z +
           code_f(q >> 24) * a.w;
}

// One row of an MLX affine-quantized matrix (bits 4 or 8, `group` columns per scale/bias pair)
// times the activation vector `xs` (shared memory, swizzled, `cols` floats), with the bias
// folded per group: sum((s q + b) x) = s sum(q x) + b sum(x); `gsum` holds sum(x) per group.
// Each lane loads 16 bytes of codes at a time (row starts are 16-byte aligned: cols % 32 == 0).
// `group` is a power of two (the loader accepts 64 only), so chunk -> group is a shift: a division
// by the runtime value compiled to ~40 instructions per 16-byte chunk, more than its dot product.
// Called by all 32 lanes of a warp; returns the full dot product in every lane.
// qrow_part returns this lane's share (no reduction), so callers can keep several rows' loads in
// flight and reduce once; qrow_dot reduces over the warp.
// The activations of one 16-byte chunk of codes (32 at 4 bits, 16 at 8), from the swizzled
// vector: f is the chunk's first float4 (chunk index * 32 / BITS).
template <int BITS>
__device__ __forceinline__ void chunk_x(const float4* x4, int f, float4 (&xv)[32 / BITS]) {
#pragma unroll
    for (int j = 0; j < 32 / BITS; ++j) xv[j] = x4[swz(f + j)];
}
// One chunk's codes dotted with its activations (no scale, no bias).
template <int BITS>
__device__ __forceinline__ float chunk_dot(uint4 q, const float4 (&xv)[32 / BITS]) {
    if constexpr (BITS == 4)
        return dot_nib(q.x, xv[0], xv[1]) + dot_nib(q.y, xv[2], xv[3]) + dot_nib(q.z, xv[4], xv[5]) +
               dot_nib(q.w, xv[6], xv[7]);
    else
        return dot_byte(q.x, xv[0]) + dot_byte(q.y, xv[1]) + dot_byte(q.z, xv[2]) + dot_byte(q.w, xv[3]);
}

template <int BITS>
__device__ __forceinline__ float qrow_part_t(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                            const u16* __restrict__ br, const float* xs, const float* gsum,
                                            int cols, int group) {
    constexpr int LCPC = BITS == 4 ? 5 : 4;  // log2 codes per uint4
    const int lane = threadIdx.x & 31;
    const uint4* w4 = reinterpret_cast<const uint4*>(wr);
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    const int n4 = cols >> LCPC, cpg = group >> LCPC, lcpg = __ffs(cpg) - 1;
    float acc = 0.f;
#pragma unroll 2
    for (int i = lane; i < n4; i += 32) {
        uint4 q = __ldg(w4 + i);
        float4 xv[32 / BITS];
        chunk_x<BITS>(x4, i * (32 / BITS), xv);
        float d = chunk_dot<BITS>(q, xv);
        int g = i >> lcpg;
        acc += bf16f(__ldg(sr + g)) * d;
        if ((i & (cpg - 1)) == 0) acc += bf16f(__ldg(br + g)) * gsum[g];
    }
    return acc;
}
__device__ __forceinline__ float qrow_part(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                          const u16* __restrict__ br, const float* xs, const float* gsum,
                                          int cols, int bits, int group) {
    return bits == 4 ? qrow_part_t<4>(wr, sr, br, xs, gsum, cols, group)
                     : qrow_part_t<8>(wr, sr, br, xs, gsum, cols, group);
}

// Two rows of the same width and bits against the same activations: each activation float4 is
// read from shared memory once for both rows (half the shared-memory traffic and load
// instructions of two qrow_part calls); per row the arithmetic is exactly qrow_part's.
template <int BITS>
__device__ __forceinline__ void qrow_part2_t(const u32* __restrict__ wa, const u16* __restrict__ sa,
                                             const u16* __restrict__ ba, const u32* __restrict__ wb,
                                             const u16* __restrict__ sb, const u16* __restrict__ bb, const float* xs,
                                             const float* gsum, int cols, int group, float& outa, float& outb) {
    constexpr int LCPC = BITS == 4 ? 5 : 4;
    const int lane = threadIdx.x & 31;
    const uint4* wa4 = reinterpret_cast<const uint4*>(wa);
    const uint4* wb4 = reinterpret_cast<const uint4*>(wb);
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    const int n4 = cols >> LCPC, cpg = group >> LCPC, lcpg = __ffs(cpg) - 1;
    float acca = 0.f, accb = 0.f;
#pragma unroll 2
    for (int i = lane; i < n4; i += 32) {
        uint4 qa = __ldg(wa4 + i), qb = __ldg(wb4 + i);
        float4 xv[32 / BITS];
        chunk_x<BITS>(x4, i * (32 / BITS), xv);
        float da = chunk_dot<BITS>(qa, xv);
        float db = chunk_dot<BITS>(qb, xv);
        int g = i >> lcpg;
        acca += bf16f(__ldg(sa + g)) * da;
        accb += bf16f(__ldg(sb + g)) * db;
        if ((i & (cpg - 1)) == 0) {
            float gs = gsum[g];
            acca += bf16f(__ldg(ba + g)) * gs;
            accb += bf16f(__ldg(bb + g)) * gs;
        }
    }
    outa = acca;
    outb = accb;
}
__device__ __forceinline__ void qrow_part2(const u32* __restrict__ wa, const u16* __restrict__ sa,
                                           const u16* __restrict__ ba, const u32* __restrict__ wb,
                                           const u16* __restrict__ sb, const u16* __restrict__ bb, const float* xs,
                                           const float* gsum, int cols, int bits, int group, float& outa, float& outb) {
    if (bits == 4) qrow_part2_t<4>(wa, sa, ba, wb, sb, bb, xs, gsum, cols, group, outa, outb);
    else qrow_part2_t<8>(wa, sa, ba, wb, sb, bb, xs, gsum, cols, group, outa, outb);
}

__device__ __forceinline__ float qrow_dot(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                         const u16* __restrict__ br, const float* xs, const float* gsum,
                                         int cols, int bits, int group) {
    return warp_sum(qrow_part(wr, sr, br, xs, gsum, cols, bits, group));
}

// Per-group sums of `xs` (shared memory) into `gsum`: one warp per group (a serial loop per
// thread was a ~64-deep dependent chain). Ends with __syncthreads().
__device__ void group_sums(const float* xs, int n, int group, float* gsum) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int g = warp; g < n / group; g += nw) {
        float v = 0.f;
        for (int j = lane; j < group; j += 32) v += xs[g * group + j];  // swizzle stays inside the group
        v = warp_sum(v);
        if (lane == 0) gsum[g] = v;
    }
    __syncthreads();
}

// Stages `n` floats of x into shared memory (optionally RMS-normalised with `gain`, exactly as
// ops::rms_norm: x * inv * gain) and the per-group sums. Ends with __syncthreads().
__device__ void stage_x(const float* __restrict__ x, int n, const float* __restrict__ gain, float eps,
                        int group, float* xs, float* gsum, float* red) {
    float inv = 1.f;
    if (gain) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < n; c += blockDim.x) { float v = x[c]; ss += v * v; }
        ss = block_sum(ss, red);
        inv = inv_rms_from(ss, n, eps);
    }
    for (int c = threadIdx.x; c < n; c += blockDim.x) xs[swz_elem(c)] = gain ? x[c] * inv * gain[c] : x[c];
    __syncthreads();
    group_sums(xs, n, group, gsum);
}

#define NEG_INF __int_as_float(0xff800000u)

// Two floats to packed bf16 (round to nearest even); `lo` lands at the lower address.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- attention KV cache elements: f32, or bf16 (u16) for sequences made with the bf16 KV cache
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

// Routing of one token by one whole warp: top-k of the E router logits (ties -> lower id), the
// renormalised softmax weights exp(l - max) / sum_topk exp(l - max), then sorted by expert id
// (the CPU accumulates experts in ascending id order). ids/wts (K entries, shared memory) are
// valid for every lane of the warp on return. E <= 512, K <= 16. Used by decode (moe.cu) and prefill
// (prefill.cu), so both pick the same experts with the same weights.
#define ROUTE_MAXE_PER_LANE 16
__device__ void warp_route_topk(const float* __restrict__ logits, int E, int K, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    float v[ROUTE_MAXE_PER_LANE];
#pragma unroll
    for (int t = 0; t < ROUTE_MAXE_PER_LANE; ++t) v[t] = (lane + 32 * t < E) ? logits[lane + 32 * t] : NEG_INF;
    float top = 0.f, my_e = 0.f;
    int my_id = 0x7fffffff;
    for (int k = 0; k < K; ++k) {
        float best = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int t = 0; t < ROUTE_MAXE_PER_LANE; ++t)
            if (v[t] > best) { best = v[t]; bi = lane + 32 * t; }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        if (k == 0) top = best;
#pragma unroll
        for (int t = 0; t < ROUTE_MAXE_PER_LANE; ++t)
            if (lane + 32 * t == bi) v[t] = NEG_INF;
        if (lane == k) { my_id = bi; my_e = expf(best - top); }
    }
    // Lane k < K holds the k-th pick. The normaliser is summed in pick order (as the CPU does),
    // and each pick's place in id order is its rank among the picks (ids are distinct): a few
    // shuffles instead of lane 0's serial sum and insertion sort through shared memory.
    float sum = 0.f;
    int rank = 0;
    for (int k = 0; k < K; ++k) {
        sum += __shfl_sync(0xffffffffu, my_e, k);
        rank += __shfl_sync(0xffffffffu, my_id, k) < my_id;
    }
    if (lane < K) { ids[rank] = my_id; wts[rank] = my_e / sum; }
    __syncwarp();
}

// ---- appended (decode fixed-cost work) ----
// Starts pulling one 128-byte line into L2 (no registers, no completion wait). The decode kernels
// issue their first weight rows this way before the activation prologue, since weights never
// depend on the activations: the DRAM latency then overlaps the prologue.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// Prefetches `bytes` starting at `p`, the lines spread over the 32 lanes of a warp.
__device__ __forceinline__ void prefetch_l2_warp(const void* p, size_t bytes, int lane) {
    const char* c = reinterpret_cast<const char*>(p);
    for (size_t off = (size_t)lane * 128; off < bytes; off += 32 * 128) prefetch_l2(c + off);
}

// ---- programmatic dependent launch (decode kernels, sm_90) ----
// Launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (context::launch_ex), a
// decode kernel may start while the previous kernel of the stream still runs. Before pdl_wait()
// it may only touch what no kernel of the current step writes (weights, descriptors, the step
// buffer, state written at earlier steps) -- typically L2 prefetches of its weights; pdl_wait()
// returns once the previous kernel has completed and its writes are visible. pdl_trigger() lets
// the next kernel be scheduled. Both are no-ops when the kernel was launched normally.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Where a decode kernel lets the next one launch (compile-time, for measurements:
// LILY_CUDA_NVRTC_DEFS=-DPDL_TRIGGER=n): 0 right after the wait (at most one kernel runs ahead),
// 1 never explicitly (the next kernel launches as the blocks exit), 2 before the wait (kernels
// cascade ahead as far as resources allow; every pre-wait section only reads data of earlier steps).
#ifndef PDL_TRIGGER
#define PDL_TRIGGER 0
#endif
__device__ __forceinline__ void pdl_wait_trigger() {
#if PDL_TRIGGER == 2
    pdl_trigger();
    pdl_wait();
#elif PDL_TRIGGER == 1
    pdl_wait();
#else
    pdl_wait();
    pdl_trigger();
#endif
}
// attn_prep lets attn_split (whose pre-wait part only prefetches K/V rows of earlier steps) start
// during the q|k|v GEMV.
__device__ __forceinline__ void pdl_trigger_early() {
#if PDL_TRIGGER != 1
    pdl_trigger();
#endif
}

// One-pass staging (gemv_q; moe kernels with MOE_FAST): each thread loads its float2 pieces of x (and of the norm gain)
// at once (c = k * 2 * blockDim + 2 * tid: a warp covers 64 contiguous floats per k, i.e. one
// 64-group or two 32-groups, so the group sums are warp reductions of the staged values), writes
// x * gain to shared memory and returns the RMS factor inv = 1/rms(x) after ONE barrier: the
// caller multiplies the finished dot products by inv (sum(w (x inv g)) = inv sum(w (x g))), so
// the sum-of-squares reduction is off the critical path. Needs n % 64 == 0, n <= 2 * MAXK * blockDim,
// group 32 or 64 (callers fall back to stage_x otherwise). inv is 1 without a gain.
template <int MAXK>
__device__ float stage_x_fast(const float* __restrict__ x, int n, const float* __restrict__ gain, float eps,
                              int group, float* xs, float* gsum, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = 2 * blockDim.x;
    float2 v[MAXK], gn[MAXK];
#pragma unroll
    for (int k = 0; k < MAXK; ++k) {
        const int c = k * per + 2 * threadIdx.x;
        v[k] = c < n ? *reinterpret_cast<const float2*>(x + c) : make_float2(0.f, 0.f);
        gn[k] = (gain && c < n) ? *reinterpret_cast<const float2*>(gain + c) : make_float2(1.f, 1.f);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAXK; ++k) {
        const int c = k * per + 2 * threadIdx.x;
        if (k * per + 64 * warp < n) {  // warp-uniform (n % 64 == 0)
            float a = v[k].x, b = v[k].y;
            ss += a * a + b * b;
            if (gain) { a *= gn[k].x; b *= gn[k].y; }
            xs[swz_elem(c)] = a;
            xs[swz_elem(c + 1)] = b;
            float gs = a + b;
            gs += __shfl_xor_sync(0xffffffffu, gs, 8);
            gs += __shfl_xor_sync(0xffffffffu, gs, 4);
            gs += __shfl_xor_sync(0xffffffffu, gs, 2);
            gs += __shfl_xor_sync(0xffffffffu, gs, 1);
            if (group == 64) {
                gs += __shfl_xor_sync(0xffffffffu, gs, 16);
                if (lane == 0) gsum[c / 64] = gs;
            } else if ((lane & 15) == 0) {
                gsum[c / 32] = gs;
            }
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (!gain) return 1.f;
    float t = 0.f;
    for (int w = 0; w < nw; ++w) t += red[w];
    return inv_rms_from(t, n, eps);
}

