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
// values), without a second kernel reading `out` back. With `wg` (not null; n a multiple of 64)
// they also go there as the wgmma expert kernels' staged input (stage_wg's words of the same
// values, moe.cu), so the experts need no stage_wg launch reading `out` back.
// grid (rows), block NORM_THREADS.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
pf_rmsnorm(const float* __restrict__ x, const float* __restrict__ gain, float* __restrict__ out, int rows, int n,
           float eps, uint2* __restrict__ staged, u32* __restrict__ wg) {
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
    u32* wrow = wg ? wg + (size_t)row * (n / 2) : nullptr;
    // Called by every lane of the warp (the shuffles), `on` for float4s of the row. stage_wg's
    // word of columns (col, col + 4) of an 8-column run: float4 c (even) holds the run's first
    // four columns, c + 1 (lane ^ 1: NORM_THREADS and n4 are even) the next four; the even lane
    // stores the words of columns 0 and 1 of the run, the odd one those of 2 and 3.
    auto put = [&](int c, float4 u, bool on) {
        const float4 o = norm4(u, inv, on ? gr[c] : make_float4(0.f, 0.f, 0.f, 0.f));
        if (on) {
            orow[c] = o;
            if (srow) srow[c] = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
        }
        if (!wrow) return;
        const float4 p = make_float4(__shfl_xor_sync(0xffffffffu, o.x, 1), __shfl_xor_sync(0xffffffffu, o.y, 1),
                                     __shfl_xor_sync(0xffffffffu, o.z, 1), __shfl_xor_sync(0xffffffffu, o.w, 1));
        if (!on) return;
        const int col = 8 * (c >> 1), G = col >> 6, cg = col & 63, t = cg >> 4, h = (cg >> 3) & 1;
        const int w0 = 32 * G + 16 * h + t;
        if ((c & 1) == 0) {
            wrow[w0] = pack_bf16(o.x, p.x);
            wrow[w0 + 4] = pack_bf16(o.y, p.y);
        } else {
            wrow[w0 + 8] = pack_bf16(p.z, o.z);
            wrow[w0 + 12] = pack_bf16(p.w, o.w);
        }
    };
#pragma unroll
    for (int i = 0; i < NORM_V; ++i) {
        const int c = tid + NORM_THREADS * i;
        put(c, v[i], c < n4);
    }
    for (int c0 = NORM_THREADS * NORM_V; c0 < n4; c0 += NORM_THREADS) {
        const int c = c0 + tid;
        put(c, c < n4 ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f), c < n4);
    }
}

// g = silu(g) * u, elementwise; with `staged` (not null, n even) only as bf16 pairs there instead
// (pf_to_bf16's words of the same values: the operand of the cuBLAS GEMM that reads g next,
// Gemm::stage_input), so g is neither written nor read back. grid: n (or n / 2 staged) threads.
extern "C" __global__ void pf_swiglu(float* __restrict__ g, const float* __restrict__ u, int n, u32* __restrict__ staged) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (staged) {
        if (2 * i + 1 < n) staged[i] = pack_bf16(silu_f(g[2 * i]) * u[2 * i], silu_f(g[2 * i + 1]) * u[2 * i + 1]);
    } else if (i < n) {
        g[i] = silu_f(g[i]) * u[i];
    }
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
