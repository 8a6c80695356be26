// Shared device code: what more than one op family uses (qmatmul.cu, gdn.cu, attention.cu,
// moe.cu, ops.cu, sample.cu). No kernels. Prepended to every module by
// src/backend/cuda/context.rs (NVRTC gets one source string per module, so no include paths and
// no CUDA headers are needed: bf16 is handled as raw u16 bits, which keeps the CI compile check
// down to libnvrtc alone).
typedef unsigned int u32;
typedef unsigned short u16;

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One step of warp_sum_scatter at xor distance O over the lane's first C values.
template <int C, int O>
__device__ __forceinline__ void warp_sum_scatter_step(float* v, int& base) {
    if constexpr (C > 1) {
        constexpr int H = C / 2;
        const bool up = threadIdx.x & O;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float send = up ? v[i] : v[i + H], keep = up ? v[i + H] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
        }
        base += up ? H : 0;
    } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
    }
}

// warp_sum of each of a lane's C values (C a power of two) at once, each sum left on the lanes
// that return it: a reduce-scatter by recursive halving, where at each xor distance of
// warp_sum's order a lane keeps one half of its values and sends the other, so C = 64 takes
// 62 shuffles instead of 320. Every sum pairs the same lanes in the same order as warp_sum (each
// step adds the lane's own value and its partner's), so the bits are warp_sum's. On return
// v[0 .. n) hold the sums of values base .. base + n - 1, with n = max(C / 32, 1) and base the
// return value; for C < 32 the lanes that share a base hold the same sums.
template <int C>
__device__ __forceinline__ int warp_sum_scatter(float (&v)[C]) {
    static_assert(C >= 1 && C <= 1024 && (C & (C - 1)) == 0, "a power of two");
    int base = 0;
    warp_sum_scatter_step<C, 16>(v, base);
    warp_sum_scatter_step<(C > 1 ? C / 2 : 1), 8>(v, base);
    warp_sum_scatter_step<(C > 3 ? C / 4 : 1), 4>(v, base);
    warp_sum_scatter_step<(C > 7 ? C / 8 : 1), 2>(v, base);
    warp_sum_scatter_step<(C > 15 ? C / 16 : 1), 1>(v, base);
    return base;
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

// The MoE output of token t at column c: sum_k w[t,k] * D[t*K + k][c] + sigmoid(sgl[t]) * SH[t][c]
// (h columns per row), in this order wherever it is added to the residual (pf_moe_combine, and
// stage_tcb folding it into the next layer's staging), so both give the same bits.
__device__ __forceinline__ float moe_combined(const float* __restrict__ D, const float* __restrict__ top_w, int K,
                                              const float* __restrict__ SH, const float* __restrict__ sgl, int h,
                                              int t, int c) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += top_w[(size_t)t * K + k] * D[((size_t)t * K + k) * h + c];
    acc += sigmoid_f(sgl[t]) * SH[(size_t)t * h + c];
    return acc;
}
// moe_combined of the 8 columns c0..c0 + 7 (c0 a multiple of 4), each summed in the same order,
// with the rows' loads issued together.
__device__ __forceinline__ void moe_combined8(const float* __restrict__ D, const float* __restrict__ top_w, int K,
                                              const float* __restrict__ SH, const float* __restrict__ sgl, int h,
                                              int t, int c0, float (&acc)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll 8
    for (int k = 0; k < K; ++k) {
        const float w = top_w[(size_t)t * K + k];
        const float4* d = reinterpret_cast<const float4*>(D + ((size_t)t * K + k) * h + c0);
        const float4 p = d[0], q = d[1];
        acc[0] += w * p.x, acc[1] += w * p.y, acc[2] += w * p.z, acc[3] += w * p.w;
        acc[4] += w * q.x, acc[5] += w * q.y, acc[6] += w * q.z, acc[7] += w * q.w;
    }
    const float g = sigmoid_f(sgl[t]);
    const float4* sh = reinterpret_cast<const float4*>(SH + (size_t)t * h + c0);
    const float4 p = sh[0], q = sh[1];
    acc[0] += g * p.x, acc[1] += g * p.y, acc[2] += g * p.z, acc[3] += g * p.w;
    acc[4] += g * q.x, acc[5] += g * q.y, acc[6] += g * q.z, acc[7] += g * q.w;
}

// 1/sqrt(mean + eps) from a sum of squares; the CPU does this step in f64.
__device__ __forceinline__ float inv_rms_from(float ss, int n, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
}

