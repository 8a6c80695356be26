// Batched prefill (T > 1 tokens per call), see docs/cuda-prefill.md and src/backend/cuda/prefill.rs.
// Activations are token-major f32 [T][dim]. Same math as the CPU reference
// (src/backend/cpu/{qmatmul,gdn,attention,moe}.rs); the GDN scan is the exact recurrence
// (gdn::recurrent_step) run over the chunk with the state in registers.

// ---------------------------------------------------------------------------------------------
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
        const int* __restrict__ counts, const int* __restrict__ offsets, const int* __restrict__ list, int xdiv) {
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
                uint2 q = rvalid ? __ldg(reinterpret_cast<const uint2*>(wrow + (k0 >> 3)) + lhalf) : make_uint2(0, 0);
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
// (mma.sync m16n8k16). Per k-tile of 64 columns the weight tile (128 rows) is dequantised
// (s*q + b, f32) and rounded to bf16 into shared memory, the activation tile (64 tokens) is
// rounded to bf16 on the way in; the next tile's global loads are issued before the current
// tile's mma so their latency hides behind the math. 8 warps as 4 (rows) x 2 (tokens), 32x32
// outputs per warp. Needs cols % 64 == 0 and group % 32 == 0.
// Grouped (MoE) mode: `tiles` = [ntiles, (expert, first token)...] from pf_scan; blockIdx.y is
// the tile (blocks past ntiles exit).
// SwiGLU mode (w2 != nullptr): the block's 128 shared-memory rows are 64 rows of W (gate) and the
// same 64 rows of W2 (up), interleaved per 16 so every warp holds both for the same outputs; the
// epilogue writes silu(gate) * up. grid.x = ceil(rows / 64) then, else ceil(rows / 128).
#define TC_BM 128
#define TC_BN 64
#define TC_BK 64
#define TC_LD (TC_BK + 8)

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// mma_bf16 (m16n8k16, bf16 in, f32 accumulate) is in common.cuh: decode uses it too.
// 8 nibbles (columns 0..7 of `q`) dequantised and packed as 4 bf16 pairs.
__device__ __forceinline__ uint4 deq_nib8(u32 q, float sc, float bi) {
    uint4 r;
    r.x = pack_bf16(fmaf(sc, code_f(q & 15u), bi), fmaf(sc, code_f((q >> 4) & 15u), bi));
    r.y = pack_bf16(fmaf(sc, code_f((q >> 8) & 15u), bi), fmaf(sc, code_f((q >> 12) & 15u), bi));
    r.z = pack_bf16(fmaf(sc, code_f((q >> 16) & 15u), bi), fmaf(sc, code_f((q >> 20) & 15u), bi));
    r.w = pack_bf16(fmaf(sc, code_f((q >> 24) & 15u), bi), fmaf(sc, code_f(q >> 28), bi));
    return r;
}
// 8 bytes (two words, columns 0..7) dequantised and packed.
__device__ __forceinline__ uint4 deq_byte8(u32 q0, u32 q1, float sc, float bi) {
    uint4 r;
    r.x = pack_bf16(fmaf(sc, code_f(q0 & 255u), bi), fmaf(sc, code_f((q0 >> 8) & 255u), bi));
    r.y = pack_bf16(fmaf(sc, code_f((q0 >> 16) & 255u), bi), fmaf(sc, code_f(q0 >> 24), bi));
    r.z = pack_bf16(fmaf(sc, code_f(q1 & 255u), bi), fmaf(sc, code_f((q1 >> 8) & 255u), bi));
    r.w = pack_bf16(fmaf(sc, code_f((q1 >> 16) & 255u), bi), fmaf(sc, code_f(q1 >> 24), bi));
    return r;
}

// ---------------------------------------------------------------------------------------------
// Operands of the cuBLAS GEMMs (src/backend/cuda/blas.rs), used for chunks of many tokens.
// A whole quantised matrix dequantised to bf16 [rows][cols], with exactly pf_gemm_tc's rounding
// (deq_nib8 / deq_byte8), or to f32 for the few-row GEMMs that pick experts and gates.
// One thread per 8 columns (never straddles a group: groups are multiples of 32).
// grid ceil(rows * cols / 8 / 256), block 256.
// Item i = row r, columns 8k..8k+7: the 8 values s*q + b in f32, each one fmaf as in deq_nib8 /
// deq_byte8 (so the bf16 kernel's rounding is pf_gemm_tc's exactly). False past the matrix.
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
    float v[8];
    if (!deq_item(w, s, b, bits, rows, cols, group, i, v)) return;
    out[i] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}
