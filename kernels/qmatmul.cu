// Quantized matrix products (MLX affine 4/8-bit codes, bf16 scales and biases) and the
// embedding gather. Same math as src/backend/cpu/qmatmul.rs.
//   decode (T = 1):     gemv_q, gemv_tc(_f), embed_q
//   batched decode:     stage_tcb, gemv_tcb (B tokens, bf16 activations)
//   prefill (T tokens): pf_gemm, pf_gemm_tc, pf_gemm_skinny, pf_few_tc_{4,8}_{4,8}, pf_dequant_bf16,
//                       pf_to_bf16, pf_embed

// ================================ decode (T = 1) ================================
// Quantized GEMV: several matrices that share one input vector in a single launch (GDN in_proj
// qkv|z|b|a, attention q|k|v, router + shared-expert gate, ...), with the input RMSNorm fused
// into the prologue and an optional residual accumulate in the epilogue. Fewer launches per token
// is what matters at batch 1 (kernels.md §4.3: the step is sync-bound).

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
// Resident blocks per SM (of 256 threads) the register allocation of gemv_q and gemv_tc must
// allow. 3 caps gemv_q at 80 registers (8 bytes of stack): without the cap the I2F-free dequant
// grows it to 86, two blocks fit per SM, and the big sets (GDN in_proj, q|k|v, lm_head) lose a
// third of their warps.
#define GEMV_MIN_BLOCKS 3

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

// Rows of a GEMV set: the matrices' rows, concatenated.
__device__ __forceinline__ int qmat_total(const QMat* __restrict__ mats, int nmats) {
    int total = 0;
    for (int m = 0; m < nmats; ++m) total += mats[m].rows;
    return total;
}
// Row r (< qmat_total) of the concatenated matrices: its matrix m and its row rr there.
__device__ __forceinline__ void qmat_row(const QMat* __restrict__ mats, int r, int& m, int& rr) {
    m = 0;
    rr = r;
    while (rr >= mats[m].rows) { rr -= mats[m].rows; ++m; }
}

