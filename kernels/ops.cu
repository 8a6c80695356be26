// Elementwise / per-row ops that belong to no other family.
//   prefill (T tokens): pf_rmsnorm, pf_swiglu
//   decode loops:       readback_words
//   sequence memory:    copy_words16
// (In decode every RMSNorm is fused into the kernel that consumes it: the GEMV prologues,
// attn_prep, gdn_step.)

// RMSNorm of each row (x * inv * gain, as ops::rms_norm), one block per row in float4s (n a
// multiple of 4; common.cuh NORM_THREADS): float4s past the NORM_V a thread keeps are read again
// for the second pass. With `staged` (not null) the outputs also go there in bf16, as pf_to_bf16
// would stage `out` for the cuBLAS GEMMs (the same words: round to nearest even of the same
// values), without a second kernel reading `out` back. grid (rows), block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
pf_rmsnorm(const float* __restrict__ x, const float* __restrict__ gain, float* __restrict__ out, int rows, int n,
           float eps, uint2* __restrict__ staged) {
    __shared__ float red[33];
    const int row = blockIdx.x, tid = threadIdx.x, n4 = n / 4;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)row * n);
    const float4* gr = reinterpret_cast<const float4*>(gain);
    float4* orow = reinterpret_cast<float4*>(out + (size_t)row * n);
    uint2* srow = staged ? staged + (size_t)row * n4 : nullptr;
    float4 v[NORM_V];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_V; ++i) {
        const int c = tid + NORM_THREADS * i;
        v[i] = c < n4 ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += sq4(v[i]);
    }
    for (int c = tid + NORM_THREADS * NORM_V; c < n4; c += NORM_THREADS) ss += sq4(xr[c]);
    const float inv = inv_rms_from(block_sum(ss, red), n, eps);
    auto put = [&](int c, float4 u) {
        const float4 o = norm4(u, inv, gr[c]);
        orow[c] = o;
        if (srow) srow[c] = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
    };
#pragma unroll
    for (int i = 0; i < NORM_V; ++i) {
        const int c = tid + NORM_THREADS * i;
        if (c < n4) put(c, v[i]);
    }
    for (int c = tid + NORM_THREADS * NORM_V; c < n4; c += NORM_THREADS) put(c, xr[c]);
}

// g = silu(g) * u, elementwise.
extern "C" __global__ void pf_swiglu(float* __restrict__ g, const float* __restrict__ u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu_f(g[i]) * u[i];
}

// The tokens of a decode step into pinned host memory mapped into the device (the loops'
// readback slots): written by the SMs over the bus, not by a copy engine, so they never queue
// behind a long device-to-host copy on another stream (the prefix cache's moves to its host
// tier). The fence makes the words visible to the host before the kernel completes, i.e. before
// the event recorded after it. grid 1, block 256.
extern "C" __global__ void readback_words(const int* __restrict__ src, int n, volatile int* __restrict__ host) {
    tl_stamp();  // the timeline's stamp at entry (launched in order)
    for (int i = threadIdx.x; i < n; i += blockDim.x) host[i] = src[i];
    __threadfence_system();
}

// dst = src over n 16-byte words (device to device): the sequence memory's snapshot copies on
// the SMs, not on a copy engine, where they would queue behind the prefix cache's long copies to
// host memory on another stream. grid-stride, block 256.
extern "C" __global__ void copy_words16(const uint4* __restrict__ src, uint4* __restrict__ dst, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