extern "C" __global__ void pf_dequant_f32(const u32* __restrict__ w, const u16* __restrict__ s,
                                          const u16* __restrict__ b, int bits, int rows, int cols, int group,
                                          float4* __restrict__ out) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    float v[8];
    if (!deq_item(w, s, b, bits, rows, cols, group, i, v)) return;
    out[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
    out[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
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
    float sc = 0.f, bi = 0.f;
    float4 xv[4];
    auto load = [&](int k0) {
        if (rvalid) {
            const int g = (k0 + lhalf * 32) / group;
            sc = bf16f(__ldg(srow + g));
            bi = bf16f(__ldg(brow + g));
            if (bits == 4) {
                qa = __ldg(reinterpret_cast<const uint4*>(wrow + (k0 >> 3)) + lhalf);
            } else {
                const uint4* p = reinterpret_cast<const uint4*>(wrow + (k0 >> 2)) + lhalf * 2;
                qa = __ldg(p);
                qb = __ldg(p + 1);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * 256, tok = idx >> 4, f = idx & 15;
            const int xr = xrow[tok];
            xv[i] = xr >= 0 ? __ldg(reinterpret_cast<const float4*>(x + (size_t)xr * cols + k0) + f)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store = [&](int buf) {
        uint4* dst = reinterpret_cast<uint4*>(As + buf * TC_BM * TC_LD + lrow * TC_LD + lhalf * 32);
        if (!rvalid) {
            const uint4 z = make_uint4(0, 0, 0, 0);
            dst[0] = z; dst[1] = z; dst[2] = z; dst[3] = z;
        } else if (bits == 4) {
            dst[0] = deq_nib8(qa.x, sc, bi);
            dst[1] = deq_nib8(qa.y, sc, bi);
            dst[2] = deq_nib8(qa.z, sc, bi);
            dst[3] = deq_nib8(qa.w, sc, bi);
        } else {
            dst[0] = deq_byte8(qa.x, qa.y, sc, bi);
            dst[1] = deq_byte8(qa.z, qa.w, sc, bi);
            dst[2] = deq_byte8(qb.x, qb.y, sc, bi);
            dst[3] = deq_byte8(qb.z, qb.w, sc, bi);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * 256, tok = idx >> 4, f = idx & 15;
            uint2 v;
            v.x = pack_bf16(xv[i].x, xv[i].y);
            v.y = pack_bf16(xv[i].z, xv[i].w);
            *reinterpret_cast<uint2*>(Bs + buf * TC_BN * TC_LD + tok * TC_LD + f * 4) = v;
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
// as stage_x) with their per-group sums; each warp takes rows r = blockIdx.y*256 + warp + 8i and
// dots every weight chunk it loads with all PF_SK_T tokens, so the weights are read once per
// PF_SK_T tokens. Bias folded per group, as the CPU qmatmul and the decode row dot.
// grid (ceil(T / PF_SK_T), ceil(rows / 256)), block 256,
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
               int cols, int group, const float* __restrict__ x, int ntok, float* __restrict__ y, int ldy) {
    extern __shared__ __align__(16) float sk_sm[];
    const int gpr = cols / group;
    float* xs = sk_sm;
    float* gs = sk_sm + PF_SK_T * cols;
    const int t0 = blockIdx.x * PF_SK_T, nt = min(PF_SK_T, ntok - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < PF_SK_T * cols; i += 256) {
        const int j = i / cols, c = i % cols;
        xs[j * cols + swz_elem(c)] = j < nt ? x[(size_t)(t0 + j) * cols + c] : 0.f;
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
    const int rend = min(rows, (int)blockIdx.y * 256 + 256);
    for (int r = blockIdx.y * 256 + warp; r < rend; r += 8) {
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
// Embedding gather for T tokens: grid (ceil(cols/256), T).
extern "C" __global__ void pf_embed(const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
                                    const int* __restrict__ tokens, int cols, int bits, int group, float* __restrict__ x) {
    const int t = blockIdx.y, tok = tokens[t];
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    size_t wpr = (size_t)cols * bits / 32;
    int gpr = cols / group, per = 32 / bits;
    u32 mask = (1u << bits) - 1u;
    u32 q = (w[(size_t)tok * wpr + c / per] >> (bits * (c % per))) & mask;
    int g = c / group;
    x[(size_t)t * cols + c] = bf16f(s[(size_t)tok * gpr + g]) * (float)q + bf16f(b[(size_t)tok * gpr + g]);
}

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

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet.
// Causal depthwise conv + SiLU over T tokens at positions pos0.. (history from the ring):
// grid (ceil(C/256), T).
extern "C" __global__ void pf_gdn_conv(const float* __restrict__ qkv, const float* __restrict__ ring,
                                       const float* __restrict__ taps, int T, int C, int KC, int pos0,
                                       float* __restrict__ out) {
    const int t = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float acc = 0.f;
    for (int j = 0; j < KC; ++j) {
        int p = pos0 + t - (KC - 1) + j;
        float in = p >= pos0 ? qkv[(size_t)(p - pos0) * C + ch] : (p < 0 ? 0.f : ring[(size_t)(p % KC) * C + ch]);
        acc += taps[(size_t)j * C + ch] * in;
    }
    out[(size_t)t * C + ch] = silu_f(acc);
}

// After the conv: the ring slots of the last min(T, KC) positions get their pre-conv inputs.
// grid (ceil(C/256), min(T, KC)).
extern "C" __global__ void pf_gdn_ring(const float* __restrict__ qkv, float* __restrict__ ring, int T, int C, int KC,
                                       int pos0) {
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const int t = T - 1 - blockIdx.y, p = pos0 + t;
    ring[(size_t)(p % KC) * C + ch] = qkv[(size_t)t * C + ch];
}

// L2 norm of q and k per (token, key head) (eps 1e-6, in f64 like ops::l2_normalize), q scaled
// by dk^-1/2: grid (T, nk), block dk.
extern "C" __global__ void pf_gdn_qk(const float* __restrict__ conv, int C, int nk, int dk, float* __restrict__ qn,
                                     float* __restrict__ kn) {
    __shared__ float red[33];
    const int t = blockIdx.x, kh = blockIdx.y, i = threadIdx.x, key_dim = nk * dk;
    float q = conv[(size_t)t * C + kh * dk + i];
    float k = conv[(size_t)t * C + key_dim + kh * dk + i];
    float sq = block_sum(q * q, red);
    float sk = block_sum(k * k, red);
    float iq = (float)(1.0 / sqrt((double)sq + 1e-6)), ik = (float)(1.0 / sqrt((double)sk + 1e-6));
    qn[(size_t)t * key_dim + kh * dk + i] = q * iq * (1.f / sqrtf((float)dk));
    kn[(size_t)t * key_dim + kh * dk + i] = k * ik;
}

// The delta-rule recurrence over T tokens (gdn::recurrent_step: S = aS; d = b(v - S^T k);
// S += k d^T; o = S^T q). Every state column evolves on its own, so a column is split over PARTS
// lanes, each holding R = DK/PARTS rows of it in registers (read once, written once; no spills),
// and the dot products are reduced with PARTS-wide shuffles. One pass over the state per token:
// S_t = a_t S_{t-1} + k_t d_t, then o_t = S_t^T q_t and p = S_t^T k_{t+1} (the next token's
// S^T k is a_{t+1} p) in the same loop, both reduced together. Block = 4 warps = 4*32/PARTS
// columns of one value head; q/k of PF_GDN_TB tokens are copied into shared memory with
// cp.async a block of tokens ahead (double buffer), v and the raw gates through registers, so no
// global load sits on the per-token chain. q/k rows are stored padded per part (stride R+4
// floats) so the PARTS distinct float4 reads of a step hit distinct banks.
// grid (nv, ceil(dv / (128/PARTS))), block 128.
#define PF_GDN_TB 16
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

template <int DK>
__device__ void gdn_scan(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ conv,
                         const float* __restrict__ braw, const float* __restrict__ araw,
                         const float* __restrict__ dt_bias, const float* __restrict__ neg_a, float* __restrict__ state,
                         float* __restrict__ o, int T, int nk, int nv, int dv, int C) {
    constexpr int PARTS = DK >= 128 ? 8 : (DK >= 64 ? 4 : 2);
    constexpr int R = DK / PARTS, RS = R + 4, KS = PARTS * RS, CPW = 32 / PARTS, BC = 4 * CPW;
    constexpr int TB = PF_GDN_TB, NV = TB * BC / 128;
    __shared__ __align__(16) float qs[2][TB][KS];
    __shared__ __align__(16) float ks[2][TB][KS];
    __shared__ float vs[2][TB][BC];
    __shared__ float gb[2][TB], ga[2][TB];
    const int n = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int part = lane % PARTS, cl = warp * CPW + lane / PARTS;
    const int c0 = blockIdx.y * BC, c = c0 + cl;
    const bool cvalid = c < dv;
    const int kh = n / (nv / nk), key_dim = nk * DK;
    float* S = state + (size_t)n * DK * dv;
    float sreg[R];
#pragma unroll
    for (int i = 0; i < R; ++i) sreg[i] = cvalid ? S[(size_t)(part * R + i) * dv + c] : 0.f;
    const float nega = neg_a[n], dtb = dt_bias[n];
    const float* vsrc = conv + 2 * key_dim + (size_t)n * dv + c0;
    float pv[NV];
    float pb = 0.f, pa = 0.f;
    // Starts the copies of block tb into buffer bf (q/k by cp.async, v and raw gates to registers).
    auto issue = [&](int tb, int bf) {
        const int nt = min(TB, T - tb);
        for (int idx = tid; idx < nt * (DK / 4); idx += 128) {
            const int tt = idx / (DK / 4), i = (idx % (DK / 4)) * 4;
            const int d = (i / R) * RS + (i % R);
            const size_t off = (size_t)(tb + tt) * key_dim + kh * DK + i;
            cp_async16(&qs[bf][tt][d], qn + off);
            cp_async16(&ks[bf][tt][d], kn + off);
        }
        cp_async_commit();
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int idx = tid + 128 * j, tt = idx / BC, cc = idx % BC;
            pv[j] = (tt < nt && c0 + cc < dv) ? vsrc[(size_t)(tb + tt) * C + cc] : 0.f;
        }
        if (tid < nt) {
            pb = braw[(size_t)(tb + tid) * nv + n];
            pa = araw[(size_t)(tb + tid) * nv + n];
        }
    };
    // Completes block tb in buffer bf: waits for its copies, stores v and the gates. Ends synced.
    auto stage = [&](int tb, int bf) {
        const int nt = min(TB, T - tb);
        cp_async_wait_all();
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int idx = tid + 128 * j;
            vs[bf][idx / BC][idx % BC] = pv[j];
        }
        if (tid < nt) {
            gb[bf][tid] = sigmoid_f(pb);
            ga[bf][tid] = expf(nega * softplus_f(pa + dtb));
        }
        __syncthreads();
    };
    issue(0, 0);
    stage(0, 0);
    if (TB < T) issue(TB, 1);
    // p = S_0^T k_0.
    float p;
    {
        const float4* k4 = reinterpret_cast<const float4*>(&ks[0][0][part * RS]);
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int f = 0; f < R / 4; ++f) {
            const float4 kk = k4[f];
            a0 = fmaf(sreg[4 * f], kk.x, a0);
            a1 = fmaf(sreg[4 * f + 1], kk.y, a1);
            a2 = fmaf(sreg[4 * f + 2], kk.z, a2);
            a3 = fmaf(sreg[4 * f + 3], kk.w, a3);
        }
        p = (a0 + a1) + (a2 + a3);
#pragma unroll
        for (int m = 1; m < PARTS; m <<= 1) p += __shfl_xor_sync(0xffffffffu, p, m);
    }
    int bf = 0;
    for (int tb = 0; tb < T; tb += TB) {
        const int nt = min(TB, T - tb);
        const bool more = tb + TB < T;
        for (int tt = 0; tt < nt; ++tt) {
            const bool last = tt == nt - 1;
            if (last && more) stage(tb + TB, bf ^ 1);  // the next token's k lives there
            const float alpha = ga[bf][tt], beta = gb[bf][tt], v = vs[bf][tt][cl];
            const float delta = beta * (v - alpha * p);
            const float4* k4 = reinterpret_cast<const float4*>(&ks[bf][tt][part * RS]);
            const float4* q4 = reinterpret_cast<const float4*>(&qs[bf][tt][part * RS]);
            const float4* n4 = reinterpret_cast<const float4*>(last ? &ks[bf ^ 1][0][part * RS]
                                                                    : &ks[bf][tt + 1][part * RS]);
            float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f, p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
            for (int f = 0; f < R / 4; ++f) {
                const float4 kk = k4[f], qq = q4[f], nn = n4[f];
                sreg[4 * f] = fmaf(sreg[4 * f], alpha, kk.x * delta);
                sreg[4 * f + 1] = fmaf(sreg[4 * f + 1], alpha, kk.y * delta);
                sreg[4 * f + 2] = fmaf(sreg[4 * f + 2], alpha, kk.z * delta);
                sreg[4 * f + 3] = fmaf(sreg[4 * f + 3], alpha, kk.w * delta);
                o0 = fmaf(sreg[4 * f], qq.x, o0);
                o1 = fmaf(sreg[4 * f + 1], qq.y, o1);
                o2 = fmaf(sreg[4 * f + 2], qq.z, o2);
                o3 = fmaf(sreg[4 * f + 3], qq.w, o3);
                p0 = fmaf(sreg[4 * f], nn.x, p0);
                p1 = fmaf(sreg[4 * f + 1], nn.y, p1);
                p2 = fmaf(sreg[4 * f + 2], nn.z, p2);
                p3 = fmaf(sreg[4 * f + 3], nn.w, p3);
            }
            float ov = (o0 + o1) + (o2 + o3);
            p = (p0 + p1) + (p2 + p3);
#pragma unroll
            for (int m = 1; m < PARTS; m <<= 1) {
                ov += __shfl_xor_sync(0xffffffffu, ov, m);
                p += __shfl_xor_sync(0xffffffffu, p, m);
            }
            if (part == 0 && cvalid) o[(size_t)(tb + tt) * nv * dv + (size_t)n * dv + c] = ov;
        }
        __syncthreads();  // buffer bf is free again
        if (tb + 2 * TB < T) issue(tb + 2 * TB, bf);
        bf ^= 1;
    }
    if (cvalid) {
#pragma unroll
        for (int i = 0; i < R; ++i) S[(size_t)(part * R + i) * dv + c] = sreg[i];
    }
}

#define PF_GDN_SCAN(DK)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) pf_gdn_scan_##DK(                                           \
        const float* qn, const float* kn, const float* conv, const float* braw, const float* araw,                 \
        const float* dt_bias, const float* neg_a, float* state, float* o, int T, int nk, int nv, int dv, int C) {   \
        gdn_scan<DK>(qn, kn, conv, braw, araw, dt_bias, neg_a, state, o, T, nk, nv, dv, C);                        \
    }
PF_GDN_SCAN(32)
PF_GDN_SCAN(64)
PF_GDN_SCAN(128)

// Gated RMSNorm per (token, value head): norm(o) * w * silu(z). grid (T, nv), block dv.
extern "C" __global__ void pf_gdn_norm(const float* __restrict__ o, const float* __restrict__ z,
                                       const float* __restrict__ norm_w, float* __restrict__ y, int nv, int dv,
                                       float eps) {
    __shared__ float red[33];
    const int t = blockIdx.x, n = blockIdx.y, j = threadIdx.x;
    size_t idx = (size_t)t * nv * dv + n * dv + j;
    float v = o[idx];
    float ss = block_sum(v * v, red);
    float inv = inv_rms_from(ss, dv, eps);
    y[idx] = v * inv * norm_w[j] * silu_f(z[idx]);
}

// ---------------------------------------------------------------------------------------------
// Attention.
// q/k RMSNorm + partial NeoX RoPE + KV append for T tokens: grid (T, nh + nkv), block hd.
// KV: the cache element (float, or u16 = bf16 for bf16-KV sequences; common.cuh kv_st).
template <typename KV>
__device__ void pf_attn_prep_impl(const float* __restrict__ qg, const float* __restrict__ kraw,
                                  const float* __restrict__ vraw, const float* __restrict__ q_norm,
                                  const float* __restrict__ k_norm, const double* __restrict__ inv_freq,
                                  float* __restrict__ qout, float* __restrict__ gate, KV* __restrict__ kcache,
                                  KV* __restrict__ vcache, int pos0, int nh, int nkv, int hd, int half_rot,
                                  float eps) {
    extern __shared__ float sm[];
    float* xs = sm;
    float* red = sm + hd;
    const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x, pos = pos0 + t;
    const bool is_q = h < nh;
    const int kvh = h - nh;
    const size_t kv_dim = (size_t)nkv * hd;
    const float* qrow = qg + (size_t)t * 2 * nh * hd;
    const float v = is_q ? qrow[(size_t)h * 2 * hd + j] : kraw[(size_t)t * kv_dim + kvh * hd + j];
    float c, sn;
    rope_cos_sin(pos, inv_freq, j, half_rot, c, sn);
    const float out = head_norm_rope(v, is_q ? q_norm[j] : k_norm[j], c, sn, hd, half_rot, eps, xs, red);
    if (is_q) {
        qout[((size_t)t * nh + h) * hd + j] = out;
        gate[((size_t)t * nh + h) * hd + j] = qrow[(size_t)h * 2 * hd + hd + j];
    } else {
        kv_st(kcache + (size_t)pos * kv_dim + kvh * hd + j, out);
        kv_st(vcache + (size_t)pos * kv_dim + kvh * hd + j, vraw[(size_t)t * kv_dim + kvh * hd + j]);
    }
}
#define PF_ATTN_PREP(NAME, KV)                                                                                   \
    extern "C" __global__ void NAME(const float* qg, const float* kraw, const float* vraw, const float* q_norm,  \
                                    const float* k_norm, const double* inv_freq, float* qout, float* gate,       \
                                    KV* kcache, KV* vcache, int pos0, int nh, int nkv, int hd, int half_rot,     \
                                    float eps) {                                                                 \
        pf_attn_prep_impl<KV>(qg, kraw, vraw, q_norm, k_norm, inv_freq, qout, gate, kcache, vcache, pos0, nh,   \
                              nkv, hd, half_rot, eps);                                                           \
    }
PF_ATTN_PREP(pf_attn_prep, float)
PF_ATTN_PREP(pf_attn_prep_bf16, u16)

// Causal attention over the cache (positions 0..=pos0+t), flash style: block = (64 / group query
// tokens) x (the group's q heads) = 64 rows of one kv head; 8 warps, 8 rows each. K/V tiles of 32
// positions in shared memory are shared by all 64 rows; lane = key for the scores (one max and one
// sum reduction per tile per row), lane = dims for the output. Online softmax, then the sigmoid
// output gate. grid (ceil(T / (64/group)), nkv), block 256,
// dynamic smem (64*HD + 32*(HD+4) + 32*HD) floats.
template <int HD, typename KV>
__device__ void pf_attn(const float* __restrict__ q, const float* __restrict__ gate, const KV* __restrict__ kc,
                        const KV* __restrict__ vc, int T, int pos0, int nh, int nkv, float scale,
                        float* __restrict__ out) {
    constexpr int P = HD / 32, KS = HD + 4;
    extern __shared__ __align__(16) float pfa_sm[];
    float* Qs = pfa_sm;               // [64][HD]
    float* Ks = Qs + 64 * HD;     // [32][HD+4]
    float* Vs = Ks + 32 * KS;     // [32][HD]
    const int group = nh / nkv, qt = 64 / group;
    const int kvh = blockIdx.y, tok0 = blockIdx.x * qt;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t kv_dim = (size_t)nkv * HD;
    for (int idx = threadIdx.x; idx < 64 * (HD / 4); idx += blockDim.x) {
        int r = idx / (HD / 4), f = idx % (HD / 4);
        int t = tok0 + r / group, h = kvh * group + r % group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < T) v = reinterpret_cast<const float4*>(q + ((size_t)t * nh + h) * HD)[f];
        reinterpret_cast<float4*>(Qs + r * HD)[f] = v;
    }
    float m[8], l[8], o[8][P];
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        m[rr] = NEG_INF;
        l[rr] = 0.f;
#pragma unroll
        for (int i = 0; i < P; ++i) o[rr][i] = 0.f;
    }
    const int last_t = min(T - 1, tok0 + qt - 1);
    const int nkeys = pos0 + last_t + 1;
    for (int kt = 0; kt < nkeys; kt += 32) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < 32 * (HD / 4); idx += blockDim.x) {
            int kr = idx / (HD / 4), f = idx % (HD / 4);
            int p = kt + kr;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (p < nkeys) {
                kv = kv_ld4(kc + (size_t)p * kv_dim + kvh * HD + 4 * f, false);
                vv = kv_ld4(vc + (size_t)p * kv_dim + kvh * HD + 4 * f, false);
            }
            reinterpret_cast<float4*>(Ks + kr * KS)[f] = kv;
            reinterpret_cast<float4*>(Vs + kr * HD)[f] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 8; ++rr) {
            const int r = warp + 8 * rr;
            const int t = tok0 + r / group;
            if (t >= T) continue;
            const int pq = pos0 + t;
            if (kt > pq) continue;
            const float4* qr = reinterpret_cast<const float4*>(Qs + r * HD);
            const float4* kr = reinterpret_cast<const float4*>(Ks + lane * KS);
            float d0 = 0.f, d1 = 0.f;
#pragma unroll 8
            for (int f = 0; f < HD / 4; ++f) {
                float4 a = qr[f], bb = kr[f];
                d0 = fmaf(a.x, bb.x, d0);
                d1 = fmaf(a.y, bb.y, d1);
                d0 = fmaf(a.z, bb.z, d0);
                d1 = fmaf(a.w, bb.w, d1);
            }
            float sc = (d0 + d1) * scale;
            if (kt + lane > pq) sc = NEG_INF;
            const float mt = warp_max(sc);
            const float mn = fmaxf(m[rr], mt);
            const float corr = expf(m[rr] - mn);
            const float p = expf(sc - mn);
            l[rr] = l[rr] * corr + warp_sum(p);
            m[rr] = mn;
#pragma unroll
            for (int i = 0; i < P; ++i) o[rr][i] *= corr;
            const int jmax = min(32, pq - kt + 1);
            for (int j = 0; j < jmax; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < P; ++i) o[rr][i] = fmaf(pj, Vs[j * HD + i * 32 + lane], o[rr][i]);
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < 8; ++rr) {
        const int r = warp + 8 * rr;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        if (t >= T) continue;
        const float il = 1.f / l[rr];
#pragma unroll
        for (int i = 0; i < P; ++i) {
            size_t idx = ((size_t)t * nh + h) * HD + i * 32 + lane;
            out[idx] = (o[rr][i] * il) * sigmoid_f(gate[idx]);
        }
    }
}

#define PF_ATTN(HD, KV, SUFFIX)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) pf_attn_##HD##SUFFIX(const float* q, const float* gate,     \
                                                                           const KV* kc, const KV* vc, int T,     \
                                                                           int pos0, int nh, int nkv,             \
                                                                           float scale, float* out) {             \
        pf_attn<HD, KV>(q, gate, kc, vc, T, pos0, nh, nkv, scale, out);                                            \
    }
FOR_EACH_ATTN_INSTANCE(PF_ATTN)

// Tensor-core causal attention (bf16 mma.sync, f32 accumulate and softmax), flash style. Same
// block shape as pf_attn: 64 rows = (64/group query tokens) x (the group's q heads) of one kv
// head, 4 warps of 16 rows. Q is scaled by scale*log2(e) and rounded to bf16 once; per tile of
// 64 keys, K and V are read from the f32 cache, rounded to bf16 into shared memory; S = Q K^T
// and O += P V run on mma (P re-used from the S accumulators as bf16 A fragments), online
// softmax in exp2. grid (ceil(T / (64/group)), nkv), block 128, dynamic smem 3*64*(HD+8) bf16.
#define PFA_LD(HD) ((HD) + 8)
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

template <int HD, typename KV>
__device__ void pf_attn_tc(const float* __restrict__ q, const float* __restrict__ gate, const KV* __restrict__ kc,
                           const KV* __restrict__ vc, int T, int pos0, int nh, int nkv, float scale,
                           float* __restrict__ out) {
    constexpr int LD = PFA_LD(HD), NT = HD / 8, F4 = HD / 4;
    extern __shared__ __align__(16) u16 pfa_tc_sm[];
    u16* Qs = pfa_tc_sm;
    u16* Ks = Qs + 64 * LD;
    u16* Vs = Ks + 64 * LD;
    const int group = nh / nkv, qt = 64 / group;
    const int kvh = blockIdx.y, tok0 = blockIdx.x * qt;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const size_t kv_dim = (size_t)nkv * HD;
    const float qscale = scale * 1.4426950408889634f;
    for (int idx = tid; idx < 64 * F4; idx += 128) {
        const int r = idx / F4, f = idx % F4;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < T) v = reinterpret_cast<const float4*>(q + ((size_t)t * nh + h) * HD)[f];
        uint2 pk;
        pk.x = pack_bf16(v.x * qscale, v.y * qscale);
        pk.y = pack_bf16(v.z * qscale, v.w * qscale);
        *reinterpret_cast<uint2*>(Qs + r * LD + f * 4) = pk;
    }
    // This lane's two rows (g and g+8 of the warp's 16) and their query positions.
    const int g = lane >> 2;
    int pq[2];
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int t = tok0 + (warp * 16 + g + 8 * hv) / group;
        pq[hv] = t < T ? pos0 + t : -1;
    }
    const int warp_last_t = min(T - 1, tok0 + (warp * 16 + 15) / group);
    const int warp_pq = pos0 + warp_last_t;
    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int last_t = min(T - 1, tok0 + qt - 1);
    const int nkeys = pos0 + last_t + 1;
    const u32 q_addr = smem_u32(Qs) + ((warp * 16 + (lane & 15)) * LD + ((lane >> 4) << 3)) * 2;
    const u32 k_addr = smem_u32(Ks) + (((lane & 7) + ((lane >> 4) << 3)) * LD + (((lane >> 3) & 1) << 3)) * 2;
    const u32 v_addr = smem_u32(Vs) + (((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + ((lane >> 4) << 3)) * 2;
    // Tile loads in batches of KB: every load of a batch is issued before the first is used. The
    // rows past the last key are read clamped to it (always valid memory, no branch around the
    // load, which would serialise the batch) and zeroed by a select.
    constexpr int KB = 4, KITER = 64 * F4 / 128;
    static_assert(KITER % KB == 0, "tile load batches");
    for (int kt = 0; kt < nkeys; kt += 64) {
        __syncthreads();
#pragma unroll 2
        for (int i0 = 0; i0 < KITER; i0 += KB) {
            float4 kv[KB], vv[KB];
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                const int idx = tid + (i0 + j) * 128, kr = idx / F4, f = idx % F4;
                const size_t off = (size_t)min(kt + kr, nkeys - 1) * kv_dim + kvh * HD + 4 * f;
                kv[j] = kv_ld4(kc + off, false);
                vv[j] = kv_ld4(vc + off, false);
            }
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                const int idx = tid + (i0 + j) * 128, kr = idx / F4, f = idx % F4;
                const bool ok = kt + kr < nkeys;
                const float4 k4 = ok ? kv[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float4 v4 = ok ? vv[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                *reinterpret_cast<uint2*>(Ks + kr * LD + f * 4) =
                    make_uint2(pack_bf16(k4.x, k4.y), pack_bf16(k4.z, k4.w));
                *reinterpret_cast<uint2*>(Vs + kr * LD + f * 4) =
                    make_uint2(pack_bf16(v4.x, v4.y), pack_bf16(v4.z, v4.w));
            }
        }
        __syncthreads();
        if (kt > warp_pq) continue;  // every row of this warp is before the whole tile
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 4
        for (int ks = 0; ks < HD / 16; ++ks) {
            u32 a[4];
            ldsm_x4(q_addr + ks * 32, a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(k_addr + (np * 16 * LD + ks * 16) * 2, b0, b1, b2, b3);
                mma_bf16(s[2 * np], a, b0, b1);
                mma_bf16(s[2 * np + 1], a, b2, b3);
            }
        }
        // Mask, online softmax (rows g: s[.][0..1], g+8: s[.][2..3]).
        float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt + nt * 8 + 2 * (lane & 3) + (e & 1);
                if (key > pq[e >> 1]) s[nt][e] = NEG_INF;
                mt[e >> 1] = fmaxf(mt[e >> 1], s[nt][e]);
            }
        float base[2], corr[2];
#pragma unroll
        for (int hv = 0; hv < 2; ++hv) {
            mt[hv] = fmaxf(mt[hv], __shfl_xor_sync(0xffffffffu, mt[hv], 1));
            mt[hv] = fmaxf(mt[hv], __shfl_xor_sync(0xffffffffu, mt[hv], 2));
            const float mn = fmaxf(m[hv], mt[hv]);
            base[hv] = mn == NEG_INF ? 0.f : mn;
            corr[hv] = exp2f(m[hv] - base[hv]);
            m[hv] = mn;
            l[hv] *= corr[hv];
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            o[nt][0] *= corr[0];
            o[nt][1] *= corr[0];
            o[nt][2] *= corr[1];
            o[nt][3] *= corr[1];
        }
        u32 pa[4][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const float p0 = exp2f(s[nt][0] - base[0]), p1 = exp2f(s[nt][1] - base[0]);
            const float p2 = exp2f(s[nt][2] - base[1]), p3 = exp2f(s[nt][3] - base[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            pa[nt >> 1][(nt & 1) * 2] = pack_bf16(p0, p1);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int dp = 0; dp < HD / 16; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(v_addr + (kk * 16 * LD + dp * 16) * 2, b0, b1, b2, b3);
                mma_bf16(o[2 * dp], pa[kk], b0, b1);
                mma_bf16(o[2 * dp + 1], pa[kk], b2, b3);
            }
        }
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 1);
        l[hv] += __shfl_xor_sync(0xffffffffu, l[hv], 2);
    }
#pragma unroll
    for (int hv = 0; hv < 2; ++hv) {
        const int r = warp * 16 + g + 8 * hv;
        const int t = tok0 + r / group, h = kvh * group + r % group;
        if (t >= T) continue;
        const float il = 1.f / l[hv];
        const size_t rb = ((size_t)t * nh + h) * HD;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const size_t idx = rb + nt * 8 + 2 * (lane & 3) + cc;
                out[idx] = (o[nt][hv * 2 + cc] * il) * sigmoid_f(gate[idx]);
            }
    }
}

