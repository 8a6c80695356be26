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

// Tensor-core variant of gemv_q for sets of 4-bit matrices (group 64; tc_load/tc_mma in
// common.cuh). Work item = (16-row tile, chunk of TC_NG = 8 groups of 64 columns); a tile is
// `slices` warps of one block, each taking `kc` consecutive chunks (slices * kc = chunks per
// row), so a block does warps / slices tiles per iteration and sums the slices through shared
// memory. Large sets (GDN in-proj, q|k|v: 4 chunks of 512 columns per row) get 4 slices, the
// lm_head (15,520 tiles) one slice of 4 chunks per warp and no barriers. The first item's loads
// are issued before the prologue. (The host keeps sets of few tiles, the out-projections, on
// gemv_q: kernels.rs `gemv`.)
// Dynamic shared memory: cols/64 * (TCX_WORDS + 1) + 33 + warps * 16 words.
extern "C" __global__ void GEMV_BOUNDS gemv_tc(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x,
                                               int cols, const float* __restrict__ gain, float eps, int slices, int kc,
                                               float* __restrict__ xnorm_out) {
    extern __shared__ float smem[];
    const int gpr = cols >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + gpr * TCX_WORDS;
    float* red = gsum + gpr;
    float* part = red + 33;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tpb = warps / slices, my_tile = warp / slices, my_slice = warp % slices;
    int tiles = 0;
    for (int m = 0; m < nmats; ++m) tiles += (mats[m].rows + 15) >> 4;
    // Tile -> (matrix, first row); m = -1 past the set.
    auto locate = [&](int tile, int& m, int& r0) {
        m = -1;
        r0 = 0;
        if (tile >= tiles) return;
        m = 0;
        while (tile >= ((mats[m].rows + 15) >> 4)) { tile -= (mats[m].rows + 15) >> 4; ++m; }
        r0 = tile << 4;
    };
    auto load = [&](TcItem& it, int m, int r0, int k) {
        const QMat& M = mats[m];
        const int G0 = (my_slice * kc + k) * TC_NG;
        tc_load(it, M.w, M.s, M.b, M.rows, r0, cols, G0, min(gpr, G0 + TC_NG));
    };
    TcItem it;
    int m, r0;
    const int bt0 = blockIdx.x * tpb;
    locate(bt0 + my_tile, m, r0);
    if (m >= 0) load(it, m, r0, 0);
    pdl_wait_trigger();
    const float inv = stage_x_tc(x, cols, gain, eps, xf, gsum, red);
    if (xnorm_out && blockIdx.x == 0)
        for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm_out[c] = gain ? x[c] * inv * gain[c] : x[c];
    const int g = lane >> 2;
    for (int bt = bt0; bt < tiles; bt += gridDim.x * tpb) {
        if (bt != bt0) {
            locate(bt + my_tile, m, r0);
            if (m >= 0) load(it, m, r0, 0);
        }
        float acc0 = 0.f, acc1 = 0.f;
        if (m >= 0) {
            if (kc > 1 && lane < 16 && r0 + lane < mats[m].rows) {
                // The later chunks of this warp's 16 rows into L2 while the first is computed.
                const char* p = reinterpret_cast<const char*>(mats[m].w + (size_t)(r0 + lane) * (cols >> 3)) +
                                (size_t)(my_slice * kc + 1) * TC_NG * 32;
                for (int off = 0; off < (kc - 1) * TC_NG * 32; off += 128) prefetch_l2(p + off);
            }
            for (int k = 0; k < kc; ++k) {
                if (k > 0) load(it, m, r0, k);
                const int G0 = (my_slice * kc + k) * TC_NG;
                tc_mma(it, xf, gsum, G0, min(gpr, G0 + TC_NG), 1.f, acc0, acc1);
            }
        }
        tc_reduce(acc0, acc1);
        if (slices == 1) {
            if (m >= 0 && (lane & 3) == 0) {
                const QMat& M = mats[m];
                if (r0 + g < M.rows) M.y[r0 + g] = M.accumulate ? M.y[r0 + g] + acc0 * inv : acc0 * inv;
                if (r0 + g + 8 < M.rows) M.y[r0 + g + 8] = M.accumulate ? M.y[r0 + g + 8] + acc1 * inv : acc1 * inv;
            }
            continue;
        }
        if ((lane & 3) == 0) {
            part[warp * 16 + g] = acc0;
            part[warp * 16 + g + 8] = acc1;
        }
        __syncthreads();
        if ((int)threadIdx.x < tpb * 16) {
            const int tl = threadIdx.x >> 4, row = threadIdx.x & 15;
            int mm, rr;
            locate(bt + tl, mm, rr);
            if (mm >= 0 && rr + row < mats[mm].rows) {
                float v = 0.f;
                for (int sl = 0; sl < slices; ++sl) v += part[(tl * slices + sl) * 16 + row];
                const QMat& M = mats[mm];
                M.y[rr + row] = M.accumulate ? M.y[rr + row] + v * inv : v * inv;
            }
        }
        __syncthreads();
    }
}