// The prefill's row norms (pf_rmsnorm, pf_moe_combine_norm_bf16): a block of NORM_THREADS per
// row, thread i the float4s i, i + NORM_THREADS, ..., the first NORM_V of them (rows of up to
// 2,048 values) in registers between the two passes. A block rather than a warp per row, so the
// few rows of a short prompt still keep enough loads in flight. Both kernels sum the squares in
// this order and scale with this expression, so the fused one writes what the separate launches
// would, bit for bit.
#define NORM_THREADS 128
#define NORM_V 4
__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
__device__ __forceinline__ float4 norm4(float4 v, float inv, float4 g) {
    return make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
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
// on Hopper (a quarter of the integer pipe, an eighth of FP32); this is one LOP3 and one FADD. The
// decode kernels are latency-bound rather than ALU-bound, but it is exact and takes the
// conversion unit out of every weight.
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
// flight and reduce once.
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

// This lane's share of 16-byte chunks [i0, i1) of a row: the chunks lane-strided from i0, each
// scaled by its group's scale, the group's bias term at the group's first chunk.
template <int BITS>
__device__ __forceinline__ float qrow_range_t(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                             const u16* __restrict__ br, const float* xs, const float* gsum,
                                             int i0, int i1, int group) {
    constexpr int LCPC = BITS == 4 ? 5 : 4;  // log2 codes per uint4
    const int lane = threadIdx.x & 31;
    const uint4* w4 = reinterpret_cast<const uint4*>(wr);
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    const int cpg = group >> LCPC, lcpg = __ffs(cpg) - 1;
    float acc = 0.f;
#pragma unroll 2
    for (int i = i0 + lane; i < i1; i += 32) {
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
// This lane's share of a whole row of `cols` columns.
template <int BITS>
__device__ __forceinline__ float qrow_part_t(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                            const u16* __restrict__ br, const float* xs, const float* gsum,
                                            int cols, int group) {
    return qrow_range_t<BITS>(wr, sr, br, xs, gsum, 0, cols >> (BITS == 4 ? 5 : 4), group);
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
// Per-group sums of `xs` (shared memory) into `gsum`: one warp per group (a serial loop per
// thread would be a ~64-deep dependent chain). Ends with __syncthreads().
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

// Two or four consecutive prefill activations as floats: f32, or bf16 (u16 bits) where their
// producer, a cuBLAS GEMM, wrote them so to halve the bytes written and read back (the GDN
// in-projection's z, the shared expert's outputs).
__device__ __forceinline__ float2 act_ld2(const float* p) { return make_float2(p[0], p[1]); }
__device__ __forceinline__ float2 act_ld2(const u16* p) {
    const u32 v = *reinterpret_cast<const u32*>(p);
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ float4 act_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 act_ld4(const u16* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
// Four consecutive activations stored as f32, or as bf16 pairs (round to nearest even) where
// their reader takes them so.
__device__ __forceinline__ void act_st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void act_st4(u16* p, float4 v) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}

// ---- L2 prefetch (decode) ----
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
// buffer, state written at earlier steps) -- typically L2 prefetches of its weights -- or what
// the kernel two launches back wrote when the one between lets it start only after its own
// pdl_wait() (pdl_wait_trigger), i.e. once that one's predecessor has completed, read through L2
// (__ldcg: the wait orders only the predecessor's writes, not a stale L1 line): moe_down_tc reads
// the router's logits this way behind moe_gate_up_tc (attn_prep triggers first); pdl_wait()
// returns once the previous kernel has completed and its writes are visible. pdl_trigger() lets
// the next kernel be scheduled. Both are no-ops when the kernel was launched normally.
// ---- decode timeline (LILY_CUDA_TIMELINE=1 compiles every module with LILY_TIMELINE defined;
// src/backend/cuda/timeline.rs) ----
// Thread 0 of block 0 of each decode kernel stamps %globaltimer once it may read its inputs: in
// pdl_wait for the programmatic dependents (the moment the previous kernel completed), at entry
// for the others (moe_tcb/tcp/tcr, readback_words). The buffer, set by the host in every module:
// [stamps taken, capacity, then per stamp (ns, gridDim.x | gridDim.y << 32)]. One counter for all
// modules, so the stamps are in launch order; without the define this is nothing.
#ifdef LILY_TIMELINE
__device__ unsigned long long* lily_timeline;
__device__ __forceinline__ void tl_stamp() {
    unsigned long long* tl = lily_timeline;
    if (tl != nullptr && (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y) == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const unsigned long long i = atomicAdd(tl, 1ull);
        if (i < tl[1]) {
            tl[2 + 2 * i] = t;
            tl[3 + 2 * i] = (unsigned long long)gridDim.x | ((unsigned long long)gridDim.y << 32);
        }
    }
}
#else
__device__ __forceinline__ void tl_stamp() {}
#endif

__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    tl_stamp();
}
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// A release-and-acquire fence at GPU scope (lighter than __threadfence's sequentially consistent
// one): for "the last block to take a ticket" patterns, in the thread that takes the ticket.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// A decode kernel lets the next one launch right after its own wait, so at most one kernel runs
// ahead of the one that is computing.
__device__ __forceinline__ void pdl_wait_trigger() {
    pdl_wait();
    pdl_trigger();
}

// The end of the staging functions below: each thread's sum of squares of x goes to `red` per
// warp, and the one barrier publishes those sums together with the staged x. Every thread then
// adds the warp sums itself (no second barrier, unlike block_sum) and gets inv = 1/rms(x), or 1
// without a gain.
__device__ __forceinline__ float staged_inv_rms(float ss, float* red, int n, float eps, bool has_gain) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (!has_gain) return 1.f;
    float t = 0.f;
    for (int w = 0; w < nw; ++w) t += red[w];
    return inv_rms_from(t, n, eps);
}

// One-pass staging (gemv_q, moe_gate_up, moe_down): each thread loads its float2 pieces of x (and
// of the norm gain) at once (c = k * 2 * blockDim + 2 * tid: a warp covers 64 contiguous floats per k, i.e. one
// 64-group or two 32-groups, so the group sums are warp reductions of the staged values), writes
// x * gain to shared memory and returns the RMS factor inv = 1/rms(x) after ONE barrier: the
// caller multiplies the finished dot products by inv (sum(w (x inv g)) = inv sum(w (x g))), so
// the sum-of-squares reduction is off the critical path. Needs n % 64 == 0, n <= 2 * MAXK * blockDim,
// group 32 or 64 (callers fall back to stage_x otherwise). inv is 1 without a gain.
template <int MAXK>
__device__ float stage_x_fast(const float* __restrict__ x, int n, const float* __restrict__ gain, float eps,
                              int group, float* xs, float* gsum, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
    return staged_inv_rms(ss, red, n, eps, gain != nullptr);
}

// ---- tensor cores (decode GEMV in qmatmul.cu and moe.cu; prefill GEMM and attention) ----
// Shared-memory address of a generic pointer to shared memory (for ldmatrix and cp.async).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// Four 8x8 b16 matrices from shared memory, in mma fragment order.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// The same, each matrix transposed (an operand stored the other way round).
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// D += A B on the tensor cores: A 16x16 bf16 (4 registers of pairs), B 16x8 bf16 (2), f32 C/D;
// mma_f16 the same with f16 operands.
#define MMA_M16N8K16(NAME, T)                                                                             \
    __device__ __forceinline__ void NAME(float* c, const u32* a, u32 b0, u32 b1) {                        \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                     "{%8,%9}, {%0,%1,%2,%3};"                                                            \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                     \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                     \
    }
MMA_M16N8K16(mma_bf16, "bf16")
MMA_M16N8K16(mma_f16, "f16")

// ---- warpgroup MMA (wgmma, sm_90a): the prefill's routed experts (moe.cu) ----
// A 64 x N x 16 product of one warpgroup (4 warps, 128 threads): A from registers (each warp its
// 16 rows, mma.sync's A fragment layout), B (16 x N, K-major) read by the tensor cores from
// shared memory through a descriptor, f32 accumulators in registers. It runs asynchronously:
// commit, then wait before reading the accumulators, and keep the A registers unchanged until
// then (ptxas checks both and serialises the pipeline where it cannot prove them).
//
// B's layout without swizzling: core matrices of 8 rows (N) x 16 bytes (8 k values), each 128
// contiguous bytes; the descriptor holds the start address, the byte distance between the two
// core matrices of a k16 step (LBO, along K) and between consecutive 8-row groups (SBO, along N),
// all in units of 16 bytes.
__device__ __forceinline__ unsigned long long wgmma_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo_bytes >> 4) << 16) |
           ((unsigned long long)(sbo_bytes >> 4) << 32);
}
// A predicated 4-byte global store: no branch (and no reconvergence block) around each store of
// an unrolled epilogue.
__device__ __forceinline__ void st_global_u32_if(void* p, u32 v, bool ok) {
    asm volatile("{.reg .pred q; setp.ne.b32 q, %2, 0; @q st.global.b32 [%0], %1;}" ::"l"(p), "r"(v), "r"((int)ok) : "memory");
}
// The descriptors of B operands of one layout (fixed LBO and SBO) at many addresses: only the
// start address field (bits 0-13, in 16-byte units) moves, so each costs one add on the low word
// instead of wgmma_desc's mask, shift and or (the expert kernels' steps are bound by their
// instruction stream). Shared-memory addresses are below 2^18, so the field never carries.
struct WgmmaDescs {
    u32 lo, hi;  // the descriptor of address 0
    __device__ __forceinline__ WgmmaDescs(u32 lbo_bytes, u32 sbo_bytes) {
        const unsigned long long d = wgmma_desc(0, lbo_bytes, sbo_bytes);
        lo = (u32)d;
        hi = (u32)(d >> 32);
    }
    // The descriptor of shared-memory address 16 * units.
    __device__ __forceinline__ unsigned long long at(u32 units) const {
        return ((unsigned long long)hi << 32) | (lo + units);
    }
};
// The same for B operands in the 128-byte swizzle (K-major rows of 128 bytes, 8-row atoms of
// 1,024 bytes, SBO the atoms' stride), the layout a tensor copy with CU_TENSOR_MAP_SWIZZLE_128B
// writes: the layout field (bits 62-63) is 1 and LBO unused.
__device__ __forceinline__ WgmmaDescs wgmma_descs_sw128(u32 sbo_bytes) {
    WgmmaDescs d(16, sbo_bytes);
    d.hi |= 1u << 30;
    return d;
}
// A bf16 from shared memory as the pair (v, v) (the wgmma experts' scales and biases: the
// products read it as an .H0_H0 operand, no separate broadcast).
__device__ __forceinline__ u32 lds_bf16_pair(u32 addr) {
    u32 v;
    asm volatile("{.reg .b16 h; ld.shared.b16 h, [%1]; mov.b32 %0, {h, h};}" : "=r"(v) : "r"(addr));
    return v;
}
// ---- mbarriers (the wgmma experts' stages handed between warps) ----
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the asynchronous copies' arrivals.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed (acquire: the copies and writes it
// covers are then visible).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT; }" ::"r"(bar), "r"(parity)
        : "memory");
}
// One arrival that also expects `bytes` more of asynchronous copies on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// ---- thread block clusters, tensor and bulk copies (the wgmma gate|up's shared inputs) ----
// A launch without a cluster dimension is a cluster of one block.
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_blocks() {
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
// The cluster barrier in two halves, every thread of every block of the cluster: arrive (release)
// and wait (acquire).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// The arrive half without release semantics: where the cluster barrier only has to order what
// is fenced otherwise (mbarrier initialisation by fence.mbarrier_init), it spares every thread a
// GPU-wide MEMBAR that would also wait for its copies in flight.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
// An arrival on the mbarrier at offset `bar` of block `rank` of the cluster. The default
// semantics (release at CTA scope), as CUTLASS's cluster barriers use: the arrival only has to
// follow this warp's reads of the stage (its wgmmas waited for), and release or acquire at
// cluster scope cost a GPU-wide MEMBAR per arrival and an L1 invalidation per wait.
__device__ __forceinline__ void mbar_arrive_in(u32 bar, u32 rank) {
    asm volatile("{ .reg .b32 ra; mapa.shared::cluster.u32 ra, %0, %1; mbarrier.arrive.shared::cluster.b64 _, [ra]; }" ::"r"(bar), "r"(rank)
                 : "memory");
}
// A CUtensorMap (cuTensorMapEncodeTiled's 128 opaque bytes), passed as a __grid_constant__
// kernel parameter so that the tensor copies read it in place.
struct __align__(64) TmaMap {
    unsigned long long w[16];
};
// A 2-D box of `map` at element coordinates (c0, c1) into shared memory at `dst`, completing on
// `bar`'s transaction count.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// The same box into offset `dst` of every block of the cluster in `mask`, each completing on its
// own mbarrier at offset `bar`.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TmaMap* map, int c0, int c1, u32 bar, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
// `bytes` (a multiple of 16) contiguous bytes global -> shared, completing on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src),
                 "r"(bytes), "r"(bar)
                 : "memory");
}
// An arrival on `bar` once all of this thread's cp.async copies issued so far have landed (the
// barrier's expected count includes it: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the tensor cores'
// async-proxy reads.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Keeps the compiler from moving accesses of an accumulator register across this point.
__device__ __forceinline__ void wgmma_keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// d += A B, m64nNWk16, bf16 inputs, f32 accumulators (thread (warp w, g, t) holds rows 16w + g
// and 16w + g + 8, columns 8j + 2t and + 1 as d[4j .. 4j + 3], j < NW / 8). NW: 32, 64, 96, 128
// or 160 (moe.cu's expert kernels take the narrowest that covers a tile's slots; 160 the wide
// gate|up's tiles that take their expert's last few slots too).
template <int NW>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[NW / 2], const u32 (&a)[4], unsigned long long desc);
template <>
__device__ __forceinline__ void wgmma_m64k16<32>(float (&d)[16], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16<64>(float (&d)[32], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16<96>(float (&d)[48], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16<128>(float (&d)[64], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16<160>(float (&d)[80], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, {%80, %81, %82, %83}, %84, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
// d (=|+=) A B, m64n64k16, A and B both from shared memory (K-major, descriptors), f32
// accumulators as in wgmma_m64k16; `acc` false overwrites d (the first k step of a product).
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], unsigned long long adesc, unsigned long long bdesc,
                                                   bool acc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(adesc), "l"(bdesc), "r"((int)acc));
}
// d += A B, m64nNk16 with A from registers (as wgmma_m64k16) and B N-major in shared memory
// (imm-trans-b: each 16-byte row holds 8 consecutive n of one k). The descriptor offsets' roles
// depend on the layout (PTX ISA, canonical layouts): without swizzling SBO steps along N and LBO
// along K; with the 128-byte swizzle (pf_attn_wg) LBO steps along N and SBO along K. N: 64, 128
// or 256 (the attention's head dimension).
template <int N>
__device__ __forceinline__ void wgmma_m64k16_nmajor(float (&d)[N / 2], const u32 (&a)[4], unsigned long long desc);
template <>
__device__ __forceinline__ void wgmma_m64k16_nmajor<64>(float (&d)[32], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16_nmajor<128>(float (&d)[64], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_m64k16_nmajor<256>(float (&d)[128], const u32 (&a)[4], unsigned long long desc) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// ---- tensor-core decode GEMV (4-bit codes, group 64): gemv_tc, moe_gate_up_tc, moe_down_tc ----
// Why: a decode GEMV on the CUDA cores spends ~4.5 instructions per 4-bit weight (extract,
// convert, FMA); over the ~1.9 GB a token reads that is ~0.5 ms of pure issue time, and the
// CUDA-core decode kernels are issue- and instruction-fetch-bound (docs/cuda.md). Here a warp
// takes 16 rows at a time and lets mma.sync do the multiply-adds: per 32-bit word of codes
// (8 weights) 4 shifts + 4 LOP3 turn the nibbles into bf16 pairs, and one mma consumes 256
// weights. About 1.75 instructions per weight and lane (56 per group of 16 rows) instead of 4.5.
//
// Exactness: the codes become bf16 1 + q/16 (exact: the nibble lands in the top mantissa bits),
// and the activation is split into three bf16 terms x = hi + mid + lo (exact to ~2^-24 relative),
// which ride in the B operand's columns 0, 1, 2 (columns 3..7 are zero: batch 1 leaves them free
// anyway). The tensor core multiplies exactly and accumulates in f32, so per group of 64
// columns C = sum (1 + q/16) x = gsum + sum(q x)/16, and the group's contribution to the row is
// s sum(q x) + b gsum = 16 s C + (b - 16 s) gsum: the same math as qrow_part to f32 rounding.
//
// Layout. Lane (g = lane/4, t = lane%4) holds rows g and g + 8 of the tile. Of each 64-column
// group, lane t reads the 16 columns 16t..16t+15 of both rows (two u32 words each); word h,
// shifted by 4s, gives the pair (column 8h + s, column 8h + s + 4) of its 16. mma step i (0..3)
// of a group takes the pairs s = 2(i&1) (k slots 2t, 2t+1) and s + 1 (k slots 2t+8, 2t+9) of
// word h = i/2. The sum over k does not care which column sits in which slot, as long as B
// holds x of the same column there: stage_x_tc writes x in exactly that order.
//
// Activation fragments in shared memory (u32 words of bf16 pairs): word
//   G*96 + i*24 + n*8 + t*2 + reg
// holds term n (0 hi, 1 mid, 2 lo) of the pair (column 64G + 16t + 8h + s, + 4), h = i/2,
// s = 2(i&1) + reg: lane (g < 3, t) loads B of step i as one uint2 at G*96 + i*24 + g*8 + 2t.
#define TCX_WORDS 96  // fragment words per 64-column group
#define TC_NG 8       // groups per warp work item (512 columns)

// Nibbles s and s + 4 of `w` as the bf16 pair (1 + q/16): the nibble goes to mantissa bits 3..6.
template <int S>
__device__ __forceinline__ u32 nib_pair_bf16(u32 w) {
    const u32 v = S == 0 ? (w << 3) : (w >> (4 * S - 3));
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(v), "r"(0x00780078u), "r"(0x3F803F80u));  // (a & b) | c
    return r;
}

// Stages n floats of x (times `gain` when given; n % 64 == 0) as tensor-core B fragments into
// xf (n/64 * TCX_WORDS words) and the per-group sums into gsum; returns inv = 1/rms(x) (1
// without a gain: the caller scales the finished dot products, as with stage_x_fast). Warps
// from `skip` on stage groups round robin (warps below it are busy elsewhere, e.g. routing, and
// only meet the one barrier at the end). red: >= 33 floats.
__device__ float stage_x_tc(const float* __restrict__ x, int n, const float* __restrict__ gain, float eps, u32* xf,
                            float* gsum, float* red, int skip = 0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int t = lane >> 3, h = (lane >> 2) & 1, s = lane & 3;
    const int woff = (2 * h + (s >> 1)) * 24 + t * 2 + (s & 1);
    float ss = 0.f;
#pragma unroll 4
    for (int G = warp - skip; G >= 0 && G < (n >> 6); G += nw - skip) {
        const int c = 64 * G + 16 * t + 8 * h + s;
        float a0 = x[c], a1 = x[c + 4];
        ss += a0 * a0 + a1 * a1;
        if (gain) { a0 *= gain[c]; a1 *= gain[c + 4]; }
        const float gs = warp_sum(a0 + a1);
        if (lane == 0) gsum[G] = gs;
        const u32 w0 = pack_bf16(a0, a1);
        float r0 = a0 - __uint_as_float(w0 << 16), r1 = a1 - __uint_as_float(w0 & 0xffff0000u);
        const u32 w1 = pack_bf16(r0, r1);
        r0 -= __uint_as_float(w1 << 16);
        r1 -= __uint_as_float(w1 & 0xffff0000u);
        u32* o = xf + G * TCX_WORDS + woff;
        o[0] = w0;
        o[8] = w1;
        o[16] = pack_bf16(r0, r1);
    }
    return staged_inv_rms(ss, red, n, eps, gain != nullptr);
}

// Group j's bf16 of a row's scales/biases loaded 8 at a time (uint4).
// The word of v holding group j's bf16 (half j & 1 of it).
__device__ __forceinline__ u32 group_word(const uint4& v, int j) { return j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w; }
__device__ __forceinline__ float bf16_of(const uint4& v, int j) {
    const u32 w = group_word(v, j);
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
}

// The bf16 pair (v_j, v_j) of group j's scale or bias (v: 8 bf16, one per group of an item).
__device__ __forceinline__ u32 bf16x2_of(const uint4& v, int j) {
    const u32 w = group_word(v, j);
    return 0x10001u * ((j & 1) ? (w >> 16) : (w & 0xffffu));
}

// s*q + b for a bf16 pair of codes p (bf16 128 + q in each half: the codes OR'ed into 0x4300),
// with the scale and bias pairs s2 and b2: 128 + q - 128 is exact, then one fused multiply-add
// rounds s*q + b to bf16 once.
__device__ __forceinline__ u32 affine_bf16x2(u32 p, u32 s2, u32 b2) {
    u32 q, r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(p), "r"(0x3F803F80u), "r"(0xC300C300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(s2), "r"(b2));
    return r;
}
// Nibbles j and j + 4 of q as bf16 (128 + code) in the low and high half.
template <int J>
__device__ __forceinline__ u32 nib_magic_pair(u32 q) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(q >> (4 * J)), "r"(0x000F000Fu), "r"(0x43004300u));
    return r;
}

// The A fragment of mma step i (0..3) of one 64-column group, dequantised to bf16 (s*q + b
// rounded once): qa / qb are lane t's 16 codes of the group in rows g and g + 8 (columns 16t ..
// 16t + 15), (s, b) each row's scale and bias as bf16 pairs (v, v). Step i's k slots (2t, 2t + 1)
// hold the columns 16t + 8(i >> 1) + 2(i & 1) + (0, 4), slots (2t + 8, 2t + 9) the next column
// pair (+ 1, + 5): the activation operand must be laid out the same way (stage_tcb, stage_wg).
__device__ __forceinline__ void affine_a_frag(uint2 qa, uint2 qb, int i, u32 sa, u32 ba, u32 sb, u32 bb, u32 (&a)[4]) {
    const u32 wa = i < 2 ? qa.x : qa.y, wb = i < 2 ? qb.x : qb.y;
    if (i & 1) {
        a[0] = affine_bf16x2(nib_magic_pair<2>(wa), sa, ba); a[1] = affine_bf16x2(nib_magic_pair<2>(wb), sb, bb);
        a[2] = affine_bf16x2(nib_magic_pair<3>(wa), sa, ba); a[3] = affine_bf16x2(nib_magic_pair<3>(wb), sb, bb);
    } else {
        a[0] = affine_bf16x2(nib_magic_pair<0>(wa), sa, ba); a[1] = affine_bf16x2(nib_magic_pair<0>(wb), sb, bb);
        a[2] = affine_bf16x2(nib_magic_pair<1>(wa), sa, ba); a[3] = affine_bf16x2(nib_magic_pair<1>(wb), sb, bb);
    }
}

// One warp's work item: rows r0 + g and r0 + g + 8 (lane g = lane/4) of a 4-bit matrix
// [rows][cols] (group 64) over the groups [G0, G1) (G1 - G0 <= TC_NG). tc_load issues every
// load of the item (codes, scales, biases) into registers, so a caller can start them before
// its activation prologue; tc_mma then multiplies them with the staged activation.
// Rows past `rows` load nothing and add zero.
struct TcItem {
    uint2 qa[TC_NG], qb[TC_NG];  // codes of rows g and g + 8: lane t's 16 columns of each group
    uint4 sa, sb, ba, bb;        // bf16 scales / biases of the item's groups (one per 16 bits)
};

// Fragment order (FRAG): 4-bit codes (group 64) permuted within each 16-row tile so that group G
// of a tile is 512 contiguous bytes, lane l = 4g + t's 16 of them its (qa, qb) of that group: one
// coalesced 16-byte load per lane and group instead of two 8-byte loads that touch 16 rows. The
// tiles stay where their rows were (a tile's 16 rows are one contiguous run either way), the last
// one padded to 16 rows. frag_word: where word wi (codes 8wi..8wi + 7) of row `row` lives.
__device__ __forceinline__ size_t frag_word(size_t row, int wi, int cols) {
    const size_t gpr = (size_t)cols >> 6;
    return ((((row >> 4) * gpr + (wi >> 3)) * 32 + 4 * (row & 7) + ((wi & 7) >> 1)) << 2) + ((row >> 2) & 2) + (wi & 1);
}
template <bool FRAG = false>
__device__ __forceinline__ void tc_load(TcItem& it, const u32* __restrict__ w, const u16* __restrict__ sc,
                                        const u16* __restrict__ bi, int rows, int r0, int cols, int G0, int G1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int gpr = cols >> 6;
    const int ra = r0 + g, rb = ra + 8;
    const bool va = ra < rows, vb = rb < rows;
    const size_t wpr = (size_t)cols >> 3;
    if constexpr (FRAG) {
        const uint4* p = reinterpret_cast<const uint4*>(w + (size_t)r0 * wpr) + (size_t)G0 * 32 + lane;
#pragma unroll
        for (int j = 0; j < TC_NG; ++j) {
            const uint4 v = (va && G0 + j < G1) ? __ldg(p + 32 * j) : make_uint4(0u, 0u, 0u, 0u);
            it.qa[j] = make_uint2(v.x, v.y);
            it.qb[j] = make_uint2(v.z, v.w);
        }
    } else {
        const uint2* pa = reinterpret_cast<const uint2*>(w + (size_t)ra * wpr + 8 * G0) + t;
        const uint2* pb = reinterpret_cast<const uint2*>(w + (size_t)rb * wpr + 8 * G0) + t;
#pragma unroll
        for (int j = 0; j < TC_NG; ++j) {
            const bool in = G0 + j < G1;
            it.qa[j] = (va && in) ? __ldg(pa + 4 * j) : make_uint2(0u, 0u);
            it.qb[j] = (vb && in) ? __ldg(pb + 4 * j) : make_uint2(0u, 0u);
        }
    }
    // One uint4 per row when the item is 8 whole, 16-byte aligned groups (every 35B matrix),
    // one uint2 for 4 aligned groups (the 35B's down rows split over two warps), else one bf16
    // at a time.
    it.sa = it.sb = it.ba = it.bb = make_uint4(0u, 0u, 0u, 0u);
    if ((gpr & 3) == 0 && (G0 & 3) == 0 && G1 - G0 == 4) {
        auto ld2 = [](const u16* p) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
            return make_uint4(v.x, v.y, 0u, 0u);
        };
        if (va) {
            it.sa = ld2(sc + (size_t)ra * gpr + G0);
            it.ba = ld2(bi + (size_t)ra * gpr + G0);
        }
        if (vb) {
            it.sb = ld2(sc + (size_t)rb * gpr + G0);
            it.bb = ld2(bi + (size_t)rb * gpr + G0);
        }
    } else if ((gpr & 7) == 0 && (G0 & 7) == 0 && G1 - G0 == TC_NG) {
        if (va) {
            it.sa = __ldg(reinterpret_cast<const uint4*>(sc + (size_t)ra * gpr + G0));
            it.ba = __ldg(reinterpret_cast<const uint4*>(bi + (size_t)ra * gpr + G0));
        }
        if (vb) {
            it.sb = __ldg(reinterpret_cast<const uint4*>(sc + (size_t)rb * gpr + G0));
            it.bb = __ldg(reinterpret_cast<const uint4*>(bi + (size_t)rb * gpr + G0));
        }
    } else {
        u32 v[4][TC_NG / 2];
#pragma unroll
        for (int j = 0; j < TC_NG; j += 2) {
            u32 e[4][2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const bool in = G0 + j + u < G1;
                const size_t ga = (size_t)ra * gpr + G0 + j + u, gb = (size_t)rb * gpr + G0 + j + u;
                e[0][u] = (va && in) ? (u32)sc[ga] : 0u;
                e[1][u] = (vb && in) ? (u32)sc[gb] : 0u;
                e[2][u] = (va && in) ? (u32)bi[ga] : 0u;
                e[3][u] = (vb && in) ? (u32)bi[gb] : 0u;
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) v[m][j / 2] = e[m][0] | (e[m][1] << 16);
        }
        it.sa = make_uint4(v[0][0], v[0][1], v[0][2], v[0][3]);
        it.sb = make_uint4(v[1][0], v[1][1], v[1][2], v[1][3]);
        it.ba = make_uint4(v[2][0], v[2][1], v[2][2], v[2][3]);
        it.bb = make_uint4(v[3][0], v[3][1], v[3][2], v[3][3]);
    }
}