#define PF_ATTN_TC(HD, KV, SUFFIX)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) pf_attn_tc_##HD##SUFFIX(const float* q, const float* gate,  \
                                                                              const KV* kc, const KV* vc, int T,  \
                                                                              int pos0, int nh, int nkv,          \
                                                                              float scale, float* out) {          \
        pf_attn_tc<HD, KV>(q, gate, kc, vc, T, pos0, nh, nkv, scale, out);                                         \
    }
FOR_EACH_ATTN_INSTANCE(PF_ATTN_TC)

// ---------------------------------------------------------------------------------------------
// MoE.
// Routing: one warp per token: softmax top-k (ties -> lower id), renormalised weights, sorted by
// expert id (the CPU accumulates experts in ascending id order); counts[e] += 1 per slot.
// grid (ceil(T/4)), block 128. E <= 512, K <= 16.
#define PF_MAXK 16
extern "C" __global__ void pf_route(const float* __restrict__ logits, int T, int E, int K, int* __restrict__ top_ids,
                                    float* __restrict__ top_w, int* __restrict__ counts) {
    __shared__ int sids[4][PF_MAXK];
    __shared__ float swts[4][PF_MAXK];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    if (t >= T) return;
    int* ids = sids[warp];
    float* wts = swts[warp];
    warp_route_topk(logits + (size_t)t * E, E, K, ids, wts);
    if (lane < K) {
        top_ids[(size_t)t * K + lane] = ids[lane];
        top_w[(size_t)t * K + lane] = wts[lane];
        atomicAdd(&counts[ids[lane]], 1);
    }
}

