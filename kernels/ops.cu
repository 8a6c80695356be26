// Elementwise / per-row ops that belong to no other family.
//   prefill (T tokens): pf_rmsnorm, pf_swiglu
// (In decode every RMSNorm is fused into the kernel that consumes it: the GEMV prologues,
// attn_prep, gdn_step.)

// RMSNorm of each row (x * inv * gain, as ops::rms_norm), one warp per row in float4s (n a
// multiple of 4): the second pass re-reads the row from L1. grid (ceil(rows / 8)), block 256.
extern "C" __global__ void pf_rmsnorm(const float* __restrict__ x, const float* __restrict__ gain, float* __restrict__ out,
                                      int rows, int n, float eps) {
    const int lane = threadIdx.x & 31, row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * n);
    const float4* gr = reinterpret_cast<const float4*>(gain);
    float4* orow = reinterpret_cast<float4*>(out + (size_t)row * n);
    float ss = 0.f;
    for (int c = lane; c < n / 4; c += 32) {
        const float4 v = xr[c];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float inv = inv_rms_from(warp_sum(ss), n, eps);
    for (int c = lane; c < n / 4; c += 32) {
        const float4 v = xr[c], g = gr[c];
        orow[c] = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
    }
}

// g = silu(g) * u, elementwise.
extern "C" __global__ void pf_swiglu(float* __restrict__ g, const float* __restrict__ u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu_f(g[i]) * u[i];
}