// The A fragment (rows g, g + 8; the k slots of step i) of group j of the item: the bf16 pairs
// (1 + q/16) of the nibbles that step i's B holds x of.
__device__ __forceinline__ void tc_a_frag(uint2 qa, uint2 qb, int i, u32 (&a)[4]) {
    const u32 wa = i < 2 ? qa.x : qa.y, wb = i < 2 ? qb.x : qb.y;
    if (i & 1) {
        a[0] = nib_pair_bf16<2>(wa); a[1] = nib_pair_bf16<2>(wb);
        a[2] = nib_pair_bf16<3>(wa); a[3] = nib_pair_bf16<3>(wb);
    } else {
        a[0] = nib_pair_bf16<0>(wa); a[1] = nib_pair_bf16<0>(wb);
        a[2] = nib_pair_bf16<1>(wa); a[3] = nib_pair_bf16<1>(wb);
    }
}
__device__ __forceinline__ void tc_a_frag(const TcItem& it, int j, int i, u32 (&a)[4]) { tc_a_frag(it.qa[j], it.qb[j], i, a); }

// tc_mma's groups j < n (N: the unroll; with CHECK, j >= n is skipped, warp-uniform). xg0 and
// gs0 point at the item's first group. The bias term goes to lane t = 0 only, through the group
// sum scaled by 0 or 1 (no branch).
template <int N, bool CHECK>
__device__ __forceinline__ void tc_mma_n(const TcItem& it, const u32* xg0, const float* gs0, int n, float wscale,
                                         float& acc0, float& acc1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float tz = t == 0 ? 1.f : 0.f;
    const bool bx_on = g < 3;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (!CHECK || j < n) {
            const u32* xg = xg0 + j * TCX_WORDS;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 a[4];
                tc_a_frag(it, j, i, a);
                const uint2 bx = bx_on ? *reinterpret_cast<const uint2*>(xg + i * 24) : make_uint2(0u, 0u);
                mma_bf16(c, a, bx.x, bx.y);
            }
            const float s0 = 16.f * wscale * bf16_of(it.sa, j), s1 = 16.f * wscale * bf16_of(it.sb, j);
            const float gs = gs0[j] * tz;
            acc0 = fmaf(s0, c[0] + c[1], acc0);
            acc1 = fmaf(s1, c[2] + c[3], acc1);
            acc0 = fmaf(fmaf(bf16_of(it.ba, j), wscale, -s0), gs, acc0);
            acc1 = fmaf(fmaf(bf16_of(it.bb, j), wscale, -s1), gs, acc1);
        }
    }
}