// The input of gemv_q / gemv_q_split staged into xs and gsum (stage_x_fast where the width allows,
// else stage_x) with its optional RMSNorm, block 0 also writing the normalised input to xnorm_out.
// Returns the factor the row sums still need: the fast staging leaves 1/rms to them, stage_x
// applies it.
__device__ __forceinline__ float stage_gemv_input(const float* __restrict__ x, int cols, const float* __restrict__ gain,
                                                  float eps, int group, float* xs, float* gsum, float* red,
                                                  float* __restrict__ xnorm_out) {
    float inv = 1.f;
    const bool fast = (cols & 63) == 0 && cols <= 2 * STAGE_MAXK * (int)blockDim.x && (group == 32 || group == 64);
    if (fast) {
        inv = stage_x_fast<STAGE_MAXK>(x, cols, gain, eps, group, xs, gsum, red);
        if (xnorm_out && blockIdx.x == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm_out[c] = gain ? x[c] * inv * gain[c] : x[c];
    } else {
        stage_x(x, cols, gain, eps, group, xs, gsum, red);
        if (xnorm_out && blockIdx.x == 0)
            for (int c = threadIdx.x; c < cols; c += blockDim.x) xnorm_out[c] = xs[swz_elem(c)];
    }
    return inv;
}

// Dynamic shared memory: cols + cols/group + 33 floats.
// Each warp owns one row at a time and walks the concatenated rows of all matrices.
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS)
gemv_q(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols, const float* __restrict__ gain,
       float eps, int group, float* __restrict__ xnorm_out) {
    extern __shared__ float smem[];
    float* xs = smem;
    float* gsum = xs + cols;
    float* red = gsum + cols / group;
    const int total = qmat_total(mats, nmats);
    int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int gpr = cols / group;
    const int nw = gridDim.x * warps;
    // Row rr (of the concatenated matrices) into L2, codes and scales/biases.
    auto prefetch_row = [&](int rr) {
        if (rr >= total) return;
        int m;
        qmat_row(mats, rr, m, rr);
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
    const float inv = stage_gemv_input(x, cols, gain, eps, group, xs, gsum, red, xnorm_out);
    // Two rows per warp per iteration, reduced together, so two rows' loads are in flight; the
    // next pair is prefetched into L2 one iteration ahead.
    for (int r = blockIdx.x * warps + warp; r < total; r += 2 * nw) {
        prefetch_row(r + 2 * nw);
        prefetch_row(r + 3 * nw);
        float d[2] = {0.f, 0.f};
        int mi[2] = {-1, -1}, ri[2] = {0, 0};
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            if (r + t * nw < total) qmat_row(mats, r + t * nw, mi[t], ri[t]);
        }
        if (mi[1] >= 0 && mats[mi[0]].bits == mats[mi[1]].bits) {
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

// gemv_q for sets too small to give every warp of a wave a row (the router: 257 rows): each row's
// chunks split into `ks` equal parts (ks divides 8 and every matrix's chunk count), one per warp of
// the row's `8 / ks` adjacent warps in one block, so each lane has ks times fewer dependent loads
// and the set spreads over ks times more SMs. The parts' warp sums are added in part order by the
// row's first warp. Dynamic shared memory: cols + cols/group + 33 + 8 floats. grid
// ceil(total / (8 / ks)), block 256.
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS)
gemv_q_split(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols,
             const float* __restrict__ gain, float eps, int group, float* __restrict__ xnorm_out, int ks) {
    extern __shared__ float smem[];
    float* xs = smem;
    float* gsum = xs + cols;
    float* red = gsum + cols / group;
    float* part = red + 33;
    const int total = qmat_total(mats, nmats);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gpr = cols / group;
    const int r = blockIdx.x * (8 / ks) + warp / ks, p = warp % ks;
    int m = 0, rr = r;
    if (r < total) qmat_row(mats, r, m, rr);
    const QMat& M = mats[r < total ? m : 0];
    const int n4 = cols >> (M.bits == 4 ? 5 : 4), i0 = p * (n4 / ks), i1 = i0 + n4 / ks;
    const size_t wpr = (size_t)cols * M.bits / 32;
    // This warp's part of its row into L2 before the activation prologue (PDL overlaps it with
    // the previous kernel).
    if (r < total) {
        prefetch_l2_warp(M.w + (size_t)rr * wpr + (size_t)i0 * 4, (size_t)(i1 - i0) * 16, lane);
        if (lane == 0) prefetch_l2(M.s + (size_t)rr * gpr);
        if (lane == 1) prefetch_l2(M.b + (size_t)rr * gpr);
    }
    if (gain && (int)threadIdx.x * 32 < cols) prefetch_l2(gain + threadIdx.x * 32);
    pdl_wait_trigger();
    const float inv = stage_gemv_input(x, cols, gain, eps, group, xs, gsum, red, xnorm_out);
    float d = 0.f;
    if (r < total) {
        const u32* w = M.w + (size_t)rr * wpr;
        const u16* sr = M.s + (size_t)rr * gpr;
        const u16* br = M.b + (size_t)rr * gpr;
        d = M.bits == 4 ? qrow_range_t<4>(w, sr, br, xs, gsum, i0, i1, group)
                        : qrow_range_t<8>(w, sr, br, xs, gsum, i0, i1, group);
    }
    d = warp_sum(d);
    if (lane == 0) part[warp] = d;
    __syncthreads();
    if (r < total && p == 0 && lane == 0) {
        float sum = part[warp];
        for (int j = 1; j < ks; ++j) sum += part[warp + j];
        sum *= inv;
        M.y[rr] = M.accumulate ? M.y[rr] + sum : sum;
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

// The 16-row tiles of a set of matrices (each rounded up on its own), and tile -> (matrix, first
// row); m = -1 past the set.
__device__ __forceinline__ int set_tiles(const QMat* __restrict__ mats, int nmats) {
    int tiles = 0;
    for (int m = 0; m < nmats; ++m) tiles += (mats[m].rows + 15) >> 4;
    return tiles;
}
__device__ __forceinline__ void set_locate(const QMat* __restrict__ mats, int tiles, int tile, int& m, int& r0) {
    m = -1;
    r0 = 0;
    if (tile >= tiles) return;
    m = 0;
    while (tile >= ((mats[m].rows + 15) >> 4)) { tile -= (mats[m].rows + 15) >> 4; ++m; }
    r0 = tile << 4;
}

// Tensor-core variant of gemv_q for sets of 4-bit matrices (group 64; tc_load/tc_mma in
// common.cuh). Work item = (16-row tile, chunk of TC_NG = 8 groups of 64 columns); a tile is
// `slices` warps of one block, each taking `kc` consecutive chunks (slices * kc = chunks per
// row), so a block does warps / slices tiles per iteration and sums the slices through shared
// memory. Large sets (GDN in-proj, q|k|v: 4 chunks of 512 columns per row) get 4 slices, the
// lm_head (15,520 tiles) one slice of 4 chunks per warp and no barriers. The first item's loads
// are issued before the prologue. (The host keeps sets of few tiles, the out-projections, on
// gemv_q: qmatmul.rs `select_gemv`.)
// Dynamic shared memory: cols/64 * (TCX_WORDS + 1) + 33 + warps * 16 words.
template <bool FRAG>
__device__ __forceinline__ void gemv_tc_body(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols,
                                             const float* __restrict__ gain, float eps, int slices, int kc,
                                             float* __restrict__ xnorm_out) {
    extern __shared__ float smem[];
    const int gpr = cols >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + gpr * TCX_WORDS;
    float* red = gsum + gpr;
    float* part = red + 33;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tpb = warps / slices, my_tile = warp / slices, my_slice = warp % slices;
    const int tiles = set_tiles(mats, nmats);
    auto locate = [&](int tile, int& m, int& r0) { set_locate(mats, tiles, tile, m, r0); };
    auto load = [&](TcItem& it, int m, int r0, int k) {
        const QMat& M = mats[m];
        const int G0 = (my_slice * kc + k) * TC_NG;
        tc_load<FRAG>(it, M.w, M.s, M.b, M.rows, r0, cols, G0, min(gpr, G0 + TC_NG));
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
            if constexpr (FRAG) {
                // The tile's later chunks are contiguous: 128-byte lines spread over the lanes.
                if (kc > 1) {
                    const char* p = reinterpret_cast<const char*>(mats[m].w + (size_t)r0 * (cols >> 3)) +
                                    (size_t)(my_slice * kc + 1) * TC_NG * 512;
                    for (int off = lane * 128; off < (kc - 1) * TC_NG * 512; off += 32 * 128) prefetch_l2(p + off);
                }
            } else if (kc > 1 && lane < 16 && r0 + lane < mats[m].rows) {
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

extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS)
gemv_tc(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols, const float* __restrict__ gain,
        float eps, int slices, int kc, float* __restrict__ xnorm_out) {
    gemv_tc_body<false>(mats, nmats, x, cols, gain, eps, slices, kc, xnorm_out);
}
// gemv_tc over the matrices' fragment-order copies (common.cuh tc_load: one coalesced 16-byte
// load per lane and group; the descriptors point at the copies; the same products).
extern "C" __global__ void __launch_bounds__(256, GEMV_MIN_BLOCKS)
gemv_tc_f(const QMat* __restrict__ mats, int nmats, const float* __restrict__ x, int cols, const float* __restrict__ gain,
          float eps, int slices, int kc, float* __restrict__ xnorm_out) {
    gemv_tc_body<true>(mats, nmats, x, cols, gain, eps, slices, kc, xnorm_out);
}

// ============================ batched decode (B tokens) ============================
// stage_tcb: the rows of a batched step's activation x [nrows][cols] as bf16 tensor-core
// fragments (layout in common.cuh) with their group sums, RMSNorm'd with `gain` first when given
// (inv = 1/rms(x) per row), and with `u_out` also the f32 values (the normalised rows the f32
// router reads). Staged once per input, read by every block of the GEMVs that follow. Rows
// nrows..ceil16(nrows) are written as zeros. grid (ceil16(nrows)), block 256.
//
// A block is one row: a short chain of dependent steps, so every load is issued before the
// norm's reduction and each thread then finishes whole pieces from registers. Thread m's piece
// is the 8 columns 8m..8m+7 of group G = m / 8 (j = m % 8): the pairs (c, c + 4) of its first 4
// columns, which are fragment words (i, t, reg) with t = j / 2, i = 2 (j % 2) + s / 2, reg = s % 2
// (s = 0..3), i.e. two pairs of adjacent words. The group sum adds the 32 pairs' values in
// warp_sum's butterfly order over the pair index q = 8i + 2t + reg (bit 4: lane bit 0; bit 3: s / 2;
// bits 1-2: lane bits 1-2; bit 0: s % 2), and the norm's sum of squares is block_sum over the
// columns c = tid + 256k, so the staged bits do not depend on this layout.
__device__ __forceinline__ void stage_piece(float (&v)[8], int m, bool on, int r, int gpr, float* __restrict__ u_out,
                                            int cols, u32* __restrict__ frag, float* __restrict__ gsum) {
    const int G = m >> 3, j = m & 7, t = j >> 1;
    if (on && u_out) {
        float4* u = reinterpret_cast<float4*>(u_out + (size_t)r * cols + 8 * m);
        u[0] = make_float4(v[0], v[1], v[2], v[3]);
        u[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    u32 w[4];
    float a[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        w[s] = pack_bf16(v[s], v[s + 4]);
        a[s] = __uint_as_float(w[s] << 16) + __uint_as_float(w[s] & 0xffff0000u);
        a[s] += __shfl_xor_sync(0xffffffffu, a[s], 1);  // q bit 4
    }
    float b0 = a[0] + a[2], b1 = a[1] + a[3];  // q bit 3
    b0 += __shfl_xor_sync(0xffffffffu, b0, 4);  // q bit 2
    b1 += __shfl_xor_sync(0xffffffffu, b1, 4);
    b0 += __shfl_xor_sync(0xffffffffu, b0, 2);  // q bit 1
    b1 += __shfl_xor_sync(0xffffffffu, b1, 2);
    if (m < (cols >> 3)) {
        if (j == 0) gsum[(size_t)r * gpr + G] = b0 + b1;  // q bit 0
        const int i0 = 2 * (j & 1);
        u32* f = frag + tcb_word(r, gpr, G, i0, t, 0);
        *reinterpret_cast<uint2*>(f) = make_uint2(w[0], w[1]);
        *reinterpret_cast<uint2*>(f + 64) = make_uint2(w[2], w[3]);
    }
}

//
// With `D` (the batched decode's first staging of a layer), the previous layer's MoE output is
// added to the residual x first (moe_combined8: the sums of pf_moe_combine; x written back), one
// launch instead of two.
extern "C" __global__ void __launch_bounds__(256)
stage_tcb(float* x, int cols, int nrows, const float* __restrict__ gain, float eps, float* __restrict__ u_out,
          u32* __restrict__ frag, float* __restrict__ gsum, const float* __restrict__ D,
          const float* __restrict__ top_w, int K, const float* __restrict__ SH, const float* __restrict__ sgl) {
    __shared__ float red[33];
    pdl_wait_trigger();
    const int r = blockIdx.x, gpr = cols >> 6, nm = cols >> 3, tid = threadIdx.x;
    const bool live = r < nrows;
    const float* xr = x + (size_t)r * cols;
    if (D) {
        if (live)
            for (int m = tid; m < nm; m += blockDim.x) {
                float acc[8];
                moe_combined8(D, top_w, K, SH, sgl, cols, r, 8 * m, acc);
                float4* xo = reinterpret_cast<float4*>(x + (size_t)r * cols + 8 * m);
                const float4 p = xo[0], q = xo[1];
                xo[0] = make_float4(p.x + acc[0], p.y + acc[1], p.z + acc[2], p.w + acc[3]);
                xo[1] = make_float4(q.x + acc[4], q.y + acc[5], q.z + acc[6], q.w + acc[7]);
            }
        __syncthreads();
    }
    // The first piece's operands before the reduction (whole warps run the pieces: the group
    // sums shuffle across lanes).
    const int m0 = tid;
    const bool on0 = live && m0 < nm;
    float v[8];
    {
        const float4 p = on0 ? *reinterpret_cast<const float4*>(xr + 8 * m0) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 q = on0 ? *reinterpret_cast<const float4*>(xr + 8 * m0 + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = q.x, v[5] = q.y, v[6] = q.z, v[7] = q.w;
    }
    float g[8];  // unset in lanes past the row: their 8-lane groups are never stored
    if (gain && m0 < nm) {
        const float4 p = *reinterpret_cast<const float4*>(gain + 8 * m0);
        const float4 q = *reinterpret_cast<const float4*>(gain + 8 * m0 + 4);
        g[0] = p.x, g[1] = p.y, g[2] = p.z, g[3] = p.w, g[4] = q.x, g[5] = q.y, g[6] = q.z, g[7] = q.w;
    }
    float inv = 1.f;
    if (gain) {
        float ss = 0.f;
        if (live)
            for (int c = tid; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
        inv = inv_rms_from(block_sum(ss, red), cols, eps);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = v[k] * inv * g[k];
    }
    if ((tid & ~31) < nm) stage_piece(v, m0, on0, r, gpr, u_out, cols, frag, gsum);
    for (int m = tid + blockDim.x; (m & ~31) < nm; m += blockDim.x) {
        const bool on = live && m < nm;
        const float4 p = on ? *reinterpret_cast<const float4*>(xr + 8 * m) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 q = on ? *reinterpret_cast<const float4*>(xr + 8 * m + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        v[0] = p.x, v[1] = p.y, v[2] = p.z, v[3] = p.w, v[4] = q.x, v[5] = q.y, v[6] = q.z, v[7] = q.w;
        if (gain && m < nm) {
            const float4 gp = *reinterpret_cast<const float4*>(gain + 8 * m);
            const float4 gq = *reinterpret_cast<const float4*>(gain + 8 * m + 4);
            const float gg[8] = {gp.x, gp.y, gp.z, gp.w, gq.x, gq.y, gq.z, gq.w};
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = v[k] * inv * gg[k];
        }
        stage_piece(v, m, on, r, gpr, u_out, cols, frag, gsum);
    }
}

// gemv_tc for the few tokens of a batched decode step: several 4-bit matrices (group 64) that
// share one staged input (stage_tcb), y_m[t][r] (+)= W_m[r] . x[t] for tokens t < ntok (outputs
// token-major [ntok][rows_m]); bf16 activations on the tensor cores (tcb_mma in common.cuh).
// grid (ceil(ntok / tok_blk), blocks): a block copies its tok_blk (8 or 16) tokens' fragments,
// then walks the set's 16-row tiles like gemv_tc: `slices` warps of `kc` 512-column chunks per
// tile, summed through shared memory. The tokens of a block share every weight load and every
// dequantised weight fragment, and the blocks of the same rows (consecutive blockIdx.x) run
// together, so larger batches read the weights from L2.
// Dynamic shared memory: tok_blk / 8 * gpr * TCB_WORDS + tok_blk * gpr + warps * 16 * tok_blk words.
// The tiles walk of gemv_tcb and gemv_tcq: `product(m, r0, acc)` sets acc to the warp's K slice
// of the tile at row r0 of matrix m against the block's tokens.
template <int NTG, class Product>
__device__ __forceinline__ void gemv_tcb_tiles(const QMat* __restrict__ mats, int nmats, int t0, int nt, int slices,
                                               float* part, Product product) {
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int tpb = warps / slices, my_tile = warp / slices;
    constexpr int tok_blk = NTG * 8;
    const int tiles = set_tiles(mats, nmats);
    auto locate = [&](int tile, int& m, int& r0) { set_locate(mats, tiles, tile, m, r0); };
    auto store = [&](int m, int row, int tok, float v) {
        const QMat& M = mats[m];
        if (row < M.rows && tok < nt) {
            float* o = M.y + (size_t)(t0 + tok) * M.rows + row;
            *o = M.accumulate ? *o + v : v;
        }
    };
    for (int bt = blockIdx.y * tpb; bt < tiles; bt += gridDim.y * tpb) {
        int m, r0;
        locate(bt + my_tile, m, r0);
        float acc[NTG][4];
        if (m >= 0) {
            product(m, r0, acc);
        } else {
#pragma unroll
            for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
        }
        if (slices == 1) {
            if (m < 0) continue;
#pragma unroll
            for (int tg = 0; tg < NTG; ++tg) {
                store(m, r0 + g, tg * 8 + 2 * t, acc[tg][0]);
                store(m, r0 + g, tg * 8 + 2 * t + 1, acc[tg][1]);
                store(m, r0 + g + 8, tg * 8 + 2 * t, acc[tg][2]);
                store(m, r0 + g + 8, tg * 8 + 2 * t + 1, acc[tg][3]);
            }
            continue;
        }
        // part[warp][16 rows][tok_blk tokens], the slices of a tile summed in slice order.
        float* pw = part + warp * 16 * tok_blk;
#pragma unroll
        for (int tg = 0; tg < NTG; ++tg) {
            pw[g * tok_blk + tg * 8 + 2 * t] = acc[tg][0];
            pw[g * tok_blk + tg * 8 + 2 * t + 1] = acc[tg][1];
            pw[(g + 8) * tok_blk + tg * 8 + 2 * t] = acc[tg][2];
            pw[(g + 8) * tok_blk + tg * 8 + 2 * t + 1] = acc[tg][3];
        }
        __syncthreads();
        for (int o = threadIdx.x; o < tpb * 16 * tok_blk; o += blockDim.x) {
            const int tl = o / (16 * tok_blk), rem = o % (16 * tok_blk), row = rem / tok_blk, tok = rem % tok_blk;
            int mm, rr;
            locate(bt + tl, mm, rr);
            if (mm < 0) continue;
            float v = 0.f;
            for (int sl = 0; sl < slices; ++sl) v += part[((tl * slices + sl) * 16 + row) * tok_blk + tok];
            store(mm, rr + row, tok, v);
        }
        __syncthreads();
    }
}

// gemv_tcb's product: the warp's item loaded whole into registers, chunk by chunk (tcb_tile).
template <bool FRAG>
struct TcbProduct {
    const QMat* __restrict__ mats;
    int cols, G0, kc;
    const u32* xf;
    const float* gsum;
    template <int NTG>
    __device__ __forceinline__ void operator()(int m, int r0, float (&acc)[NTG][4]) const {
        const QMat& M = mats[m];
        tcb_tile<NTG, FRAG>(M.w, M.s, M.b, M.rows, r0, cols, G0, kc, xf, gsum, acc);
    }
};

template <bool FRAG>
__device__ __forceinline__ void gemv_tcb_body(const QMat* __restrict__ mats, int nmats, const u32* __restrict__ frag,
                                              const float* __restrict__ gs_in, int cols, int ntok, int tok_blk,
                                              int slices, int kc) {
    extern __shared__ float smem[];
    const int gpr = cols >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + (tok_blk >> 3) * gpr * TCB_WORDS;
    float* part = gsum + tok_blk * gpr;
    const int t0 = blockIdx.x * tok_blk, nt = min(tok_blk, ntok - t0);
    pdl_wait_trigger();
    load_token_block_tc(frag, gs_in, cols, t0, nt, xf, gsum);
    const TcbProduct<FRAG> product{mats, cols, (int)(threadIdx.x >> 5) % slices * kc * TC_NG, kc, xf, gsum};
    if (nt > 8)
        gemv_tcb_tiles<2>(mats, nmats, t0, nt, slices, part, product);
    else
        gemv_tcb_tiles<1>(mats, nmats, t0, nt, slices, part, product);
}
// The entry points: THREADS per block, at least MINB blocks per SM, codes in row order or
// (FRAG) in fragment order (common.cuh tc_load; the descriptors point at the matrices'
// fragment-order copies).
#define GEMV_TCB_ENTRY(NAME, THREADS, MINB, FRAG)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB)                                                \
        NAME(const QMat* __restrict__ mats, int nmats, const u32* __restrict__ frag,                          \
             const float* __restrict__ gs_in, int cols, int ntok, int tok_blk, int slices, int kc) {          \
        gemv_tcb_body<FRAG>(mats, nmats, frag, gs_in, cols, ntok, tok_blk, slices, kc);                       \
    }
GEMV_TCB_ENTRY(gemv_tcb, 256, 2, false)
GEMV_TCB_ENTRY(gemv_tcb_f, 256, 2, true)
// The same with 16 warps, one block per SM: 16 tokens of 4,096 columns (128 KB of fragments)
// where the 256-thread kernel's blocks take 8, so each dequantised weight fragment serves twice
// the tokens. The warps take the same tiles and K slices as the 256-thread kernel's, so every
// output is bit-identical.
GEMV_TCB_ENTRY(gemv_tcb_w, 512, 1, false)
GEMV_TCB_ENTRY(gemv_tcb_wf, 512, 1, true)

// gemv_tcb_f with each warp's weights streamed through a ring of GEMV_RING_DEPTH stages
// (tcr_issue / tcr_stage in common.cuh, as moe_tcq's). Why: a gemv_tcb warp loads a whole item
// (16 rows x its K slice) into registers and then multiplies it, so it waits on memory at every
// item with nothing else of its own in flight; here the warp's next stages, across its items and
// the block's barriers, load while the current one is multiplied. The same tiles, K slices and
// products per group in group order as gemv_tcb_f: bit-identical. The host takes it for steps of
// at most 16 tokens (qmatmul.rs `tcb_ring`: at 64 rows, where four token blocks read each weight
// from L2, it lost). Three stages where moe_tcr has four: two blocks of 16 tokens over 2,048
// columns (or of 8 over 4,096) then still fit an SM with their staged tokens.
// Dynamic shared memory: gemv_tcb's, then warps * GEMV_RING_DEPTH * TCR_STAGE_BYTES bytes.
// cols: a multiple of 64 * TCR_GROUPS. Codes in fragment order, scales and biases row order.
#define GEMV_RING_DEPTH 3

// A warp's side of the ring: the producer walks the warp's items (tile `tile`, then `step`
// tiles on, while below `tiles`; the warp's K slice from group g0, `spi` stages each) one stage
// per issue; the consumer takes the stages in the same order.
struct GemvRing {
    const QMat* __restrict__ mats;
    int tiles, cols, g0, spi, step;
    int tile, k;     // the producer's item and its next stage
    int issued, used;  // stages issued, stages consumed
    unsigned base;   // the warp's ring (shared address)
    TcrSrc<true, false> src;

    __device__ __forceinline__ static TcrSrc<true, false> source(const QMat* mats, int tiles, int tile, int cols) {
        int m, r0;
        set_locate(mats, tiles, tile, m, r0);
        const QMat& M = mats[m < 0 ? 0 : m];
        return TcrSrc<true, false>(M.w, M.s, M.b, m < 0 ? 0 : r0, m < 0 ? 0 : M.rows, cols);
    }
    __device__ __forceinline__ GemvRing(const QMat* __restrict__ mats_, int tiles_, int cols_, int g0_, int spi_, int tile0,
                                        int step_, unsigned base_)
        : mats(mats_), tiles(tiles_), cols(cols_), g0(g0_), spi(spi_), step(step_), tile(tile0), k(0), issued(0), used(0),
          base(base_), src(source(mats_, tiles_, tile0, cols_)) {}

    // One commit group: the producer's next stage into its slot, or nothing past the warp's items.
    __device__ __forceinline__ void issue() {
        if (tile >= tiles) {
            cp_commit();
            return;
        }
        tcr_issue<true, false>(base + (issued % GEMV_RING_DEPTH) * TCR_STAGE_BYTES, src, src, false, g0 + TCR_GROUPS * k);
        ++issued;
        if (++k == spi) {
            k = 0;
            tile += step;
            if (tile < tiles) src = source(mats, tiles, tile, cols);
        }
    }

    // The consumer's item: its spi stages into acc (set), issuing one stage ahead per stage.
    template <int NTG>
    __device__ __forceinline__ void product(const unsigned char* ring, const u32* xf, const float* gsum,
                                            float (&acc)[NTG][4]) {
        const int gpr = cols >> 6;
#pragma unroll
        for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
        for (int j = 0; j < spi; ++j) {
            __syncwarp();  // every lane is done with the slot the next copies overwrite
            issue();
            cp_wait<GEMV_RING_DEPTH - 1>();
            __syncwarp();  // the stage's copies, made by every lane, are visible to all
            tcr_stage<NTG, true>(ring + (used % GEMV_RING_DEPTH) * TCR_STAGE_BYTES, g0 + TCR_GROUPS * j, xf, gsum, gpr, acc);
            ++used;
        }
    }
};

// gemv_tcq's product: the ring's next item (the tiles walk asks for the warp's items in the
// order the ring issues them).
struct GemvRingProduct {
    GemvRing* rg;
    const unsigned char* ring;
    const u32* xf;
    const float* gsum;
    template <int NTG>
    __device__ __forceinline__ void operator()(int, int, float (&acc)[NTG][4]) const { rg->product(ring, xf, gsum, acc); }
};

template <int THREADS>
__device__ __forceinline__ void gemv_tcq_body(const QMat* __restrict__ mats, int nmats, const u32* __restrict__ frag,
                                              const float* __restrict__ gs_in, int cols, int ntok, int tok_blk,
                                              int slices, int kc) {
    extern __shared__ float smem[];
    constexpr int warps = THREADS / 32;
    const int gpr = cols >> 6, warp = threadIdx.x >> 5, tpb = warps / slices;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + (tok_blk >> 3) * gpr * TCB_WORDS;
    float* part = gsum + tok_blk * gpr;
    unsigned char* ring = reinterpret_cast<unsigned char*>(part + warps * 16 * tok_blk) +
                          warp * (GEMV_RING_DEPTH * TCR_STAGE_BYTES);
    const int t0 = blockIdx.x * tok_blk, nt = min(tok_blk, ntok - t0);
    const int g0 = warp % slices * kc * TC_NG, spi = (min(gpr, g0 + kc * TC_NG) - g0) / TCR_GROUPS;
    GemvRing rg(mats, set_tiles(mats, nmats), cols, g0, spi, blockIdx.y * tpb + warp / slices, gridDim.y * tpb,
                smem_u32(ring));
    // The weights do not depend on the previous kernel: the ring's first stages load before
    // its outputs are waited for, and while the block copies its tokens.
    for (int n = 0; n < GEMV_RING_DEPTH - 1; ++n) rg.issue();
    pdl_wait_trigger();
    load_token_block_tc(frag, gs_in, cols, t0, nt, xf, gsum);
    const GemvRingProduct product{&rg, ring, xf, gsum};
    if (nt > 8)
        gemv_tcb_tiles<2>(mats, nmats, t0, nt, slices, part, product);
    else
        gemv_tcb_tiles<1>(mats, nmats, t0, nt, slices, part, product);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    gemv_tcq(const QMat* __restrict__ mats, int nmats, const u32* __restrict__ frag, const float* __restrict__ gs_in,
             int cols, int ntok, int tok_blk, int slices, int kc) {
    gemv_tcq_body<256>(mats, nmats, frag, gs_in, cols, ntok, tok_blk, slices, kc);
}

// ============================== prefill (T tokens) ==============================
// Activations are token-major f32 [T][dim] (docs/cuda-prefill.md, src/backend/cuda/prefill.rs).

// Row maps of a GEMM tile's token `tid` (token t0 + tid of the n the tile covers): x row slot / xdiv
// and y row slot, where slot is the expert's slot list entry (grouped mode, lst) or the token itself;
// -1 past the end.
__device__ __forceinline__ void tile_row(int tid, int t0, int n, const int* lst, int xdiv, int* xrow, int* yrow) {
    const int t = t0 + tid;
    if (t < n) {
        const int slot = lst ? lst[t] : t;
        xrow[tid] = slot / xdiv;
        yrow[tid] = slot;
    } else {
        xrow[tid] = -1;
        yrow[tid] = -1;
    }
}

// Quantized GEMM: Y[yrow(t)][r] (+)= sum_c W[e*rows + r][c] * X[xrow(t)][c]
// Tile 128 rows x 64 tokens x 32 columns; the weight tile is dequantised (s*q + b) into shared
// memory once per block and reused by all 64 tokens. 256 threads, 8 rows x 4 tokens each.
// Dense mode (counts == nullptr): tokens 0..ntok, xrow = yrow = t.
// Grouped (MoE) mode: blockIdx.z = expert e, its tokens are list[offsets[e] .. + counts[e]]
// (slot ids); xrow = slot / xdiv, yrow = slot; weights rows e*rows .. e*rows + rows.
#define PF_BM 128
#define PF_BN 64
#define PF_BK 32

extern "C" __global__ void __launch_bounds__(256)
pf_gemm(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b, int bits, int rows, int cols,
        int group, const float* __restrict__ x, int ntok, float* __restrict__ y, int ldy, int accumulate,
        const int* __restrict__ counts, const int* __restrict__ offsets, const int* __restrict__ list, int xdiv,
        int frag) {
    __shared__ __align__(16) float Ws[PF_BK][PF_BM + 4];
    __shared__ __align__(16) float Xs[PF_BK][PF_BN + 4];
    __shared__ int xrow[PF_BN], yrow[PF_BN];
    const int tid = threadIdx.x;
    const int r0 = blockIdx.x * PF_BM;
    int n = ntok, e = 0;
    const int* lst = nullptr;
    if (counts) {
        e = blockIdx.z;
        n = counts[e];
        lst = list + offsets[e];
    }
    const int t0 = blockIdx.y * PF_BN;
    if (t0 >= n) return;
    if (tid < PF_BN) tile_row(tid, t0, n, lst, xdiv, xrow, yrow);
    __syncthreads();
    const size_t wpr = (size_t)cols * bits / 32;
    const int gpr = cols / group;
    const size_t rbase = (size_t)e * rows;
    const int tx = tid & 15, ty = tid >> 4;
    // loader roles
    const int lrow = tid >> 1, lhalf = tid & 1;
    const int gr = r0 + lrow;
    const bool rvalid = gr < rows;
    const u32* wrow = w + (rbase + (rvalid ? gr : 0)) * wpr;
    const u16* srow = s + (rbase + (rvalid ? gr : 0)) * gpr;
    const u16* brow = b + (rbase + (rvalid ? gr : 0)) * gpr;
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < cols; k0 += PF_BK) {
        // weights: thread owns 16 columns of one row
        {
            float sc = 0.f, bi = 0.f;
            if (rvalid) {
                int g = k0 / group;
                sc = bf16f(__ldg(srow + g));
                bi = bf16f(__ldg(brow + g));
            }
            const int c0 = lhalf * 16;
            if (bits == 4) {
                // Codes in fragment order (frag_word) keep each even-odd word pair together.
                const u32* wq = frag ? w + frag_word(rbase + (rvalid ? gr : 0), (k0 >> 3) + 2 * lhalf, cols) : wrow + (k0 >> 3) + 2 * lhalf;
                uint2 q = rvalid ? __ldg(reinterpret_cast<const uint2*>(wq)) : make_uint2(0, 0);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    Ws[c0 + j][lrow] = rvalid ? fmaf(sc, code_f((q.x >> (4 * j)) & 15u), bi) : 0.f;
                    Ws[c0 + 8 + j][lrow] = rvalid ? fmaf(sc, code_f((q.y >> (4 * j)) & 15u), bi) : 0.f;
                }
            } else {
                uint4 q = rvalid ? __ldg(reinterpret_cast<const uint4*>(wrow + (k0 >> 2)) + lhalf) : make_uint4(0, 0, 0, 0);
                u32 qq[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int wd = 0; wd < 4; ++wd)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        Ws[c0 + wd * 4 + j][lrow] = rvalid ? fmaf(sc, code_f((qq[wd] >> (8 * j)) & 255u), bi) : 0.f;
            }
        }
        // activations: 64 tokens x 32 columns = 512 float4
#pragma unroll
        for (int it = 0; it < 2; ++it) {
            int idx = tid + it * 256;
            int tok = idx >> 3, qd = idx & 7;
            int xr = xrow[tok];
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (xr >= 0) v = __ldg(reinterpret_cast<const float4*>(x + (size_t)xr * cols + k0) + qd);
            Xs[qd * 4 + 0][tok] = v.x;
            Xs[qd * 4 + 1][tok] = v.y;
            Xs[qd * 4 + 2][tok] = v.z;
            Xs[qd * 4 + 3][tok] = v.w;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < PF_BK; ++kk) {
            float4 a0 = *reinterpret_cast<const float4*>(&Ws[kk][ty * 8]);
            float4 a1 = *reinterpret_cast<const float4*>(&Ws[kk][ty * 8 + 4]);
            float4 bv = *reinterpret_cast<const float4*>(&Xs[kk][tx * 4]);
            float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float bb[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], bb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int yr = yrow[tx * 4 + j];
        if (yr < 0) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int r = r0 + ty * 8 + i;
            if (r < rows) {
                float* p = y + (size_t)yr * ldy + r;
                *p = accumulate ? *p + acc[i][j] : acc[i][j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMM: the same product as pf_gemm with bf16 operands and f32 accumulation
// (mma.sync m16n8k16). Per k-tile of 64 columns the weight tile (128 rows) is dequantised to bf16
// into shared memory, the activation tile (64 tokens) is rounded to bf16 on the way in; the next
// tile's global loads are issued before the current tile's mma so their latency hides behind the
// math. 8 warps as 4 (rows) x 2 (tokens), 32x32 outputs per warp. Needs cols % 64 == 0 and
// group % 32 == 0.
// Both tiles hold each 8 columns c0..c7 in the order c0 c4 c1 c5 c2 c6 c3 c7: that is the order
// in which one lop3 per pair turns a word of 8 nibbles into bf16 pairs (nibbles j and j + 4 sit
// 16 bits apart), and a product over k does not depend on the order of its k.
// Grouped (MoE) mode: `tiles` = [ntiles, (expert, first token)...] from pf_scan; blockIdx.y is
// the tile (blocks past ntiles exit).
// SwiGLU mode (w2 != nullptr): the block's 128 shared-memory rows are 64 rows of W (gate) and the
// same 64 rows of W2 (up), interleaved per 16 so every warp holds both for the same outputs; the
// epilogue writes silu(gate) * up. grid.x = ceil(rows / 64) then, else ceil(rows / 128).
#define TC_BM 128
#define TC_BK 64
#define TC_LD (TC_BK + 8)
// TC_BN (tokens per tile), smem_u32, ldsm_x4 and mma_bf16 are in common.cuh.

// 8 nibbles (columns 0..7 of `q`) dequantised to bf16 in the tiles' order (0 4 1 5 2 6 3 7).
__device__ __forceinline__ uint4 deq_nib8_perm(u32 q, u32 s2, u32 b2) {
    return make_uint4(affine_bf16x2(nib_magic_pair<0>(q), s2, b2), affine_bf16x2(nib_magic_pair<1>(q), s2, b2),
                      affine_bf16x2(nib_magic_pair<2>(q), s2, b2), affine_bf16x2(nib_magic_pair<3>(q), s2, b2));
}
// 8 bytes (two words, columns 0..7) dequantised in f32 (fmaf, as the CPU), rounded to bf16, in
// the tiles' order.
__device__ __forceinline__ float deq_byte(u32 q, int j, float sc, float bi) {
    return fmaf(sc, code_f((q >> (8 * j)) & 255u), bi);
}
__device__ __forceinline__ uint4 deq_byte8_perm(u32 q0, u32 q1, float sc, float bi) {
    uint4 r;
    r.x = pack_bf16(deq_byte(q0, 0, sc, bi), deq_byte(q1, 0, sc, bi));
    r.y = pack_bf16(deq_byte(q0, 1, sc, bi), deq_byte(q1, 1, sc, bi));
    r.z = pack_bf16(deq_byte(q0, 2, sc, bi), deq_byte(q1, 2, sc, bi));
    r.w = pack_bf16(deq_byte(q0, 3, sc, bi), deq_byte(q1, 3, sc, bi));
    return r;
}
// 8 activations (columns 0..7) as bf16 in the tiles' order.
__device__ __forceinline__ uint4 pack_bf16x8_perm(float4 lo, float4 hi) {
    return make_uint4(pack_bf16(lo.x, hi.x), pack_bf16(lo.y, hi.y), pack_bf16(lo.z, hi.z), pack_bf16(lo.w, hi.w));
}

// ---------------------------------------------------------------------------------------------
// Operands of the cuBLAS GEMMs (src/backend/cuda/blas.rs), used for chunks of many tokens.
// A whole quantised matrix dequantised to bf16 [rows][cols], with exactly pf_gemm_tc's rounding
// (deq_nib8_perm / deq_byte8_perm, in column order), or to f32 for the few-row GEMMs that pick
// experts and gates. One thread per 8 columns (never straddles a group: groups are multiples of
// 32). grid ceil(rows * cols / 8 / 256), block 256.
// Item i = row r, columns 8k..8k+7: the 8 values s*q + b in f32, each one fmaf as in deq_byte8_perm.
// False past the matrix.
__device__ __forceinline__ bool deq_item(const u32* __restrict__ w, const u16* __restrict__ s,
                                         const u16* __restrict__ b, int bits, int rows, int cols, int group,
                                         size_t i, float (&v)[8]) {
    const int per_row = cols >> 3;
    if (i >= (size_t)rows * per_row) return false;
    const size_t r = i / per_row;
    const int c = (int)(i - r * per_row) << 3, g = c / group;
    const float sc = bf16f(__ldg(s + r * (cols / group) + g)), bi = bf16f(__ldg(b + r * (cols / group) + g));
    if (bits == 4) {
        const u32 q = __ldg(w + r * (cols >> 3) + (c >> 3));
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = fmaf(sc, code_f((q >> (4 * k)) & 15u), bi);
    } else {
        const u32* q = w + r * (cols >> 2) + (c >> 2);
        const u32 q0 = __ldg(q), q1 = __ldg(q + 1);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = fmaf(sc, code_f((q0 >> (8 * k)) & 255u), bi);
            v[4 + k] = fmaf(sc, code_f((q1 >> (8 * k)) & 255u), bi);
        }
    }
    return true;
}
extern "C" __global__ void pf_dequant_bf16(const u32* __restrict__ w, const u16* __restrict__ s,
                                           const u16* __restrict__ b, int bits, int rows, int cols, int group,
                                           uint4* __restrict__ out) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (bits == 4) {
        // deq_nib8_perm's pairs (j, j + 4) put back in column order: one bf16 fma per value.
        const int per_row = cols >> 3;
        if (i >= (size_t)rows * per_row) return;
        const size_t r = i / per_row;
        const int g = (int)(i - r * per_row) * 8 / group;
        const u32 s2 = 0x10001u * __ldg(s + r * (cols / group) + g), b2 = 0x10001u * __ldg(b + r * (cols / group) + g);
        const uint4 p = deq_nib8_perm(__ldg(w + i), s2, b2);
        // p.x = (c0, c4), p.y = (c1, c5), p.z = (c2, c6), p.w = (c3, c7).
        out[i] = make_uint4(__byte_perm(p.x, p.y, 0x5410), __byte_perm(p.z, p.w, 0x5410), __byte_perm(p.x, p.y, 0x7632),
                            __byte_perm(p.z, p.w, 0x7632));
        return;
    }
    float v[8];
    if (!deq_item(w, s, b, bits, rows, cols, group, i, v)) return;
    out[i] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}
// f32 activations to bf16 (round to nearest even, as pf_gemm_tc stages them), 4 per thread.
extern "C" __global__ void pf_to_bf16(const float4* __restrict__ x, uint2* __restrict__ y, int n4) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 v = __ldg(x + i);
    y[i] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}

extern "C" __global__ void __launch_bounds__(256, 2)
pf_gemm_tc(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
           const u32* __restrict__ w2, const u16* __restrict__ s2, const u16* __restrict__ b2, int bits, int rows,
           int cols, int group, const float* __restrict__ x, int ntok, float* __restrict__ y, int ldy,
           int accumulate, const int* __restrict__ counts, const int* __restrict__ offsets,
           const int* __restrict__ list, const int* __restrict__ tiles, int xdiv) {
    // Double-buffered tiles (dynamic, 2 * (TC_BM + TC_BN) * TC_LD bf16): one barrier per k-tile.
    extern __shared__ __align__(16) u16 tc_sm[];
    u16* As = tc_sm;
    u16* Bs = tc_sm + 2 * TC_BM * TC_LD;
    __shared__ int xrow[TC_BN], yrow[TC_BN];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool glu = w2 != nullptr;
    int n = ntok, e = 0, t0 = blockIdx.y * TC_BN;
    const int* lst = nullptr;
    if (tiles) {
        if ((int)blockIdx.y >= tiles[0]) return;
        e = tiles[1 + 2 * blockIdx.y];
        t0 = tiles[2 + 2 * blockIdx.y];
        n = counts[e];
        lst = list + offsets[e];
    }
    if (t0 >= n) return;
    if (tid < TC_BN) tile_row(tid, t0, n, lst, xdiv, xrow, yrow);
    const size_t wpr = (size_t)cols * bits / 32;
    const int gpr = cols / group;
    const size_t rbase = (size_t)e * rows;
    // Loader role: shared-memory row lrow, columns lhalf*32 .. +32 of each k-tile.
    const int lrow = tid >> 1, lhalf = tid & 1;
    int gr;
    const u32* W = w;
    const u16* S = s;
    const u16* B = b;
    if (glu) {
        const int mt = lrow >> 4;
        gr = blockIdx.x * (TC_BM / 2) + (mt >> 1) * 16 + (lrow & 15);
        if (mt & 1) { W = w2; S = s2; B = b2; }
    } else {
        gr = blockIdx.x * TC_BM + lrow;
    }
    const bool rvalid = gr < rows;
    const size_t grow = rbase + (rvalid ? gr : 0);
    const u32* wrow = W + grow * wpr;
    const u16* srow = S + grow * gpr;
    const u16* brow = B + grow * gpr;
    __syncthreads();

    uint4 qa = make_uint4(0, 0, 0, 0), qb = qa;
    u16 sc = 0, bi = 0;
    // Two units of 8 columns of one token per thread: 64 tokens x 8 units.
    float4 xv[2][2];
    auto load = [&](int k0) {
        if (rvalid) {
            const int g = (k0 + lhalf * 32) / group;
            sc = __ldg(srow + g);
            bi = __ldg(brow + g);
            if (bits == 4) {
                qa = __ldg(reinterpret_cast<const uint4*>(wrow + (k0 >> 3)) + lhalf);
            } else {
                const uint4* p = reinterpret_cast<const uint4*>(wrow + (k0 >> 2)) + lhalf * 2;
                qa = __ldg(p);
                qb = __ldg(p + 1);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * 256, tok = idx >> 3, u = idx & 7;
            const int xr = xrow[tok];
            const float4* src = reinterpret_cast<const float4*>(x + (size_t)(xr >= 0 ? xr : 0) * cols + k0) + 2 * u;
            xv[i][0] = xr >= 0 ? __ldg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
            xv[i][1] = xr >= 0 ? __ldg(src + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store = [&](int buf) {
        uint4* dst = reinterpret_cast<uint4*>(As + buf * TC_BM * TC_LD + lrow * TC_LD + lhalf * 32);
        if (!rvalid) {
            const uint4 z = make_uint4(0, 0, 0, 0);
            dst[0] = z; dst[1] = z; dst[2] = z; dst[3] = z;
        } else if (bits == 4) {
            const u32 s2 = 0x10001u * sc, b2 = 0x10001u * bi;
            dst[0] = deq_nib8_perm(qa.x, s2, b2);
            dst[1] = deq_nib8_perm(qa.y, s2, b2);
            dst[2] = deq_nib8_perm(qa.z, s2, b2);
            dst[3] = deq_nib8_perm(qa.w, s2, b2);
        } else {
            const float fs = bf16f(sc), fb = bf16f(bi);
            dst[0] = deq_byte8_perm(qa.x, qa.y, fs, fb);
            dst[1] = deq_byte8_perm(qa.z, qa.w, fs, fb);
            dst[2] = deq_byte8_perm(qb.x, qb.y, fs, fb);
            dst[3] = deq_byte8_perm(qb.z, qb.w, fs, fb);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * 256, tok = idx >> 3, u = idx & 7;
            *reinterpret_cast<uint4*>(Bs + buf * TC_BN * TC_LD + tok * TC_LD + u * 8) = pack_bf16x8_perm(xv[i][0], xv[i][1]);
        }
    };

    const int wm = warp & 3, wn = warp >> 2;
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;
    // ldmatrix addresses (bytes, shared space) of this lane at k = 0.
    const u32 a_base = smem_u32(As) + ((wm * 32 + (lane & 15)) * TC_LD + ((lane >> 4) << 3)) * 2;
    const u32 b_base =
        smem_u32(Bs) + ((wn * 32 + (lane & 7) + ((lane >> 4) << 3)) * TC_LD + (((lane >> 3) & 1) << 3)) * 2;

    load(0);
    store(0);
    __syncthreads();
    int cur = 0;
    for (int k0 = 0; k0 < cols; k0 += TC_BK) {
        const bool more = k0 + TC_BK < cols;
        if (more) load(k0 + TC_BK);
        const u32 ab = a_base + cur * (TC_BM * TC_LD * 2), bb = b_base + cur * (TC_BN * TC_LD * 2);
#pragma unroll
        for (int ks = 0; ks < TC_BK / 16; ++ks) {
            u32 af[2][4], bfr[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldsm_x4(ab + (mt * 16 * TC_LD + ks * 16) * 2, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
#pragma unroll
            for (int np = 0; np < 2; ++np)
                ldsm_x4(bb + (np * 16 * TC_LD + ks * 16) * 2, bfr[2 * np][0], bfr[2 * np][1], bfr[2 * np + 1][0],
                        bfr[2 * np + 1][1]);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_bf16(acc[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
        }
        // The other buffer was last read before the previous barrier.
        if (more) store(cur ^ 1);
        __syncthreads();
        cur ^= 1;
    }
    // Epilogue. acc[mt][nt]: rows (lane>>2) and +8 of m-tile mt, tokens 2*(lane&3), +1 of n-tile nt.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hv = 0; hv < 2; ++hv)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const int tl = wn * 32 + nt * 8 + 2 * (lane & 3) + cc;
                const int yr = yrow[tl];
                if (yr < 0) continue;
                if (glu) {
                    const int r = blockIdx.x * (TC_BM / 2) + wm * 16 + (lane >> 2) + hv * 8;
                    if (r < rows) {
                        const float g = acc[0][nt][hv * 2 + cc], u = acc[1][nt][hv * 2 + cc];
                        float* p = y + (size_t)yr * ldy + r;
                        const float v = silu_f(g) * u;
                        *p = accumulate ? *p + v : v;
                    }
                } else {
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        const int r = blockIdx.x * TC_BM + wm * 32 + mt * 16 + (lane >> 2) + hv * 8;
                        if (r < rows) {
                            float* p = y + (size_t)yr * ldy + r;
                            const float v = acc[mt][nt][hv * 2 + cc];
                            *p = accumulate ? *p + v : v;
                        }
                    }
                }
            }
}

// Few-row GEMMs kept in f32 in both modes (router, shared-expert gate, GDN b/a projections: they
// pick experts and gates). A block stages PF_SK_T tokens' rows of x in shared memory (swizzled
// as stage_x) with their per-group sums; each warp takes rows r = blockIdx.y*rpb + warp + 8i and
// dots every weight chunk it loads with all PF_SK_T tokens, so the weights are read once per
// PF_SK_T tokens. Bias folded per group, as the CPU qmatmul and the decode row dot. `rpb` rows per
// block (a multiple of 8) spread few tokens' rows over more blocks.
// grid (ceil(T / PF_SK_T), ceil(rows / rpb)), block 256,
// dynamic smem PF_SK_T * (cols + cols/group) floats.
#define PF_SK_T 8
// One weight row of pf_gemm_skinny against the PF_SK_T staged tokens (this lane's share in acc):
// a 16-byte chunk holds 128 / BITS codes (CPC), converted once and dotted with every token.
// `group` is a power of two, so chunk -> group is a shift (the loader accepts group 64 only).
template <int BITS>
__device__ __forceinline__ void skinny_row(const uint4* __restrict__ w4, const u16* __restrict__ sr,
                                           const u16* __restrict__ br, const float* xs, const float* gs, int cols,
                                           int group, int lane, float (&acc)[PF_SK_T]) {
    constexpr int CPC = 128 / BITS, CPW = 32 / BITS, F4 = CPC / 4;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int n4 = cols / CPC, cpg = group / CPC, lcpg = __ffs(cpg) - 1, gpr = cols / group;
    for (int i = lane; i < n4; i += 32) {
        const uint4 q = __ldg(w4 + i);
        const int f = i * F4, g = i >> lcpg;
        const float sc = bf16f(__ldg(sr + g));
        const bool first = (i & (cpg - 1)) == 0;
        const float bi = first ? bf16f(__ldg(br + g)) : 0.f;
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        float wq[CPC];
#pragma unroll
        for (int k = 0; k < CPC; ++k) wq[k] = code_f((qw[k / CPW] >> (BITS * (k % CPW))) & MASK);
#pragma unroll
        for (int j = 0; j < PF_SK_T; ++j) {
            const float4* x4 = reinterpret_cast<const float4*>(xs + j * cols);
            float d0 = 0.f, d1 = 0.f;
#pragma unroll
            for (int k = 0; k < F4; ++k) {
                const float4 xv = x4[swz(f + k)];
                d0 = fmaf(wq[4 * k], xv.x, d0);
                d1 = fmaf(wq[4 * k + 1], xv.y, d1);
                d0 = fmaf(wq[4 * k + 2], xv.z, d0);
                d1 = fmaf(wq[4 * k + 3], xv.w, d1);
            }
            acc[j] = fmaf(sc, d0 + d1, acc[j]);
            if (first) acc[j] = fmaf(bi, gs[j * gpr + g], acc[j]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 1)
pf_gemm_skinny(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b, int bits, int rows,
               int cols, int group, const float* __restrict__ x, int ntok, float* __restrict__ y, int ldy, int rpb) {
    extern __shared__ __align__(16) float sk_sm[];
    const int gpr = cols / group;
    float* xs = sk_sm;
    float* gs = sk_sm + PF_SK_T * cols;
    const int t0 = blockIdx.x * PF_SK_T, nt = min(PF_SK_T, ntok - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // float4 loads, SK_U in flight per thread before their stores (the staging is L2 latency).
    constexpr int SK_U = 8;
    const int total4 = PF_SK_T * cols / 4, c4 = cols / 4;
    for (int i0 = threadIdx.x; i0 < total4; i0 += 256 * SK_U) {
        float4 v[SK_U];
#pragma unroll
        for (int u = 0; u < SK_U; ++u) {
            const int i = i0 + u * 256, j = i / c4;
            v[u] = i < total4 && j < nt ? reinterpret_cast<const float4*>(x + (size_t)(t0 + j) * cols)[i % c4]
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < SK_U; ++u) {
            const int i = i0 + u * 256;
            if (i < total4) reinterpret_cast<float4*>(xs + (i / c4) * cols)[swz(i % c4)] = v[u];
        }
    }
    __syncthreads();
    for (int gi = warp; gi < PF_SK_T * gpr; gi += 8) {
        const int j = gi / gpr, g = gi % gpr;
        float v = 0.f;
        for (int c = lane; c < group; c += 32) v += xs[j * cols + g * group + c];  // swizzle stays in the group
        v = warp_sum(v);
        if (lane == 0) gs[j * gpr + g] = v;
    }
    __syncthreads();
    const size_t wpr = (size_t)cols * bits / 32;
    const int rend = min(rows, (int)blockIdx.y * rpb + rpb);
    for (int r = blockIdx.y * rpb + warp; r < rend; r += 8) {
        const uint4* w4 = reinterpret_cast<const uint4*>(w + (size_t)r * wpr);
        const u16* sr = s + (size_t)r * gpr;
        const u16* br = b + (size_t)r * gpr;
        float acc[PF_SK_T];
#pragma unroll
        for (int j = 0; j < PF_SK_T; ++j) acc[j] = 0.f;
        // Codes are converted to float once per chunk and reused by the PF_SK_T tokens.
        if (bits == 4) skinny_row<4>(w4, sr, br, xs, gs, cols, group, lane, acc);
        else skinny_row<8>(w4, sr, br, xs, gs, cols, group, lane, acc);
#pragma unroll
        for (int j = 0; j < PF_SK_T; ++j) {
            const float v = warp_sum(acc[j]);
            if (lane == j && j < nt) y[(size_t)(t0 + j) * ldy + r] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Few-row GEMMs on the tensor cores, f32-accurate (outside the exact mode): up to two matrices
// of the same codes plus a one-row third against T tokens of x, one launch (router + shared-expert
// gate, GDN b + a). Why: these products pick experts and gates, so they stay f32; on the CUDA
// cores (cuBLAS's pedantic f32 GEMM on weights dequantised per call, or pf_gemm_skinny) they were
// most of the prefill's routing phase.
//
// Exactness: a code q becomes the f16 FEW_OFF + q (exact; 1024 + q for 8 bits, one byte permute
// makes two; 16 + q for 4 bits), x the sum of two f16 terms x = hi + lo (hi = f16(x), lo = f16(x -
// hi): 22 significant bits, or 2^-25 absolute below f16's normal range), the tensor cores multiply
// exactly and sum in f32, so per 64-column group C = sum (FEW_OFF + q) x, and with X = sum x (a
// ones tile) the row gets s (C - FEW_OFF X) + b X = s C + (b - FEW_OFF s) X: the math of
// qrow_part to f32 rounding. f16 holds |x| < 65504: the caller passes only inputs it bounds (an RMSNorm's output
// is at most sqrt(cols) times its largest gain; `DevWeights::few_inputs_f16`).
//
// Layout: a warp takes 16 tokens (mma rows: lane g = lane/4 holds tokens g and g + 8) against one
// chunk of NT n-tiles of one matrix (lane g's B column in tile j is row 8j + g of the chunk) over
// a run of groups. Of each group lane t = lane%4 takes the 16 columns 16t..16t+15 (one 16- or
// 8-byte load of codes per row, four float4 of x per token). mma step s puts four of them in k
// slots (2t, 2t + 1) and (2t + 8, 2t + 9) of both operands (the sum over k does not care which
// column sits in which slot): 8-bit, columns 4s + (0, 1) and (2, 3) (word s's bytes); 4-bit,
// columns 8h + j + (0, 4) and (1, 5) with h = s / 2, j = 2 (s & 1) (nibble pairs 16 bits apart
// in word h). C columns 2t, 2t + 1 of tile j are rows 8j + 2t, + 1 of the chunk. The first
// matrix's chunks come first, then the second's. The one-row matrix (`aux`: the shared-expert
// gate) rides in the ones tile's odd columns (chunk 0's warps): C columns 2t + 1 there are its
// sums, columns 2t the group sums of x.
//
// Block: cpb x ks warps (at most FEW_WARPS) = `cpb` chunks x `ks` parts of the groups; warp w
// takes chunk blockIdx.y * cpb + w % cpb and part w / cpb. The parts' sums meet in shared memory
// and part 0 adds them in part order. grid (ceil(T / 16), ceil(chunks / cpb)). Chunks are NT
// n-tiles (8, or 4 where no matrix has more than 32 rows: GDN b and a), every tile multiplied
// (rows past the matrix read zero codes), so each term's NT + 1 products are independent mma.sync
// in a row.
#define FEW_WARPS 8
#define FEW_TILES 8

// Two floats as f16 pairs hi + lo (`a` in the low half); the difference is exact in f32.
__device__ __forceinline__ void split2_f16(float a, float b, u32& hi, u32& lo) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(b), "f"(a));
    float ha, hb;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(ha), "=f"(hb) : "r"(hi));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(b - hb), "f"(a - ha));
}

// The A fragments (hi, lo) of one mma step from the x pairs of tokens g (a0: k slots 2t, 2t + 1;
// a2: 2t + 8, 2t + 9) and g + 8 (b0, b2).
__device__ __forceinline__ void few_a_frags(float2 a0, float2 a2, float2 b0, float2 b2, u32 (&a)[2][4]) {
    split2_f16(a0.x, a0.y, a[0][0], a[1][0]);
    split2_f16(b0.x, b0.y, a[0][1], a[1][1]);
    split2_f16(a2.x, a2.y, a[0][2], a[1][2]);
    split2_f16(b2.x, b2.y, a[0][3], a[1][3]);
}

// The offset a code carries as an f16 (FEW_OFF + q, exact): 1024 for 8-bit codes (f16's spacing
// is 1 from 1024 to 2047), 16 for 4-bit ones (1/64 from 16 to 31: the nibble lands in mantissa
// bits 6..9). The small offset keeps C = FEW_OFF X + sum q x from cancelling more than it must.
template <int BITS>
__device__ constexpr float few_off() { return BITS == 8 ? 1024.f : 16.f; }

// A nibble pair (j, j + 4) of w as the f16 pair (16 + q): shifted to mantissa bits 6..9.
template <int J>
__device__ __forceinline__ u32 few_nib_pair(u32 w) {
    const u32 v = J * 4 >= 6 ? (w >> (J * 4 - 6)) : (w << (6 - J * 4));
    return (v & 0x03C003C0u) | 0x4C004C00u;
}

// The B fragment of mma step s as f16 pairs (FEW_OFF + q): from lane t's 16 codes of a group in
// `w` (8-bit: word s; 4-bit: word s / 2).
template <int BITS>
__device__ __forceinline__ void few_b_frag(u32 w, int s, u32 (&b)[2]) {
    if constexpr (BITS == 8) {
        b[0] = __byte_perm(w, 0x64646464u, 0x4140);
        b[1] = __byte_perm(w, 0x64646464u, 0x4342);
    } else if (s & 1) {
        b[0] = few_nib_pair<2>(w);
        b[1] = few_nib_pair<3>(w);
    } else {
        b[0] = few_nib_pair<0>(w);
        b[1] = few_nib_pair<1>(w);
    }
}

// Step s's x pairs from lane t's 16 columns of a group (f[i]: columns 4i .. 4i + 3): 8-bit,
// (4s, 4s + 1) and (4s + 2, 4s + 3); 4-bit, (8h + j, 8h + j + 4) and (8h + j + 1, 8h + j + 5).
template <int BITS>
__device__ __forceinline__ void few_x_pairs(const float4 (&f)[4], int s, float2& lo, float2& hi) {
    if constexpr (BITS == 8) {
        lo = make_float2(f[s].x, f[s].y);
        hi = make_float2(f[s].z, f[s].w);
    } else {
        const float4 u = f[2 * (s >> 1)], v = f[2 * (s >> 1) + 1];
        lo = (s & 1) ? make_float2(u.z, v.z) : make_float2(u.x, v.x);
        hi = (s & 1) ? make_float2(u.w, v.w) : make_float2(u.y, v.y);
    }
}

// A lane's LW consecutive code words at p (16- or 8-byte aligned) in one load; zeros for no row.
template <int LW>
__device__ __forceinline__ void few_code_words(const u32* p, u32 (&w)[LW]) {
    if constexpr (LW == 4) {
        const uint4 v = p ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
        const uint2 v = p ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
        w[0] = v.x, w[1] = v.y;
    }
}

// One matrix of a launch: codes, scales, biases, output, rows, output stride.
struct FewMat {
    const u32* w;
    const u16* s;
    const u16* b;
    float* y;
    int rows;
    int ldy;
};

// STAGED: the block's warps first split the token tile's inputs of every group into the A
// fragments (hi, lo) once, into dynamic shared memory (FEW_FRAG_BYTES per group, in the order
// the steps read them: (group, step, term) x lane, 16 bytes each), and every warp then reads
// them there. Where a block holds several chunks of the same tokens (cpb > 1) each chunk's warp
// otherwise loaded and split the same inputs again; the fragments, and so every product and
// sum, are the same bits either way.
#define FEW_FRAG_BYTES (4 * 2 * 32 * 16)
template <int BITS, int NT, bool STAGED>
__device__ __forceinline__ void pf_few_tc_body(const float* __restrict__ x, int T, int cols, const FewMat& m0,
                                               const FewMat& m1, const FewMat& aux, int cpb, int ks) {
    __shared__ float part_sums[FEW_WARPS][4 * FEW_TILES + 2][32];
    extern __shared__ uint4 few_frag[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int chunk = blockIdx.y * cpb + warp % cpb, part = warp / cpb;
    const int gpr = cols >> 6, G0 = part * gpr / ks, G1 = (part + 1) * gpr / ks;
    // The chunk's matrix (its fields in registers), first row and rows (none past the last chunk).
    const int chunks0 = (m0.rows + 8 * NT - 1) / (8 * NT);
    const bool second = chunk >= chunks0;
    const u32* mw = second ? m1.w : m0.w;
    const u16* ms = second ? m1.s : m0.s;
    const u16* mb = second ? m1.b : m0.b;
    const int mrows = second ? m1.rows : m0.rows;
    const int lr0 = 8 * NT * (second ? chunk - chunks0 : chunk), nrows = min(8 * NT, max(0, mrows - lr0));
    const int tok0 = 16 * blockIdx.x + g, tok1 = tok0 + 8;
    const bool v0 = tok0 < T, v1 = tok1 < T;
    const bool with_aux = aux.w != nullptr && chunk == 0, aux_col = with_aux && (g & 1);
    // Words of codes per row and per group (GW); lane t's codes of group 0 in this lane's B row
    // of tile 0 (tile j: 8j rows on, tw words each) and in the aux row.
    constexpr int GW = 64 * BITS / 32;
    const int wpr = cols * BITS / 32, tw = 8 * wpr;
    const u32* wq = mw + (size_t)(lr0 + g) * wpr + t * (GW / 4);
    const u32* wa = aux.w + t * (GW / 4);
    // This lane's scales / biases of its C rows (8j + 2t, + 1) at group 0: rows past the matrix
    // read its last row's (their sums are never written), so the loads need no predicate.
    const int last = max(nrows - 1, 0);
    const u16* sp = ms + (size_t)(lr0 + min(2 * t, last)) * gpr;
    const u16* bp = mb + (size_t)(lr0 + min(2 * t, last)) * gpr;
    const float4* xa = reinterpret_cast<const float4*>(x + (size_t)min(tok0, T - 1) * cols) + 4 * t;
    const float4* xb = reinterpret_cast<const float4*>(x + (size_t)min(tok1, T - 1) * cols) + 4 * t;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    // Group G's columns of this lane's two tokens (zeros past T).
    auto load_x = [&](int G, float4 (&fa)[4], float4 (&fb)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            fa[i] = v0 ? __ldg(xa + 16 * G + i) : zero4;
            fb[i] = v1 ? __ldg(xb + 16 * G + i) : zero4;
        }
    };
    if constexpr (STAGED) {
        const int nw = cpb * ks;
        for (int G = warp; G < gpr; G += nw) {
            float4 fa[4], fb[4];
            load_x(G, fa, fb);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                u32 a[2][4];
                float2 a0, a2, b0, b2;
                few_x_pairs<BITS>(fa, s, a0, a2);
                few_x_pairs<BITS>(fb, s, b0, b2);
                few_a_frags(a0, a2, b0, b2, a);
#pragma unroll
                for (int n = 0; n < 2; ++n)
                    few_frag[((G * 4 + s) * 2 + n) * 32 + lane] = make_uint4(a[n][0], a[n][1], a[n][2], a[n][3]);
            }
        }
        __syncthreads();
    }
    float tot[NT][4], atot[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NT; ++j) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.f;
    // A chunk past the last rows (the grid's last block) reads nothing and only meets the barrier.
    const int Gend = nrows > 0 ? G1 : G0;
    for (int G = G0; G < Gend; ++G) {
        float acc[NT][4], one[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        float4 fa[4], fb[4];
        if constexpr (!STAGED) load_x(G, fa, fb);
        // This lane's code words of the group for each tile's row (one 16- or 8-byte load) and
        // the aux row: word s (8-bit) or s / 2 (4-bit) feeds step s.
        constexpr int LW = BITS == 8 ? 4 : 2;
        u32 cw[NT][LW], cx[LW];
        const u32* wg = wq + G * GW;
#pragma unroll
        for (int j = 0; j < NT; ++j) few_code_words<LW>(8 * j + g < nrows ? wg + j * tw : nullptr, cw[j]);
        if (aux_col) few_code_words<LW>(wa + G * GW, cx);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[2][4], b[NT][2], o[2] = {0x3C003C00u, 0x3C003C00u};  // o: f16 pairs (1, 1)
            if constexpr (STAGED) {
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    const uint4 f = few_frag[((G * 4 + s) * 2 + n) * 32 + lane];
                    a[n][0] = f.x, a[n][1] = f.y, a[n][2] = f.z, a[n][3] = f.w;
                }
            } else {
                float2 a0, a2, b0, b2;
                few_x_pairs<BITS>(fa, s, a0, a2);
                few_x_pairs<BITS>(fb, s, b0, b2);
                few_a_frags(a0, a2, b0, b2, a);
            }
            const int wi = BITS == 8 ? s : s >> 1;
#pragma unroll
            for (int j = 0; j < NT; ++j) few_b_frag<BITS>(cw[j][wi], s, b[j]);
            if (aux_col) few_b_frag<BITS>(cx[wi], s, o);
            // The small term first; each term's NT + 1 products are independent.
#pragma unroll
            for (int n = 1; n >= 0; --n) {
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_f16(acc[j], a[n], b[j][0], b[j][1]);
                mma_f16(one, a[n], o[0], o[1]);
            }
        }
        // The group's scales: C holds sum (FEW_OFF + q) x, so a row adds s C + (b - FEW_OFF s) X,
        // with X = one[0] (token g) and one[2] (token g + 8).
        constexpr float off = few_off<BITS>();
        const u16 *sg = sp + G, *bg = bp + G;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            // Row 8j + 2t and the next (each clamped to the last row).
            const int ra = min(8 * j + 2 * t, last) - min(2 * t, last), rb = min(8 * j + 2 * t + 1, last) - min(2 * t, last);
            const float sa = bf16f(__ldg(sg + ra * gpr)), ba = bf16f(__ldg(bg + ra * gpr));
            const float sb = bf16f(__ldg(sg + rb * gpr)), bb = bf16f(__ldg(bg + rb * gpr));
            const float ca = fmaf(-off, sa, ba), cb = fmaf(-off, sb, bb);
            tot[j][0] = fmaf(ca, one[0], fmaf(sa, acc[j][0], tot[j][0]));
            tot[j][1] = fmaf(cb, one[0], fmaf(sb, acc[j][1], tot[j][1]));
            tot[j][2] = fmaf(ca, one[2], fmaf(sa, acc[j][2], tot[j][2]));
            tot[j][3] = fmaf(cb, one[2], fmaf(sb, acc[j][3], tot[j][3]));
        }
        if (with_aux) {
            const float sx = bf16f(__ldg(aux.s + G)), cx = fmaf(-off, sx, bf16f(__ldg(aux.b + G)));
            atot[0] = fmaf(cx, one[0], fmaf(sx, one[1], atot[0]));
            atot[1] = fmaf(cx, one[2], fmaf(sx, one[3], atot[1]));
        }
    }
    if (ks > 1) {
        // Part 0 of each chunk adds the other parts' sums in part order.
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) part_sums[warp][4 * j + c][lane] = tot[j][c];
        part_sums[warp][4 * FEW_TILES][lane] = atot[0];
        part_sums[warp][4 * FEW_TILES + 1][lane] = atot[1];
        __syncthreads();
        if (part != 0) return;
        for (int p = 1; p < ks; ++p) {
            const int w = p * cpb + warp;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) tot[j][c] += part_sums[w][4 * j + c][lane];
            atot[0] += part_sums[w][4 * FEW_TILES][lane];
            atot[1] += part_sums[w][4 * FEW_TILES + 1][lane];
        }
    }
    float* y = (second ? m1.y : m0.y) + lr0 + 2 * t;
    const int ldy = second ? m1.ldy : m0.ldy;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int r = 8 * j + 2 * t;
        if (r < nrows) {
            if (v0) y[(size_t)tok0 * ldy + 8 * j] = tot[j][0];
            if (v1) y[(size_t)tok1 * ldy + 8 * j] = tot[j][2];
        }
        if (r + 1 < nrows) {
            if (v0) y[(size_t)tok0 * ldy + 8 * j + 1] = tot[j][1];
            if (v1) y[(size_t)tok1 * ldy + 8 * j + 1] = tot[j][3];
        }
    }
    if (with_aux && t == 0) {
        if (v0) aux.y[(size_t)tok0 * aux.ldy] = atot[0];
        if (v1) aux.y[(size_t)tok1 * aux.ldy] = atot[1];
    }
}

#define PF_FEW_TC(BITS, NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * FEW_WARPS, 1)                                          \
        pf_few_tc_##BITS##_##NT(const float* __restrict__ x, int T, int cols, FewMat m0, FewMat m1, FewMat aux, \
                                int cpb, int ks) {                                                           \
        pf_few_tc_body<BITS, NT, false>(x, T, cols, m0, m1, aux, cpb, ks);                                   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * FEW_WARPS, 1)                                          \
        pf_few_tc_s_##BITS##_##NT(const float* __restrict__ x, int T, int cols, FewMat m0, FewMat m1,         \
                                  FewMat aux, int cpb, int ks) {                                             \
        pf_few_tc_body<BITS, NT, true>(x, T, cols, m0, m1, aux, cpb, ks);                                    \
    }
PF_FEW_TC(4, 4)
PF_FEW_TC(4, 8)
PF_FEW_TC(8, 4)
PF_FEW_TC(8, 8)

// ---------------------------------------------------------------------------------------------
// Embedding gather for T tokens: grid (ceil(cols/256), T). Token t's id is tokens[t * ld] (ld 2:
// the [token, position] step rows of a batched decode).
extern "C" __global__ void pf_embed(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
                                    const int* __restrict__ tokens, int ld, int cols, int bits, int group,
                                    float* __restrict__ x) {
    const int t = blockIdx.y, tok = tokens[(size_t)t * ld];
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    size_t wpr = (size_t)cols * bits / 32;
    int gpr = cols / group, per = 32 / bits;
    u32 mask = (1u << bits) - 1u;
    u32 q = (w[(size_t)tok * wpr + c / per] >> (bits * (c % per))) & mask;
    int g = c / group;
    x[(size_t)t * cols + c] = bf16f(s[(size_t)tok * gpr + g]) * (float)q + bf16f(b[(size_t)tok * gpr + g]);
}