// Exclusive scan of the per-expert counts (E <= 512; counts staged in shared memory, the scan
// itself is one thread: trivial work); zeroes `fill`. When `tiles` is set it also lists the
// (expert, first token) tiles of 64 tokens for pf_gemm_tc's grouped mode: tiles[0] = count.
// block 256.
extern "C" __global__ void pf_scan(const int* __restrict__ counts, int E, int* __restrict__ offsets,
                                   int* __restrict__ fill, int* __restrict__ tiles) {
    __shared__ int c[512];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        c[e] = counts[e];
        fill[e] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0, nt = 0;
        for (int e = 0; e < E; ++e) {
            offsets[e] = acc;
            acc += c[e];
            if (tiles)
                for (int t0 = 0; t0 < c[e]; t0 += TC_BN) {
                    tiles[1 + 2 * nt] = e;
                    tiles[2 + 2 * nt] = t0;
                    ++nt;
                }
        }
        if (tiles) tiles[0] = nt;
    }
}

// Per-expert slot lists (order inside an expert is arbitrary; every slot's result is computed
// on its own, so the output does not depend on it).
extern "C" __global__ void pf_scatter(const int* __restrict__ top_ids, int TK, const int* __restrict__ offsets,
                                      int* __restrict__ fill, int* __restrict__ list) {
    int slot = blockIdx.x * blockDim.x + threadIdx.x;
    if (slot >= TK) return;
    int e = top_ids[slot];
    int i = atomicAdd(&fill[e], 1);
    list[offsets[e] + i] = slot;
}

// g = silu(g) * u, elementwise.
extern "C" __global__ void pf_swiglu(float* __restrict__ g, const float* __restrict__ u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = silu_f(g[i]) * u[i];
}

// x[t] += sum_k w[t,k] * D[t*K + k] + sigmoid(sgl[t]) * SH[t]. grid (ceil(h/256), T).
extern "C" __global__ void pf_moe_combine(const float* __restrict__ D, const float* __restrict__ top_w, int K,
                                          const float* __restrict__ SH, const float* __restrict__ sgl,
                                          float* __restrict__ x, int h) {
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= h) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += top_w[(size_t)t * K + k] * D[((size_t)t * K + k) * h + c];
    acc += sigmoid_f(sgl[t]) * SH[(size_t)t * h + c];
    x[(size_t)t * h + c] += acc;
}