// The item against the staged activation: xf/gsum are the fragments and group sums of the
// vector whose group 0 meets the matrix's group 0. Adds this lane's share, times wscale, to
// acc0 (row r0 + g) and acc1 (row r0 + g + 8); the row's dot product is the sum over the 4
// lanes t (t = 2, 3 add exactly zero, so acc += shfl_xor(acc, 1) leaves it in lane t = 0).
// Whole items of 8 or 4 groups (every 35B matrix) run without per-group checks.
__device__ __forceinline__ void tc_mma(const TcItem& it, const u32* xf, const float* gsum, int G0, int G1,
                                       float wscale, float& acc0, float& acc1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32* xg0 = xf + G0 * TCX_WORDS + g * 8 + 2 * t;
    const int n = G1 - G0;
    if (n == TC_NG) tc_mma_n<TC_NG, false>(it, xg0, gsum + G0, n, wscale, acc0, acc1);
    else if (n == 4) tc_mma_n<4, false>(it, xg0, gsum + G0, n, wscale, acc0, acc1);
    else tc_mma_n<TC_NG, true>(it, xg0, gsum + G0, n, wscale, acc0, acc1);
}

// The tile's lane partials summed over t (into lanes t = 0).
__device__ __forceinline__ void tc_reduce(float& acc0, float& acc1) {
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
}

