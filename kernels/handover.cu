// Decode hand-over microbenchmark (`lily-bench --handover`, src/backend/cuda/handover.rs): what
// one dependent hand-over between decode phases costs when it is a programmatic-dependent kernel
// boundary (today's decode graph) and when it is a readiness counter inside one persistent
// kernel (issue 18's plan), at the bytes a decode phase streams.
//
// The work: a chain of `phases` GEMV phases acts[p + 1] = W_p x_p sqrt(3 / cols) (weights uniform
// in [-1, 1), so the activations keep their size from phase to phase), bf16 weights
// [rows][cols] per phase (phase after phase in W), f32 activations [phases + 1][rows]. Block b of
// a grid of G owns rows [b rows / G, (b + 1) rows / G) of every phase. Column j of its input x_p
// is acts[p][j % rows] (`neighbour` = 0: every row, so a phase waits for the whole grid's previous
// phase), or the rows of block (b + 1) % G (`neighbour` = 1: it waits for one block). Every row is
// summed in one fixed order (lane-strided, then a shuffle tree), so every way of running the chain
// gives the same bits.

#define HO_THREADS 256
#define HO_MAX_COLS 4096

// Rows [r0, r1) of block b.
__device__ __forceinline__ void ho_rows(int b, int G, int rows, int& r0, int& r1) {
    r0 = (int)((long long)b * rows / G);
    r1 = (int)((long long)(b + 1) * rows / G);
}

// Block b's rows of one phase's weights into L2 (before it may read its inputs).
__device__ __forceinline__ void ho_prefetch(const u16* __restrict__ Wp, int rows, int cols, int b, int G) {
    int r0, r1;
    ho_rows(b, G, rows, r0, r1);
    const char* base = reinterpret_cast<const char*>(Wp + (size_t)r0 * cols);
    const size_t bytes = (size_t)(r1 - r0) * cols * 2;
    for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += (size_t)HO_THREADS * 128) prefetch_l2(base + off);
}

// acc + two bf16 weights (low half first) times x[0], x[1].
__device__ __forceinline__ float ho_dot2(u32 w, const float* x, float acc) {
    acc = fmaf(bf16f((u16)(w & 0xffffu)), x[0], acc);
    return fmaf(bf16f((u16)(w >> 16)), x[1], acc);
}

// One phase of block b: stage x (from L2: another block wrote it), then one warp per row.
// Ends with a barrier, so `xs` may be restaged and the rows are written when it returns.
__device__ __forceinline__ void ho_phase(const u16* __restrict__ Wp, int rows, int cols, const float* x,
                                         float* __restrict__ y, int neighbour, int b, int G, float* xs) {
    int s0 = 0, n = rows;
    if (neighbour) {
        int s1;
        ho_rows((b + 1) % G, G, rows, s0, s1);
        n = s1 - s0;
    }
    for (int j = threadIdx.x; j < cols; j += HO_THREADS) xs[j] = __ldcg(x + s0 + j % n);
    __syncthreads();
    int r0, r1;
    ho_rows(b, G, rows, r0, r1);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float scale = sqrtf(3.f / (float)cols);
    for (int r = r0 + warp; r < r1; r += HO_THREADS / 32) {
        const uint4* wr = reinterpret_cast<const uint4*>(Wp + (size_t)r * cols);
        float acc = 0.f;
        for (int j = lane * 8; j < cols; j += 256) {
            const uint4 w = __ldg(wr + j / 8);
            acc = ho_dot2(w.x, xs + j, acc);
            acc = ho_dot2(w.y, xs + j + 2, acc);
            acc = ho_dot2(w.z, xs + j + 4, acc);
            acc = ho_dot2(w.w, xs + j + 6, acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) y[r] = acc * scale;
    }
    __syncthreads();
}

// One phase per launch (a programmatic dependent, as the decode kernels are: its weights
// prefetched before the wait when `prefetch`, the next launch let in right after the wait).
// grid G, block HO_THREADS; cols a multiple of 256, at most HO_MAX_COLS; rows >= 2 G.
extern "C" __global__ void __launch_bounds__(HO_THREADS) ho_gemv(const u16* __restrict__ Wp, int rows, int cols,
                                                               const float* x, float* __restrict__ y,
                                                               int neighbour, int prefetch) {
    __shared__ float xs[HO_MAX_COLS];
    if (prefetch) ho_prefetch(Wp, rows, cols, blockIdx.x, gridDim.x);
    pdl_wait_trigger();
    ho_phase(Wp, rows, cols, x, y, neighbour, blockIdx.x, gridDim.x, xs);
}

__device__ __forceinline__ unsigned ho_ld_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every phase in one launch. flags [phases][G + 1] + 1, zero at launch: word b of phase p is set
// once block b wrote its rows of phase p, word G counts the blocks that did. Before phase p a
// block waits for the words it reads (`wait` = 0: it does not wait, a floor with the same loads
// and stores whose results are not the chain's): thread 0 spins on relaxed loads (an acquire
// load invalidates the SM's L1 each time), then one acquire fence. Deadlock-free only when all G
// blocks are resident at once: the host sizes G by the occupancy query; a wait that outlasts
// 2 s sets the last word and gives up, so a broken protocol fails the run instead of hanging it.
// The prefetch of phase p's rows goes out before the wait, so the weights stream while the
// previous phase finishes.
extern "C" __global__ void __launch_bounds__(HO_THREADS) ho_persist(const u16* __restrict__ W, int phases, int rows,
                                                                  int cols, float* acts, unsigned* flags,
                                                                  int neighbour, int prefetch, int wait) {
    __shared__ float xs[HO_MAX_COLS];
    const int b = blockIdx.x, G = gridDim.x;
    for (int p = 0; p < phases; ++p) {
        const u16* Wp = W + (size_t)p * rows * cols;
        if (prefetch) ho_prefetch(Wp, rows, cols, b, G);
        if (wait && p > 0 && threadIdx.x == 0) {
            const unsigned* prev = flags + (size_t)(p - 1) * (G + 1);
            const unsigned* word = neighbour ? prev + (b + 1) % G : prev + G;
            const unsigned target = neighbour ? 1u : (unsigned)G;
            // 2^22 loads of an L2 line take seconds: long past any real wait. (ptxas keeps one
            // word of this path in local memory, thread 0's only, off the GEMV's loop.)
            for (unsigned n = 0; ho_ld_relaxed(word) < target; ++n) {
                if (n == (1u << 22)) {
                    atomicExch(flags + (size_t)phases * (G + 1), 1u);
                    break;
                }
            }
            fence_acq_rel_gpu();
        }
        __syncthreads();
        ho_phase(Wp, rows, cols, acts + (size_t)p * rows, acts + (size_t)(p + 1) * rows, neighbour, b, G, xs);
        if (threadIdx.x == 0) {
            unsigned* mine = flags + (size_t)p * (G + 1);
            __threadfence();  // the block's rows (ordered before by ho_phase's barrier) before its word
            if (neighbour) {
                atomicExch(mine + b, 1u);
            } else {
                atomicAdd(mine + G, 1u);
            }
        }
    }
}
