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

// One row of an MLX affine-quantized matrix (bits 4 or 8, `group` columns per scale/bias pair)
// times the activation vector `xs` (shared memory, `cols` floats), with the bias folded per group:
// sum((s q + b) x) = s sum(q x) + b sum(x); `gsum` holds sum(x) per group (shared memory).
// Called by all 32 lanes of a warp; returns the full dot product in every lane.
__device__ __forceinline__ float qrow_dot(const u32* __restrict__ wr, const u16* __restrict__ sr,
                                         const u16* __restrict__ br, const float* xs, const float* gsum,
                                         int cols, int bits, int group) {
    int lane = threadIdx.x & 31;
    float acc = 0.f;
    if (bits == 4) {
        int wpr = cols >> 3, wpg = group >> 3;
#pragma unroll 4
        for (int wi = lane; wi < wpr; wi += 32) {
            u32 q = __ldg(wr + wi);
            const float4* xp = reinterpret_cast<const float4*>(xs + (wi << 3));
            float4 a = xp[0], b = xp[1];
            float d = (float)(q & 15u) * a.x + (float)((q >> 4) & 15u) * a.y + (float)((q >> 8) & 15u) * a.z +
                      (float)((q >> 12) & 15u) * a.w + (float)((q >> 16) & 15u) * b.x + (float)((q >> 20) & 15u) * b.y +
                      (float)((q >> 24) & 15u) * b.z + (float)(q >> 28) * b.w;
            int g = wi / wpg;
            acc += bf16f(__ldg(sr + g)) * d;
            if (wi - g * wpg == 0) acc += bf16f(__ldg(br + g)) * gsum[g];
        }
    } else {
        int wpr = cols >> 2, wpg = group >> 2;
#pragma unroll 4
        for (int wi = lane; wi < wpr; wi += 32) {
            u32 q = __ldg(wr + wi);
            float4 a = *reinterpret_cast<const float4*>(xs + (wi << 2));
            float d = (float)(q & 255u) * a.x + (float)((q >> 8) & 255u) * a.y + (float)((q >> 16) & 255u) * a.z +
                      (float)(q >> 24) * a.w;
            int g = wi / wpg;
            acc += bf16f(__ldg(sr + g)) * d;
            if (wi - g * wpg == 0) acc += bf16f(__ldg(br + g)) * gsum[g];
        }
    }
    return warp_sum(acc);
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
    for (int c = threadIdx.x; c < n; c += blockDim.x) xs[c] = gain ? x[c] * inv * gain[c] : x[c];
    __syncthreads();
    for (int g = threadIdx.x; g < n / group; g += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < group; ++j) s += xs[g * group + j];
        gsum[g] = s;
    }
    __syncthreads();
}

#define NEG_INF __int_as_float(0xff800000u)