// Tokens per pf_gemm_tc tile (qmatmul.cu); pf_scan (moe.cu) lists the grouped-mode tiles in
// these units.
#define TC_BN 64

// ---- batched decode on tensor cores (B tokens, bf16 activations): gemv_tcb, moe_tcb ----
// The decode GEMV's weight path (TcItem: codes, scales and biases of 16 rows x 512 columns in
// registers; one wave of warps streams the matrix) with up to TCB_TOK tokens of bf16 activations
// as the mma's B columns (8 tokens per n8 tile) instead of the three split terms of one f32
// token: every weight read serves all the block's tokens. Per 64-column group and token the
// result is s*sum(q x) + b*sum(x) over the bf16-rounded x with f32 accumulation:
// C = sum (1 + q/16) x (exact products), then 16 s C + (b - 16 s) gsum, where gsum is the group
// sum of the same bf16 values. A token's result depends only on its own row, so it is the same in
// any batch.
//
// Fragments in shared memory: word ((tg * gpr + G) * 4 + i) * 64 + n * 8 + t * 2 + reg holds the
// bf16 pair (column 64G + 16t + 8h + s, + 4), h = i/2, s = 2(i&1) + reg, of token 8 tg + n (the
// pairs of gemv_tc's layout, one token per B column): lane (g, t) loads its B of step i and
// token group tg as one uint2 at ((tg * gpr + G) * 4 + i) * 64 + g * 8 + 2t.
#define TCB_TOK 16       // tokens per block pass (two n8 token groups)
#define TCB_WORDS 256    // fragment words per 64-column group and token group

