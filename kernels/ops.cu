// Elementwise / per-row ops that belong to no other family.
//   prefill (T tokens): pf_rmsnorm, pf_swiglu
// (In decode every RMSNorm is fused into the kernel that consumes it: the GEMV prologues,
// attn_prep, gdn_step.)

// RMSNorm of each row (x * inv * gain, as ops::rms_norm): grid (rows), block 256.
extern "C" __global__ void pf_rmsnorm(const float* __restrict__ x, const float* __restrict__ gain, float* __restrict__ out,
                                      int n, float eps) {
    __shared__ float red[33];
    const float* xr = x + (size_t)blockIdx.x * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) { float v = xr[c]; ss += v * v; }
    ss = block_sum(ss, red);
    float inv = inv_rms_from(ss, n, eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[(size_t)blockIdx.x * n + c] = xr[c] * inv * gain[c];
}

// g = silu(g) * u, elementwise.
extern "C" __global__ void pf_swiglu(float* __restrict__ g, const float* __restrict__ u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu_f(g[i]) * u[i];
}
