// Quantized GEMV for decode (T = 1): several matrices that share one input vector in a single
// launch (GDN in_proj qkv|z|b|a, attention q|k|v, router + shared-expert gate, ...), with the
// input RMSNorm fused into the prologue and an optional residual accumulate in the epilogue.
// Fewer launches per token is what matters at batch 1 (kernels.md §4.3: the step is sync-bound).

struct QMat {
    const u32* w;   // [rows][cols*bits/32] MLX packed codes, low bits first
    const u16* s;   // [rows][cols/group] bf16 scales
    const u16* b;   // [rows][cols/group] bf16 biases
    float* y;       // [rows] output
    int rows;
    int bits;       // 4 or 8
    int accumulate; // 1: y += W x (residual add), 0: y = W x
    int pad;
};

#define STAGE_MAXK 8
// Measurement knobs (LILY_CUDA_NVRTC_DEFS=-DGEMV_FAST_STAGE=0 / -DGEMV_PAIR=0): the one-pass
// staging below, and the two-row inner loop (qrow_part2) of gemv_q.
#ifndef GEMV_FAST_STAGE
#define GEMV_FAST_STAGE 1
#endif
#ifndef GEMV_PAIR
#define GEMV_PAIR 1
#endif
// GEMV_MIN_BLOCKS: resident blocks per SM the register allocation must allow (256 threads).
// 3 caps gemv_q at 80 registers (8 bytes of stack): without it the I2F-free dequant grew it to 86,
// two blocks per SM, and the big sets (GDN in_proj, q|k|v, lm_head) lost a third of their warps:
// 325.4 -> 335.2 tok/s decode at 4K on the H200 (2026-11-29, same digest, GPU tests 18/18).
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 3
#endif
#if GEMV_MIN_BLOCKS > 0
#define GEMV_BOUNDS __launch_bounds__(256, GEMV_MIN_BLOCKS)
#else
#define GEMV_BOUNDS
#endif
// Dynamic shared memory: cols + cols/group + 33 floats.
// Each warp owns one row at a time and walks the concatenated rows of all matrices.
extern "C" __global__ void GEMV_BOUNDS gemv_q(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols,
                                  const float* __restrict__ gain, float eps, int group, float* __restrict__ xnorm_out) {
    extern __shared__ float smem[];
    float* xs = smem;
    float* gsum = xs + cols;
    float* red = gsum + cols / group;
    int total = 0;
    for (int m = 0; m < nmats; ++m) total += mats[m].rows;
    int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int gpr = cols / group;
    const int nw = gridDim.x * warps;
    // Row rr (of the concatenated matrices) into L2, codes and scales/biases.
    auto prefetch_row = [&](int rr) {
        if (rr >= total) return;
        int m = 0;
        while (rr >= mats[m].rows) { rr -= mats[m].rows; ++m; }
        const QMat& M = mats[m];
        size_t wpr = (size_t)cols * M.bits / 32;
        prefetch_l2_warp(M.w + (size_t)rr * wpr, wpr * 4, lane);
        if (lane == 0) prefetch_l2(M.s + (size_t)rr * gpr);
        if (lane == 1) prefetch_l2(M.b + (size_t)rr * gpr);
    };
    // The first row pair's weights start streaming before the activation prologue.
    prefetch_row(blockIdx.x * warps + warp);
    prefetch_row(blockIdx.x * warps + warp + nw);
    if (gain && (int)threadIdx.x * 32 < cols) prefetch_l2(gain + threadIdx.x * 32);
    // With PDL the prefetches above overlap the previous kernel; x is only read after it ends.
    pdl_wait_trigger();
    float inv = 1.f;
    const bool fast = GEMV_FAST_STAGE && (cols & 63) == 0 && cols <= 2 * STAGE_MAXK * (int)blockDim.x && (group == 32 || group == 64);
    if (fast) {
        inv = stage_x_fast<STAGE_MAXK>(x, cols, gain, eps, group, xs, gsum, red);
        if (xnorm_out && blockIdx.x == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm_out[c] = gain ? x[c] * inv * gain[c] : x[c];
    } else {
        stage_x(x, cols, gain, eps, group, xs, gsum, red);
        if (xnorm_out && blockIdx.x == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm_out[c] = xs[swz_elem(c)];
    }
    // Two rows per warp per iteration, reduced together, so two rows' loads are in flight; the
    // next pair is prefetched into L2 one iteration ahead.
    for (int r = blockIdx.x * warps + warp; r < total; r += 2 * nw) {
        prefetch_row(r + 2 * nw);
        prefetch_row(r + 3 * nw);
        float d[2] = {0.f, 0.f};
        int mi[2] = {-1, -1}, ri[2] = {0, 0};
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            int rr = r + t * nw, m = 0;
            if (rr < total) {
                while (rr >= mats[m].rows) { rr -= mats[m].rows; ++m; }
                mi[t] = m;
                ri[t] = rr;
            }
        }
        if (GEMV_PAIR && mi[1] >= 0 && mats[mi[0]].bits == mats[mi[1]].bits) {
            const QMat& A = mats[mi[0]];
            const QMat& B = mats[mi[1]];
            const size_t wpr = (size_t)cols * A.bits / 32;
            qrow_part2(A.w + (size_t)ri[0] * wpr, A.s + (size_t)ri[0] * gpr, A.b + (size_t)ri[0] * gpr,
                       B.w + (size_t)ri[1] * wpr, B.s + (size_t)ri[1] * gpr, B.b + (size_t)ri[1] * gpr, xs, gsum, cols,
                       A.bits, group, d[0], d[1]);
        } else {
#pragma unroll
            for (int t = 0; t < 2; ++t)
                if (mi[t] >= 0) {
                    const QMat& M = mats[mi[t]];
                    const size_t wpr = (size_t)cols * M.bits / 32;
                    d[t] = qrow_part(M.w + (size_t)ri[t] * wpr, M.s + (size_t)ri[t] * gpr, M.b + (size_t)ri[t] * gpr, xs,
                                     gsum, cols, M.bits, group);
                }
        }
        d[0] = warp_sum(d[0]) * inv;
        d[1] = warp_sum(d[1]) * inv;
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < 2; ++t)
                if (mi[t] >= 0) {
                    const QMat& M = mats[mi[t]];
                    M.y[ri[t]] = M.accumulate ? M.y[ri[t]] + d[t] : d[t];
                }
        }
    }
}

// Embedding gather: x = dequantized row `token` of the 4/8-bit table (s*q + b, as
// qmatmul::dequantize_row). The token id lives on the device (the decode loop never reads it back).
extern "C" __global__ void embed_q(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
                                   const int* __restrict__ step, int cols, int bits, int group, float* __restrict__ x) {
    pdl_wait_trigger();
    int tok = step[0];
    size_t wpr = (size_t)cols * bits / 32;
    int gpr = cols / group, per = 32 / bits;
    u32 mask = (1u << bits) - 1u;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        u32 q = (w[(size_t)tok * wpr + c / per] >> (bits * (c % per))) & mask;
        int g = c / group;
        x[c] = bf16f(s[(size_t)tok * gpr + g]) * (float)q + bf16f(b[(size_t)tok * gpr + g]);
    }
}