// The word of row (token) r's pair (i, t, reg) of group G in that layout, gpr groups per row.
__device__ __forceinline__ size_t tcb_word(int r, int gpr, int G, int i, int t, int reg) {
    return (((size_t)(r >> 3) * gpr + G) * 4 + i) * 64 + (r & 7) * 8 + t * 2 + reg;
}

// Staged activations (stage_tcb in qmatmul.cu) live in global memory in the same layout, indexed
// by global token group (row >> 3), with the group sums beside them (gsum[row * gpr + G]); a
// block copies its tokens' fragments into shared memory with 16-byte asynchronous copies, and
// their group sums token-minor (gsum[G * ntok + j], ntok = 8 or 16 the block's token columns), so
// the four lanes t of an mma read their tokens' pair as one conflict-free float2.
//
// 16 bytes global -> shared (a shared-space address), asynchronously; commit; wait until at most N
// of this thread's committed groups are in flight.
__device__ __forceinline__ void cp_async16(unsigned s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
// The same to a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16(smem_u32(dst), src); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// The same, writing 16 zero bytes instead where `on` is false (nothing is read).
__device__ __forceinline__ void cp_async16z(unsigned s, const void* g, bool on) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(on ? 16 : 0) : "memory");
}

// 4 bytes global -> shared through L1 (the 16-byte .cg form has no smaller size), zeros where `on`
// is false.
__device__ __forceinline__ void cp_async4z(unsigned s, const void* g, bool on) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(g), "r"(on ? 4 : 0) : "memory");
}

__device__ __forceinline__ void tcb_cp_wait_all() {
    cp_commit();
    cp_wait<0>();
}

// Copies the staged rows rows[j] (or row j0 + j without `rows`) for tokens j < nt into the block's
// fragments xf and group sums gsum, then waits and syncs. Token columns nt..ntok - 1 keep whatever
// they held: an mma's output column depends on its B column alone, and those outputs are never
// stored.
__device__ void load_tokens_tc(const u32* __restrict__ frag, const float* __restrict__ gs_in, int cols, int j0,
                               int nt, const int* rows, u32* xf, float* gsum) {
    const int gpr = cols >> 6, ntok = nt > 8 ? TCB_TOK : 8;
    // 16-byte pieces: (token, group, step i, half) -> 4 words of the token's 8 in that record.
    // A token's pieces are gpr * 8 (a power of two at the model's widths: shifts, not divisions,
    // on the copy's issue path); piece q lies at the same offset (G, i, half) in the source's and
    // the destination's 8-token records.
    const int per_tok = gpr * 8;
    const bool pow2 = (per_tok & (per_tok - 1)) == 0;
    const int shift = __ffs(per_tok) - 1;
    for (int p = threadIdx.x; p < nt * per_tok; p += blockDim.x) {
        const int j = pow2 ? p >> shift : p / per_tok, q = pow2 ? p & (per_tok - 1) : p % per_tok;
        const int G = q >> 3, i = (q >> 1) & 3, h = q & 1;
        const int in_rec = (G * 4 + i) * 64 + h * 4;
        const int r = rows ? rows[j] : j0 + j;
        cp_async16(xf + (size_t)(j >> 3) * gpr * TCB_WORDS + in_rec + (j & 7) * 8,
                   frag + (size_t)(r >> 3) * gpr * TCB_WORDS + in_rec + (r & 7) * 8);
    }
    for (int p = threadIdx.x; p < nt * gpr; p += blockDim.x) {
        const int j = p % nt, G = p / nt;
        gsum[G * ntok + j] = gs_in[(size_t)(rows ? rows[j] : j0 + j) * gpr + G];
    }
    tcb_cp_wait_all();
    __syncthreads();
}

// load_tokens_tc of the consecutive staged rows j0.. (j0 a multiple of 8): their 8-token groups
// lie in the staging as in the block's fragments, so the copy is one contiguous run of whole
// groups (rows nt..ceil8(nt) - 1 come along: the staging has them, and their columns' outputs are
// never stored).
__device__ void load_token_block_tc(const u32* __restrict__ frag, const float* __restrict__ gs_in, int cols, int j0,
                                    int nt, u32* xf, float* gsum) {
    const int gpr = cols >> 6, ntok = nt > 8 ? TCB_TOK : 8;
    const int pieces = ((nt + 7) >> 3) * gpr * (TCB_WORDS / 4);
    const u32* src = frag + (size_t)(j0 >> 3) * gpr * TCB_WORDS;
    for (int p = threadIdx.x; p < pieces; p += blockDim.x) cp_async16(xf + 4 * p, src + 4 * p);
    for (int p = threadIdx.x; p < nt * gpr; p += blockDim.x) {
        const int j = p % nt, G = p / nt;
        gsum[G * ntok + j] = gs_in[(size_t)(j0 + j) * gpr + G];
    }
    tcb_cp_wait_all();
    __syncthreads();
}

// Group G of rows g and g + 8 (codes qa / qb: lane t's 16 columns; the bf16 scales and biases
// in half `hi` of the words sa / sb and ba / bb) against NTG staged token groups: adds lane
// (g, t)'s outputs (row g, row g + 8) x (token 2t, 2t + 1) of token group tg into acc[tg][0..3] =
// (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
template <int NTG>
__device__ __forceinline__ void tcb_group(uint2 qa, uint2 qb, u32 sa, u32 sb, u32 ba, u32 bb, bool hi, int G,
                                          const u32* xf, const float* gsum, int gpr, float (&acc)[NTG][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float c[NTG][4];
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) c[tg][0] = c[tg][1] = c[tg][2] = c[tg][3] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 a[4];
        tc_a_frag(qa, qb, i, a);
#pragma unroll
        for (int tg = 0; tg < NTG; ++tg) {
            const uint2 bx = *reinterpret_cast<const uint2*>(xf + ((tg * gpr + G) * 4 + i) * 64 + g * 8 + 2 * t);
            mma_bf16(c[tg], a, bx.x, bx.y);
        }
    }
    auto bf = [hi](u32 w) { return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16)); };
    const float s0 = 16.f * bf(sa), s1 = 16.f * bf(sb);
    const float b0 = bf(ba) - s0, b1 = bf(bb) - s1;
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) {
        const float2 gs = *reinterpret_cast<const float2*>(gsum + G * (8 * NTG) + tg * 8 + 2 * t);
        const float gs0 = gs.x, gs1 = gs.y;
        acc[tg][0] += fmaf(s0, c[tg][0], b0 * gs0);
        acc[tg][1] += fmaf(s0, c[tg][1], b0 * gs1);
        acc[tg][2] += fmaf(s1, c[tg][2], b1 * gs0);
        acc[tg][3] += fmaf(s1, c[tg][3], b1 * gs1);
    }
}

// The item (rows r0 + g and r0 + g + 8 over the groups [G0, G1)) against NTG staged token groups
// (tcb_group per group).
template <int NTG>
__device__ __forceinline__ void tcb_mma(const TcItem& it, const u32* xf, const float* gsum, int gpr, int G0, int G1,
                                        float (&acc)[NTG][4]) {
#pragma unroll
    for (int j = 0; j < TC_NG; ++j) {
        const int G = G0 + j;
        if (G >= G1) break;  // warp-uniform
        tcb_group<NTG>(it.qa[j], it.qb[j], group_word(it.sa, j), group_word(it.sb, j), group_word(it.ba, j),
                       group_word(it.bb, j), j & 1, G, xf, gsum, gpr, acc);
    }
}

// ---- weight rings (moe_tcr): each warp streams its rows' codes, scales and biases
// through TCR_DEPTH stages of TCR_GROUPS 64-column groups in shared memory (cp.async), so
// TCR_DEPTH - 1 stages stay in flight while it multiplies the current one (tcb_group per group,
// in group order: the products of tcb_tile, bit for bit).
#define TCR_GROUPS 2
#define TCR_DEPTH 4
// A stage row's codes, padded by 16 bytes so the 8 rows of a warp's uint2 reads fall on distinct
// banks (2 wavefronts per read); then per row the stage's scales and biases (TCR_GROUPS bf16 each).
#define TCR_ROW_BYTES (TCR_GROUPS * 32 + 16)
#define TCR_STAGE_BYTES (16 * TCR_ROW_BYTES + 16 * TCR_GROUPS * 4)

// One warp's copies of one matrix for the ring (tcr_issue): each lane's source addresses at group
// 0 of rows r0..r0 + 15 (rows from r_end on read row 0 and copy zeros), so that a stage's copies
// add the stage's group offset instead of forming the row products again.
// FRAG: the codes of a tile in fragment order (tc_load), whole tiles: the stage's groups are
// TCR_GROUPS * 512 contiguous bytes, copied as they lie (lane u's 16 bytes and u + 32's); and `s`
// holds the scales and biases in stage order (`b` is not read): per 16-row tile and stage, each
// row's [scales | biases] of the stage's groups as the stage lays them out, 128 contiguous bytes
// (weights.rs `stage_order_scales`), lanes 0-7 copying 16 bytes each, where a row-order row's
// are 4 bytes in each of 16 rows' 64 (one sector apiece). Else (row-order codes) lane u copies
// 16 bytes of row u / 4 (and u / 4 + 8), part u % 4 of the stage's 64, and lanes 0-15 the scales
// of row `lane`, lanes 16-31 its biases (TCR_GROUPS = 2: 4 bytes each).
// SO (scales in stage order; FRAG only): false takes fragment-order codes with row-order scales
// and biases, copied as the row-order codes' are (the down products, which have no stage-order
// copy).
template <bool FRAG, bool SO = FRAG>
struct TcrSrc {
    const char* c0;  // the lane's first 16 bytes of codes
    const char* c1;  // its second
    const char* sb;  // its scales / biases
    bool on0, on1, ons;
    __device__ __forceinline__ TcrSrc(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
                                      int r0, int r_end, int cols) {
        const int lane = threadIdx.x & 31, gpr = cols >> 6;
        const size_t wpr = (size_t)cols >> 3;
        if constexpr (FRAG && !SO) {
            const int srow = lane & 15;
            on0 = on1 = r0 < r_end;
            ons = r0 + srow < r_end;
            c0 = reinterpret_cast<const char*>(w + (size_t)(on0 ? r0 : 0) * wpr) + lane * 16;
            c1 = c0 + 512;
            sb = reinterpret_cast<const char*>((lane < 16 ? s : b) + (size_t)(ons ? r0 + srow : 0) * gpr);
        } else if constexpr (FRAG) {
            on0 = on1 = ons = r0 < r_end;
            c0 = reinterpret_cast<const char*>(w + (size_t)(on0 ? r0 : 0) * wpr) + lane * 16;
            c1 = c0 + 512;
            sb = reinterpret_cast<const char*>(s) + ((size_t)(on0 ? r0 : 0) >> 4) * (gpr / TCR_GROUPS) * (16 * TCR_GROUPS * 4) + lane * 16;
        } else {
            const int row = lane >> 2, part = lane & 3, srow = lane & 15;
            on0 = r0 + row < r_end;
            on1 = r0 + row + 8 < r_end;
            ons = r0 + srow < r_end;
            c0 = reinterpret_cast<const char*>(w + (size_t)(on0 ? r0 + row : 0) * wpr + 4 * part);
            c1 = reinterpret_cast<const char*>(w + (size_t)(on1 ? r0 + row + 8 : 0) * wpr + 4 * part);
            sb = reinterpret_cast<const char*>((lane < 16 ? s : b) + (size_t)(ons ? r0 + srow : 0) * gpr);
        }
    }
};
static_assert(TCR_GROUPS == 2, "TcrSrc copies a row's stage scales (and biases) as one 4-byte piece");

// Issues the copies of groups [G, G + TCR_GROUPS) of the warp's rows (`a`, or `b` where
// `second`: chosen field by field, so neither needs an address) into the stage at shared address
// `dst`, and commits them as one group.
template <bool FRAG, bool SO = FRAG>
__device__ __forceinline__ void tcr_issue(unsigned dst, const TcrSrc<FRAG, SO>& a, const TcrSrc<FRAG, SO>& b, bool second, int G) {
    const int lane = threadIdx.x & 31;
    struct {
        const char *c0, *c1, *sb;
        bool on0, on1, ons;
    } src = {second ? b.c0 : a.c0, second ? b.c1 : a.c1, second ? b.sb : a.sb,
             second ? b.on0 : a.on0, second ? b.on1 : a.on1, second ? b.ons : a.ons};
    if constexpr (FRAG && !SO) {
        const size_t c = (size_t)G * 512;
        cp_async16z(dst + lane * 16, src.c0 + c, src.on0);
        cp_async16z(dst + lane * 16 + 512, src.c1 + c, src.on1);
        const int srow = lane & 15;
        cp_async4z(dst + 16 * TCR_ROW_BYTES + srow * (TCR_GROUPS * 4) + (lane >> 4) * (TCR_GROUPS * 2), src.sb + (size_t)G * 2, src.ons);
    } else if constexpr (FRAG) {
        const size_t c = (size_t)G * 512;
        cp_async16z(dst + lane * 16, src.c0 + c, src.on0);
        cp_async16z(dst + lane * 16 + 512, src.c1 + c, src.on1);
        if (lane < 8) cp_async16z(dst + 16 * TCR_ROW_BYTES + lane * 16, src.sb + (size_t)G * (16 * 4), src.ons);
    } else {
        const int row = lane >> 2, part = lane & 3, srow = lane & 15;
        const size_t c = (size_t)G * 32;
        cp_async16z(dst + row * TCR_ROW_BYTES + part * 16, src.c0 + c, src.on0);
        cp_async16z(dst + (row + 8) * TCR_ROW_BYTES + part * 16, src.c1 + c, src.on1);
        cp_async4z(dst + 16 * TCR_ROW_BYTES + srow * (TCR_GROUPS * 4) + (lane >> 4) * (TCR_GROUPS * 2), src.sb + (size_t)G * 2, src.ons);
    }
    cp_commit();
}

// The stage at `st` (groups G0..) into acc, in group order.
template <int NTG, bool FRAG = false>
__device__ __forceinline__ void tcr_stage(const unsigned char* st, int G0, const u32* xf, const float* gsum, int gpr,
                                          float (&acc)[NTG][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint2 ra = *reinterpret_cast<const uint2*>(st + 16 * TCR_ROW_BYTES + g * (TCR_GROUPS * 4));
    const uint2 rb = *reinterpret_cast<const uint2*>(st + 16 * TCR_ROW_BYTES + (g + 8) * (TCR_GROUPS * 4));
#pragma unroll
    for (int j = 0; j < TCR_GROUPS; ++j) {
        uint2 qa, qb;
        if constexpr (FRAG) {
            const uint4 v = *reinterpret_cast<const uint4*>(st + j * 512 + lane * 16);
            qa = make_uint2(v.x, v.y);
            qb = make_uint2(v.z, v.w);
        } else {
            qa = *reinterpret_cast<const uint2*>(st + g * TCR_ROW_BYTES + j * 32 + t * 8);
            qb = *reinterpret_cast<const uint2*>(st + (g + 8) * TCR_ROW_BYTES + j * 32 + t * 8);
        }
        tcb_group<NTG>(qa, qb, ra.x, rb.x, ra.y, rb.y, j & 1, G0 + j, xf, gsum, gpr, acc);
    }
}
static_assert(TCR_GROUPS * 512 <= 16 * TCR_ROW_BYTES, "a fragment-order stage's codes fit the row layout's");

// The whole K of one 16-row tile (kc chunks of TC_NG groups from group G0) against the staged
// tokens.
template <int NTG, bool FRAG = false>
__device__ __forceinline__ void tcb_tile(const u32* __restrict__ w, const u16* __restrict__ s,
                                         const u16* __restrict__ b, int rows, int r0, int cols, int G0, int kc,
                                         const u32* xf, const float* gsum, float (&acc)[NTG][4]) {
    const int gpr = cols >> 6, lane = threadIdx.x & 31;
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
    if constexpr (FRAG) {
        // The tile's later chunks are contiguous: 128-byte lines spread over the lanes.
        if (kc > 1 && r0 < rows) {
            const char* p = reinterpret_cast<const char*>(w + (size_t)r0 * (cols >> 3)) + (size_t)(G0 + TC_NG) * 512;
            for (int off = lane * 128; off < (kc - 1) * TC_NG * 512; off += 32 * 128) prefetch_l2(p + off);
        }
    } else if (kc > 1 && lane < 16 && r0 + lane < rows) {
        // The later chunks of the tile's 16 rows into L2 while the first is loaded and computed.
        const char* p = reinterpret_cast<const char*>(w + (size_t)(r0 + lane) * (cols >> 3)) + (size_t)(G0 + TC_NG) * 32;
        for (int off = 0; off < (kc - 1) * TC_NG * 32; off += 128) prefetch_l2(p + off);
    }
    TcItem it;
    for (int k = 0; k < kc; ++k) {
        const int g0 = G0 + k * TC_NG, g1 = min(gpr, g0 + TC_NG);
        tc_load<FRAG>(it, w, s, b, rows, r0, cols, g0, g1);
        tcb_mma<NTG>(it, xf, gsum, gpr, g0, g1, acc);
    }
}
