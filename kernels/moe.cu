// Sparse mixture of experts: routing (softmax top-k), the experts' SwiGLU MLPs and the shared
// expert, combined into the residual stream. Same math as src/backend/cpu/moe.rs.
//   decode (T = 1):     moe_gate_up, moe_down, moe_gate_up_tc, moe_down_tc
//   prefill (T tokens): pf_route, pf_scan, pf_scatter, pf_moe_combine; the expert products:
//                       stage_wg + pf_moe_wg_glu / pf_moe_wg_down (wgmma) for long chunks,
//                       moe_tcb for short ones, pf_gemm / pf_gemm_tc in grouped mode (qmatmul.cu)
//                       in the f32 mode
//   batched decode:     moe_route_batch, moe_tcb, pf_moe_combine
// The tensor-core expert kernels come in two instances: over row-order codes and, named *_f,
// over codes in fragment order (common.cuh tc_load), the routed experts' order when the decode
// runs these kernels (moe.rs fragment_order_experts).

// ================================ decode (T = 1) ================================
// Two launches after the router GEMV (gemv_q, qmatmul.cu):
//   moe_gate_up: every block recomputes softmax + top-k of the router logits in its prologue
//     (E <= 512 values from L2, one warp), so no separate routing launch or host sync is needed;
//     grid.y = slot (K routed experts + the shared expert), each warp computes one gate row and
//     one up row of that slot's expert and writes silu(gate) * up.
//   moe_down: each warp owns one output row; it sums the K experts' down rows weighted by the
//     renormalised routing weights (ascending expert id, as the CPU accumulates), adds
//     sigmoid(shared_gate) * shared_down row and adds the result into the residual stream.
// Both stage their input with the one-pass stage_x_fast where its conditions hold (moe_down only
// where every slot base is a multiple of 256 floats, see there), with stage_x otherwise.

#define MOE_MAXK 16
#define MOE_STAGE_MAXK 12

// Routing of one token by one whole warp: top-k of the E router logits (ties -> lower id), the
// renormalised softmax weights exp(l - max) / sum_topk exp(l - max), then sorted by expert id
// (the CPU accumulates experts in ascending id order). ids/wts (K entries, shared memory) are
// valid for every lane of the warp on return. E <= 512, K <= 16. Used by decode (route_topk) and
// prefill (pf_route), so both pick the same experts with the same weights.
// NT tokens at once (token u's logits at logits + u * stride, its picks at ids / wts + u * K; only
// the first nt are read and written): the same operations per token as one at a time, with the
// tokens' dependent reductions interleaved. PER: logits per lane (E <= 32 * PER); the slots past
// E hold no candidate, so every PER >= E / 32 picks the same.
template <int NT, int PER>
__device__ void warp_route_topk_per(const float* __restrict__ logits, int stride, int nt, int E, int K, int* ids,
                                    float* wts) {
    static_assert(PER == 8 || PER == 16, "the scan's tree pairs slots in powers of two");
    const int lane = threadIdx.x & 31;
    // Each logit as an unsigned key in the same order (-0 made +0 first, so the two tie as
    // floats do), taken candidates set to 0: a round of the top-k is then two warp reductions
    // (the largest key, then the lowest id holding it: ties -> lower id) instead of a butterfly
    // of ten dependent shuffles.
    u32 v[NT][PER];
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int t = 0; t < PER; ++t) {
            const bool in = u < nt && lane + 32 * t < E;
            const u32 b = __float_as_uint(in ? logits[(size_t)u * stride + lane + 32 * t] + 0.f : NEG_INF);
            v[u][t] = (b & 0x80000000u) ? ~b : b | 0x80000000u;
        }
    float top[NT], my_e[NT];
    int my_id[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) top[u] = 0.f, my_e[u] = 0.f, my_id[u] = 0x7fffffff;
    for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int u = 0; u < NT; ++u) {
            // The lane's largest key and its lowest slot: a tree over neighbouring runs of slots
            // (the left run's on a tie, so the lowest slot among equal keys, as a scan in slot
            // order finds it) in log2(PER) dependent steps instead of PER.
            u32 bk[PER], bt[PER];
#pragma unroll
            for (int t = 0; t < PER; ++t) bk[t] = v[u][t], bt[t] = t;
#pragma unroll
            for (int w = 1; w < PER; w *= 2)
#pragma unroll
                for (int t = 0; t < PER; t += 2 * w) {
                    const bool right = bk[t + w] > bk[t];
                    bk[t] = right ? bk[t + w] : bk[t];
                    bt[t] = right ? bt[t + w] : bt[t];
                }
            const u32 best = bk[0], bi0 = best ? lane + 32 * bt[0] : 0xffffffffu;
            const u32 m = __reduce_max_sync(0xffffffffu, best);
            const u32 bi = __reduce_min_sync(0xffffffffu, best == m ? bi0 : 0xffffffffu);
            const float bestf = __uint_as_float((m & 0x80000000u) ? m & 0x7fffffffu : ~m);
            if (k == 0) top[u] = bestf;
#pragma unroll
            for (int t = 0; t < PER; ++t)
                if (lane + 32 * t == (int)bi) v[u][t] = 0u;
            if (lane == k) { my_id[u] = (int)bi; my_e[u] = expf(bestf - top[u]); }
        }
    }
    // Lane k < K holds the k-th pick. The normaliser is summed in pick order (as the CPU does),
    // and each pick's place in id order is its rank among the picks (ids are distinct): a few
    // shuffles instead of lane 0's serial sum and insertion sort through shared memory.
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        float sum = 0.f;
        int rank = 0;
        for (int k = 0; k < K; ++k) {
            sum += __shfl_sync(0xffffffffu, my_e[u], k);
            rank += __shfl_sync(0xffffffffu, my_id[u], k) < my_id[u];
        }
        if (u < nt && lane < K) { ids[u * K + rank] = my_id[u]; wts[u * K + rank] = my_e[u] / sum; }
    }
    __syncwarp();
}
template <int NT>
__device__ void warp_route_topk_n(const float* __restrict__ logits, int stride, int nt, int E, int K, int* ids,
                                  float* wts) {
    if (E <= 256) warp_route_topk_per<NT, 8>(logits, stride, nt, E, K, ids, wts);
    else warp_route_topk_per<NT, 16>(logits, stride, nt, E, K, ids, wts);
}
__device__ void warp_route_topk(const float* __restrict__ logits, int E, int K, int* ids, float* wts) {
    warp_route_topk_n<1>(logits, 0, 1, E, K, ids, wts);
}

// Warp 0 computes the routing of the block (warp_route_topk) into shared ids/wts.
// No trailing barrier: the caller synchronises before other warps read ids/wts.
__device__ void route_topk(const float* __restrict__ logits, int E, int K, int* ids, float* wts) {
    if ((threadIdx.x >> 5) == 0) warp_route_topk(logits, E, K, ids, wts);
}

// Rows [row0, row0 + n) of a 4-bit matrix with `cols` columns (codes, scales, biases) into L2,
// spread over the warp's lanes: the share of the chosen experts' down rows that each
// gate|up block pulls in for moe_down.
__device__ __forceinline__ void prefetch_q4_rows(const u32* w, const u16* s, const u16* b, size_t row0, int n,
                                                 int cols, int group, int lane) {
    const size_t wpr = (size_t)cols / 8, gpr = (size_t)cols / group;
    prefetch_l2_warp(w + row0 * wpr, n * wpr * 4, lane);
    prefetch_l2_warp(s + row0 * gpr, n * gpr * 2, lane);
    prefetch_l2_warp(b + row0 * gpr, n * gpr * 2, lane);
}

// Dynamic shared memory: cols + cols/group + 33 floats. act: [K*inter + sinter].
extern "C" __global__ void moe_gate_up(const float* __restrict__ logits, int E, int K,
                                       const u32* gw, const u16* gs, const u16* gb,
                                       const u32* uw, const u16* us, const u16* ub, int inter,
                                       const u32* sgw, const u16* sgs, const u16* sgb,
                                       const u32* suw, const u16* sus, const u16* sub, int sinter,
                                       const float* __restrict__ x, int cols, int group,
                                       float* __restrict__ act, int* __restrict__ top_ids, float* __restrict__ top_w,
                                       const u32* dw, const u16* ds, const u16* db, const u32* sdw, const u16* sds,
                                       const u16* sdb, int hidden) {
    extern __shared__ float smem[];
    __shared__ int ids[MOE_MAXK];
    __shared__ float wts[MOE_MAXK];
    float* xs = smem;
    float* gsum = xs + cols;
    float* red = gsum + cols / group;
    const int slot = blockIdx.y;
    const int rows = slot < K ? inter : sinter;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Each block owns 2 * warps consecutive rows; warp w computes rows base + w and
    // base + warps + w (four weight rows' loads in flight per warp, half the blocks' prologues).
    const int base = blockIdx.x * 2 * warps;
    const int r = base + warp;
    const int gpr = cols / group;
    const size_t wpr = (size_t)cols / 8;
    // Weights into L2 before the prologue: the shared expert's rows at once; the routed rows as
    // soon as warp 0 knows the expert (it prefetches the whole block's rows while the other
    // warps stage x). The top-k result is published by stage_x's barriers.
    // Each block also pulls a 1/gridDim.x share of its expert's down rows (moe_down's weights)
    // into L2 once the expert is known, so moe_down reads them from L2.
    const int drows = (hidden + gridDim.x - 1) / gridDim.x;
    const int d0 = blockIdx.x * drows, dn = max(0, min(hidden, d0 + drows) - d0);
    if (slot >= K) {
        // The shared expert does not depend on the router: prefetched before the PDL wait.
        for (int rr = r; rr < min(rows, base + 2 * warps); rr += warps) {
            prefetch_l2_warp(sgw + (size_t)rr * wpr, wpr * 4, lane);
            prefetch_l2_warp(suw + (size_t)rr * wpr, wpr * 4, lane);
        }
        if (warp == warps - 1 && dn > 0) prefetch_q4_rows(sdw, sds, sdb, d0, dn, sinter, group, lane);
    }
    pdl_wait_trigger();
    if (slot < K && warp == 0) {
        route_topk(logits, E, K, ids, wts);
        __syncwarp();
        const size_t row0 = (size_t)ids[slot] * inter + (size_t)base;
        const int nrows = min(2 * warps, rows - base);
        if (nrows > 0) {
            prefetch_l2_warp(gw + row0 * wpr, nrows * wpr * 4, lane);
            prefetch_l2_warp(uw + row0 * wpr, nrows * wpr * 4, lane);
        }
        if (dn > 0) prefetch_q4_rows(dw, ds, db, (size_t)ids[slot] * hidden + d0, dn, inter, group, lane);
        if (blockIdx.x == 0 && slot == 0 && lane < K) { top_ids[lane] = ids[lane]; top_w[lane] = wts[lane]; }
    }
    const bool fast = (cols & 63) == 0 && cols <= 2 * MOE_STAGE_MAXK * (int)blockDim.x && (group == 32 || group == 64);
    if (fast) stage_x_fast<MOE_STAGE_MAXK>(x, cols, nullptr, 0.f, group, xs, gsum, red);
    else stage_x(x, cols, nullptr, 0.f, group, xs, gsum, red);
    if (r >= rows) return;
    const int r2 = r + warps;
    const bool two = r2 < rows;
    const u32 *GW = gw, *UW = uw;
    const u16 *GS = gs, *GB = gb, *US = us, *UB = ub;
    size_t row = r, row2 = r2;
    if (slot < K) {
        row = (size_t)ids[slot] * inter + r;
        row2 = (size_t)ids[slot] * inter + r2;
    } else {
        GW = sgw; GS = sgs; GB = sgb; UW = suw; US = sus; UB = sub;
    }
    // Gate and up rows as separate qrow_part calls: the paired qrow_part2 (one read of the staged
    // input for both) needs 96 registers, and moe_gate_up then fits 2 blocks per SM instead of 3.
    float g = qrow_part(GW + row * wpr, GS + row * gpr, GB + row * gpr, xs, gsum, cols, 4, group);
    float u = qrow_part(UW + row * wpr, US + row * gpr, UB + row * gpr, xs, gsum, cols, 4, group);
    float g2 = 0.f, u2 = 0.f;
    if (two) {
        g2 = qrow_part(GW + row2 * wpr, GS + row2 * gpr, GB + row2 * gpr, xs, gsum, cols, 4, group);
        u2 = qrow_part(UW + row2 * wpr, US + row2 * gpr, UB + row2 * gpr, xs, gsum, cols, 4, group);
    }
    g = warp_sum(g);  // all rows' loads were issued before any reduction
    u = warp_sum(u);
    g2 = warp_sum(g2);
    u2 = warp_sum(u2);
    if (lane == 0) {
        act[(size_t)slot * inter + r] = silu_f(g) * u;
        if (two) act[(size_t)slot * inter + r2] = silu_f(g2) * u2;
    }
}

// Dynamic shared memory: (K*inter + sinter) * (1 + 1/group) + 33 floats.
extern "C" __global__ void moe_down(const float* __restrict__ act, const int* __restrict__ top_ids,
                                    const float* __restrict__ top_w, int K, int inter, int sinter,
                                    const u32* dw, const u16* ds, const u16* db,
                                    const u32* sdw, const u16* sds, const u16* sdb,
                                    const float* __restrict__ shared_gate_logit, int hidden, int group,
                                    float* __restrict__ x) {
    extern __shared__ float smem[];
    const int n_act = K * inter + sinter;
    float* xs = smem;
    float* gsum = xs + n_act;
    {
        // This warp's shared row (before the PDL wait: no dependency) and K expert rows (after it:
        // top_ids comes from moe_gate_up, which already pulled them into L2) before staging.
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int r = blockIdx.x * (blockDim.x >> 5) + warp;
        const size_t wpr = (size_t)inter / 8, swpr = (size_t)sinter / 8;
        if (r < hidden && lane == K) {
            const u32* p = sdw + (size_t)r * swpr;
            for (size_t off = 0; off < swpr * 4; off += 128) prefetch_l2(reinterpret_cast<const char*>(p) + off);
        }
        pdl_wait_trigger();
        if (r < hidden && lane < K) {
            const u32* p = dw + ((size_t)top_ids[lane] * hidden + r) * wpr;
            for (size_t off = 0; off < wpr * 4; off += 128) prefetch_l2(reinterpret_cast<const char*>(p) + off);
        }
    }
    // Each slot's vector is read swizzled on its own (qrow_part gets the slot's base), while
    // stage_x_fast swizzles the whole vector at once. The swizzle of float4 f rotates by f >> 3,
    // so the two agree only when every slot base is a multiple of 64 float4s (256 floats): true
    // for the 35B (inter 512), not for the tiny model (inter 64), where the fast path would read
    // permuted activations.
    const bool fast = (n_act & 63) == 0 && (inter & 255) == 0 &&
                      n_act <= 2 * MOE_STAGE_MAXK * (int)blockDim.x && (group == 32 || group == 64);
    if (fast) {
        __shared__ float red[33];
        stage_x_fast<MOE_STAGE_MAXK>(act, n_act, nullptr, 0.f, group, xs, gsum, red);
    } else {
        for (int c = threadIdx.x; c < n_act; c += blockDim.x) {
            int base = c < K * inter ? (c / inter) * inter : K * inter;
            xs[base + swz_elem(c - base)] = act[c];
        }
        __syncthreads();
        group_sums(xs, n_act, group, gsum);
    }
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * warps + warp;
    if (r >= hidden) return;
    const size_t wpr = (size_t)inter / 8, gpr = inter / group;
    const size_t swpr = (size_t)sinter / 8, sgpr = sinter / group;
    float acc = 0.f, sd = 0.f;
    // Per-lane weighted partials of all K experts and the shared expert, reduced once at the
    // end, so the K + 1 rows' loads overlap instead of forming K + 1 dependent reductions.
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
        size_t row = (size_t)top_ids[k] * hidden + r;
        acc += top_w[k] * qrow_part(dw + row * wpr, ds + row * gpr, db + row * gpr, xs + k * inter,
                                    gsum + k * gpr, inter, 4, group);
    }
    sd = qrow_part(sdw + r * swpr, sds + r * sgpr, sdb + r * sgpr, xs + K * inter, gsum + K * gpr, sinter, 4,
                   group);
    acc = warp_sum(acc);
    sd = warp_sum(sd);
    if (lane == 0) x[r] = x[r] + (acc + sigmoid_f(shared_gate_logit[0]) * sd);
}

// ---- tensor-core variants (4-bit experts, group 64; tc_load/tc_mma in common.cuh) ----
// moe_gate_up_tc: grid (ceil(max(inter, sinter) / 16), K + 1), 2 * slices warps: warps
// [0, slices) take the slot's gate rows r0..r0+15, warps [slices, 2 slices) the same up rows,
// each over `kc` chunks of 512 columns (slices * kc = chunks of the hidden size); the slices are
// summed through shared memory and 16 threads write silu(gate) * up. Routing as in
// moe_gate_up: warp 0 of a routed slot computes top-k while the other warps stage x. It takes
// moe_gate_up's arguments (moe.rs gate_up_args) but not its L2 prefetch of the down rows:
// moe_down_tc routes the token itself and loads its rows before its wait.
// Dynamic shared memory: hidden/64 * (TCX_WORDS + 1) + 33 + warps * 16 words.
// MOE_TC_MINB: resident blocks per SM moe_gate_up_tc's registers must allow (3: 80 registers,
// one wave of the 35B's 288 blocks).
#define MOE_TC_MINB 3
#define MOE_GATE_UP_TC_ARGS                                                                                  \
    const float *__restrict__ logits, int E, int K, const u32 *gw, const u16 *gs, const u16 *gb, const u32 *uw,   \
        const u16 *us, const u16 *ub, int inter, const u32 *sgw, const u16 *sgs, const u16 *sgb, const u32 *suw,  \
        const u16 *sus, const u16 *sub, int sinter, const float *__restrict__ x, int cols, int slices, int kc,    \
        float *__restrict__ act, int *__restrict__ top_ids, float *__restrict__ top_w, const u32 *dw,            \
        const u16 *ds, const u16 *db, const u32 *sdw, const u16 *sds, const u16 *sdb, int hidden
#define MOE_GATE_UP_TC_NAMES                                                                                   \
    logits, E, K, gw, gs, gb, uw, us, ub, inter, sgw, sgs, sgb, suw, sus, sub, sinter, x, cols, slices, kc, act, \
        top_ids, top_w, dw, ds, db, sdw, sds, sdb, hidden
template <bool FRAG>
__device__ __forceinline__ void moe_gate_up_tc_body(MOE_GATE_UP_TC_ARGS) {
    extern __shared__ float smem[];
    __shared__ int ids[MOE_MAXK];
    __shared__ float wts[MOE_MAXK];
    const int gpr = cols >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + gpr * TCX_WORDS;
    float* red = gsum + gpr;
    float* part = red + 33;
    const int slot = blockIdx.y, routed = slot < K;
    const int rows = routed ? inter : sinter;
    const int r0 = blockIdx.x * 16;
    if (r0 >= rows) return;  // block-uniform
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int up = warp >= slices, my_slice = warp - (up ? slices : 0);
    const size_t wpr = (size_t)cols / 8;
    if (!routed && warp == 0) {
        // The shared expert does not depend on the router: its rows go to L2 before the wait.
        const int nrows = min(16, rows - r0);
        prefetch_l2_warp(sgw + (size_t)r0 * wpr, nrows * wpr * 4, lane);
        prefetch_l2_warp(suw + (size_t)r0 * wpr, nrows * wpr * 4, lane);
    }
    pdl_wait_trigger();
    if (routed && warp == 0) {
        route_topk(logits, E, K, ids, wts);
        __syncwarp();
        // The block's 16 gate and up rows into L2 at once (moe_down_tc loads its own rows before
        // its wait).
        const size_t row0 = (size_t)ids[slot] * inter + r0;
        const int nrows = min(16, rows - r0);
        prefetch_l2_warp(gw + row0 * wpr, nrows * wpr * 4, lane);
        prefetch_l2_warp(uw + row0 * wpr, nrows * wpr * 4, lane);
        if (blockIdx.x == 0 && slot == 0 && lane < K) { top_ids[lane] = ids[lane]; top_w[lane] = wts[lane]; }
    }
    stage_x_tc(x, cols, nullptr, 0.f, xf, gsum, red, routed ? 1 : 0);  // its barrier publishes ids
    const u32* W = up ? suw : sgw;
    const u16 *S = up ? sus : sgs, *B = up ? sub : sgb;
    if (routed) {
        const size_t e = (size_t)ids[slot] * inter;
        W = (up ? uw : gw) + e * wpr;
        S = (up ? us : gs) + e * gpr;
        B = (up ? ub : gb) + e * gpr;
    }
    const int g = lane >> 2;
    float acc0 = 0.f, acc1 = 0.f;
    TcItem it;
    int G0 = my_slice * kc * TC_NG;
    tc_load<FRAG>(it, W, S, B, rows, r0, cols, G0, min(gpr, G0 + TC_NG));
    tc_mma(it, xf, gsum, G0, min(gpr, G0 + TC_NG), 1.f, acc0, acc1);
    for (int k = 1; k < kc; ++k) {  // hidden sizes past 512 * slices (not the 35B's)
        G0 += TC_NG;
        tc_load<FRAG>(it, W, S, B, rows, r0, cols, G0, min(gpr, G0 + TC_NG));
        tc_mma(it, xf, gsum, G0, min(gpr, G0 + TC_NG), 1.f, acc0, acc1);
    }
    tc_reduce(acc0, acc1);
    if ((lane & 3) == 0) {
        part[warp * 16 + g] = acc0;
        part[warp * 16 + g + 8] = acc1;
    }
    __syncthreads();
    if ((int)threadIdx.x < 16 && r0 + (int)threadIdx.x < rows) {
        float gv = 0.f, uv = 0.f;
        for (int sl = 0; sl < slices; ++sl) {
            gv += part[sl * 16 + threadIdx.x];
            uv += part[(slices + sl) * 16 + threadIdx.x];
        }
        act[(size_t)slot * inter + r0 + threadIdx.x] = silu_f(gv) * uv;
    }
}
extern "C" __global__ void __launch_bounds__(256, MOE_TC_MINB) moe_gate_up_tc(MOE_GATE_UP_TC_ARGS) {
    moe_gate_up_tc_body<false>(MOE_GATE_UP_TC_NAMES);
}
// moe_gate_up_tc over experts in fragment order (tc_load).
extern "C" __global__ void __launch_bounds__(256, MOE_TC_MINB) moe_gate_up_tc_f(MOE_GATE_UP_TC_ARGS) {
    moe_gate_up_tc_body<true>(MOE_GATE_UP_TC_NAMES);
}

// moe_down_tc: grid ceil(hidden / 16), (K + 1) * split warps: warp w takes slot w / split (K
// routed experts in ascending id, then the shared expert) and the (w % split)-th share of its
// inter/64 groups (split 1 or 2; at most TC_NG groups per warp) for output rows r0..r0+15, with
// the routing weight (or the shared expert's sigmoid gate) folded into the scales; the warps are
// summed through shared memory into the residual stream. act = [K * inter + sinter] with
// inter == sinter (the host checks). Every warp's loads are issued before the programmatic-
// dependent wait: the block routes the token itself from the router's logits (route_topk, the
// picks and weights moe_gate_up_tc makes and stores in top_ids / top_w), which the router wrote
// two launches back: the gate|up launch that lets this one start has waited for the router, so
// they are complete in L2 (read with L2-only loads). Only act comes from the gate|up launch.
// Dynamic shared memory: n_act/64 * (TCX_WORDS + 1) + 33 + warps * 16 words.
#define MOE_DOWN_TC_ARGS                                                                                          \
    const float *__restrict__ logits, int E, const float *__restrict__ act, int K, int inter, int split, const u32 *dw, \
        const u16 *ds, const u16 *db, const u32 *sdw, const u16 *sds, const u16 *sdb,                               \
        const float *__restrict__ shared_gate_logit, int hidden, float *__restrict__ x
#define MOE_DOWN_TC_NAMES logits, E, act, K, inter, split, dw, ds, db, sdw, sds, sdb, shared_gate_logit, hidden, x
template <bool FRAG>
__device__ __forceinline__ void moe_down_tc_body(MOE_DOWN_TC_ARGS) {
    extern __shared__ float smem[];
    const int n_act = (K + 1) * inter, gpe = inter >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + (n_act >> 6) * TCX_WORDS;
    float* red = gsum + (n_act >> 6);
    float* part = red + 33;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slot = warp / split, share = warp % split;
    const int per = (gpe + split - 1) / split;
    const int G0 = share * per, G1 = min(gpe, G0 + per);
    const int r0 = blockIdx.x * 16;
    __shared__ int ids[MOE_MAXK];
    __shared__ float wts[MOE_MAXK];
    // The logits through L2 (ld.global.cg) into shared memory: this launch's wait orders only the
    // gate|up launch's writes, so an L1 line of an earlier layer's logits must not be read. The
    // item's registers are not live across the top-k (so its registers and the item's do not add
    // up): the shared expert's rows load after it too.
    __shared__ float lg[512];  // E <= 512 (warp_route_topk_per)
    for (int e = threadIdx.x; e < E; e += blockDim.x) lg[e] = __ldcg(logits + e);
    __syncthreads();
    route_topk(lg, E, K, ids, wts);
    __syncthreads();
    TcItem it;
    if (slot < K) {
        const size_t e = (size_t)ids[slot] * hidden;
        tc_load<FRAG>(it, dw + e * (inter / 8), ds + e * gpe, db + e * gpe, hidden, r0, inter, G0, G1);
    } else {
        tc_load<FRAG>(it, sdw, sds, sdb, hidden, r0, inter, G0, G1);
    }
    pdl_wait_trigger();
    const float wscale = slot < K ? wts[slot] : sigmoid_f(shared_gate_logit[0]);
    stage_x_tc(act, n_act, nullptr, 0.f, xf, gsum, red);
    float acc0 = 0.f, acc1 = 0.f;
    tc_mma(it, xf + slot * gpe * TCX_WORDS, gsum + slot * gpe, G0, G1, wscale, acc0, acc1);
    tc_reduce(acc0, acc1);
    const int g = lane >> 2;
    if ((lane & 3) == 0) {
        part[warp * 16 + g] = acc0;
        part[warp * 16 + g + 8] = acc1;
    }
    __syncthreads();
    if ((int)threadIdx.x < 16 && r0 + (int)threadIdx.x < hidden) {
        float v = 0.f;
        for (int w = 0; w < warps; ++w) v += part[w * 16 + threadIdx.x];
        x[r0 + threadIdx.x] += v;
    }
}
extern "C" __global__ void moe_down_tc(MOE_DOWN_TC_ARGS) { moe_down_tc_body<false>(MOE_DOWN_TC_NAMES); }
// moe_down_tc over experts in fragment order (tc_load).
extern "C" __global__ void moe_down_tc_f(MOE_DOWN_TC_ARGS) { moe_down_tc_body<true>(MOE_DOWN_TC_NAMES); }

// ============================ batched decode (B tokens) ============================
// acc = silu(acc) * up (the GLU of a 16-row item's gate and up accumulators).
template <int NTG>
__device__ __forceinline__ void tcb_swiglu(float (&acc)[NTG][4], const float (&up)[NTG][4]) {
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[tg][q] = silu_f(acc[tg][q]) * up[tg][q];
}
// A 16-row item's accumulators (tcb_mma's layout) into y[slots[tok]][row] for its rows below
// r_end and the pass's nt tokens.
template <int NTG>
__device__ __forceinline__ void tcb_store(const float (&acc)[NTG][4], float* __restrict__ y, int rows, int r_end, int r0,
                                          const int* slots, int nt) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    auto store = [&](int row, int tok, float v) {
        if (row < r_end && tok < nt) y[(size_t)slots[tok] * rows + row] = v;
    };
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) {
        store(r0 + g, tg * 8 + 2 * t, acc[tg][0]);
        store(r0 + g, tg * 8 + 2 * t + 1, acc[tg][1]);
        store(r0 + g + 8, tg * 8 + 2 * t, acc[tg][2]);
        store(r0 + g + 8, tg * 8 + 2 * t + 1, acc[tg][3]);
    }
}

// A 16-row item's outputs (tcb_store's layout, rows r0 .. r0 + 15 of a 64-column-aligned block)
// staged as the next product's input instead of stored: the bf16 fragment words of the slots'
// rows (stage_tcb's layout, common.cuh tcb_word; the item's rows are the staged row's columns
// 16tq .. 16tq + 15 of group G) and, in `red`, the warp's part of each slot's group sum. Word
// (h, s) pairs columns 8h + s and 8h + s + 4, i.e. rows g and g + 4 (h = 0) or g + 8 and g + 12
// (h = 1) of lanes g = s and g + 4, so lanes g < 4 take their partner's rows from lane + 16. The
// sums follow stage_tcb's (stage_piece) butterfly over the word index q = 8i + 2t + reg: here
// the h and s / 2 levels; tcr_stage_sums adds the quarters tq and the reg halves. red: per warp
// and token, the (reg 0, reg 1) partial sums.
template <int NTG>
__device__ __forceinline__ void tcb_stage_words(const float (&acc)[NTG][4], u32* __restrict__ sfrag, float* red, int r0,
                                                int gpr, const int* slots, int nt) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int G = r0 >> 6, tq = (r0 >> 4) & 3;
    auto half = [](u32 w) { return __uint_as_float(w << 16) + __uint_as_float(w & 0xffff0000u); };
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const float p0 = __shfl_down_sync(0xffffffffu, acc[tg][q], 16);
            const float p1 = __shfl_down_sync(0xffffffffu, acc[tg][2 + q], 16);
            const u32 w0 = pack_bf16(acc[tg][q], p0), w1 = pack_bf16(acc[tg][2 + q], p1);
            float c = half(w0) + half(w1);             // q bit 4 (h)
            c += __shfl_xor_sync(0xffffffffu, c, 8);   // q bit 3 (s / 2): lanes g and g ^ 2
            const int tok = tg * 8 + 2 * t + q;
            if (g < 4 && tok < nt) {
                const int sl = slots[tok];
                sfrag[tcb_word(sl, gpr, G, g >> 1, tq, g & 1)] = w0;
                sfrag[tcb_word(sl, gpr, G, 2 + (g >> 1), tq, g & 1)] = w1;
                if (g < 2) red[(warp * TCB_TOK + tok) * 2 + g] = c;
            }
        }
}

// The expert products of a batched decode step: for every (expert, 64-slot tile) of the routing
// lists (moe_route_batch) and every slot of it, y[slot][r] = W_e[r] . x[slot / xdiv] (x staged by
// stage_tcb: fragments and group sums, gathered per slot), or with a second matrix (GLU: gate W
// and up W2) y[slot][r] = silu(W_e[r] . x) * (W2_e[r] . x) (4-bit, group 64, bf16 activations on
// the tensor cores; tcb_mma in common.cuh). Expert `shared_e` is the shared expert: its matrices
// are sw / sw2, and its slots (shared_base + t) read token t's row. Each active expert's rows are read
// once per 16 of its slots, by the warps of the blocks that split its rows. grid (ceil(rows /
// rpb), tiles), block 256 (8 warps, 16-row tiles round robin, whole rows per warp).
// Dynamic shared memory: (2 * gpr * TCB_WORDS + TCB_TOK * gpr) words.
template <int NTG, bool FRAG = false>
__device__ __forceinline__ void moe_tcb_rows(const u32* __restrict__ w, const u16* __restrict__ s,
                                             const u16* __restrict__ b, const u32* __restrict__ w2,
                                             const u16* __restrict__ s2, const u16* __restrict__ b2,
                                             float* __restrict__ y, int rows, int cols, int r_begin, int r_end,
                                             const int* slots, int nt, const u32* xf, const float* gsum) {
    const int warp = threadIdx.x >> 5;
    const int gpr = cols >> 6, kc = (gpr + TC_NG - 1) / TC_NG;
    for (int r0 = r_begin + warp * 16; r0 < r_end; r0 += 16 * (blockDim.x >> 5)) {
        float acc[NTG][4];
        tcb_tile<NTG, FRAG>(w, s, b, r_end, r0, cols, 0, kc, xf, gsum, acc);
        if (w2) {
            float up[NTG][4];
            tcb_tile<NTG, FRAG>(w2, s2, b2, r_end, r0, cols, 0, kc, xf, gsum, up);
            tcb_swiglu<NTG>(acc, up);
        }
        tcb_store<NTG>(acc, y, rows, r_end, r0, slots, nt);
    }
}

// A tile's slots (threads 0..nt - 1 of the block, one each) into slot[] and the staged row each
// reads into xrow[]: slot / xdiv, or token t's for the shared expert's slots shared_base + t
// (moe_tcp, moe_tcr; a macro so the kernels keep their exact instruction schedule).
#define TILE_SLOTS                                                                \
    if ((int)threadIdx.x < nt) {                                                  \
        const int sl = lst[threadIdx.x];                                          \
        slot[threadIdx.x] = sl;                                                   \
        xrow[threadIdx.x] = sl >= shared_base ? sl - shared_base : sl / xdiv;     \
    }

// In moe_tcb's and moe_tcr's blocks: expert e's matrices in place of the stacks w.. / w2.. (no
// second matrix without w2), or the shared expert's own (sw.., the same shape as one routed
// expert's) when e is shared_e. A macro over the kernels' parameters (gpr in scope) rather than a
// function: the kernels keep their exact instruction schedule.
#define EXPERT_MATS                                                          \
    const size_t wpr = (size_t)cols >> 3, erows = (size_t)e * rows;         \
    if (e == shared_e) {                                                     \
        w = sw, s = ss, b = sb, w2 = w2 ? sw2 : nullptr, s2 = ss2, b2 = sb2; \
    } else {                                                                 \
        w += erows * wpr;                                                    \
        s += erows * gpr;                                                    \
        b += erows * gpr;                                                    \
        if (w2) {                                                            \
            w2 += erows * wpr;                                               \
            s2 += erows * gpr;                                               \
            b2 += erows * gpr;                                               \
        }                                                                    \
    }

#define MOE_TCB_ARGS                                                                                              \
    const u32 *__restrict__ w, const u16 *__restrict__ s, const u16 *__restrict__ b, const u32 *__restrict__ w2,   \
        const u16 *__restrict__ s2, const u16 *__restrict__ b2, const u32 *__restrict__ sw,                        \
        const u16 *__restrict__ ss, const u16 *__restrict__ sb, const u32 *__restrict__ sw2,                       \
        const u16 *__restrict__ ss2, const u16 *__restrict__ sb2, int shared_e, int shared_base,                  \
        float *__restrict__ y, int rows, int cols, int rpb, const u32 *__restrict__ frag,                          \
        const float *__restrict__ gs_in, int xdiv, const int *__restrict__ counts, const int *__restrict__ offsets, \
        const int *__restrict__ list, const int *__restrict__ tiles
#define MOE_TCB_NAMES \
    w, s, b, w2, s2, b2, sw, ss, sb, sw2, ss2, sb2, shared_e, shared_base, y, rows, cols, rpb, frag, gs_in, xdiv, counts, offsets, list, tiles
template <bool FRAG>
__device__ __forceinline__ void moe_tcb_body(MOE_TCB_ARGS) {
    extern __shared__ float smem[];
    tl_stamp();  // launched in order, not as a dependent: the timeline's stamp at entry
    if ((int)blockIdx.y >= tiles[0]) return;
    const int e = tiles[1 + 2 * blockIdx.y], f0 = tiles[2 + 2 * blockIdx.y];
    const int cnt = min(TCB_TOK, counts[e] - f0);
    const int* lst = list + offsets[e] + f0;
    const int gpr = cols >> 6;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + 2 * gpr * TCB_WORDS;
    EXPERT_MATS;
    // Rows r_begin..r_end of the expert; the tile helpers see the expert's rows as [0, r_end).
    const int r_begin = blockIdx.x * rpb, r_end = min(rows, r_begin + rpb);
    __shared__ int slot[TCB_TOK], xrow[TCB_TOK];
    for (int c0 = 0; c0 < cnt; c0 += TCB_TOK) {
        const int nt = min(TCB_TOK, cnt - c0);
        __syncthreads();  // the previous chunk's fragments and slots are no longer read
        if ((int)threadIdx.x < nt) {
            const int sl = lst[c0 + threadIdx.x];
            slot[threadIdx.x] = sl;
            // Shared-expert slots shared_base + t read token t's row.
            xrow[threadIdx.x] = sl >= shared_base ? sl - shared_base : sl / xdiv;
        }
        __syncthreads();
        load_tokens_tc(frag, gs_in, cols, 0, nt, xrow, xf, gsum);
        if (nt > 8) moe_tcb_rows<2, FRAG>(w, s, b, w2, s2, b2, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum);
        else moe_tcb_rows<1, FRAG>(w, s, b, w2, s2, b2, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum);
    }
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcb(MOE_TCB_ARGS) { moe_tcb_body<false>(MOE_TCB_NAMES); }
// moe_tcb over codes in fragment order (tc_load).
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcb_f(MOE_TCB_ARGS) { moe_tcb_body<true>(MOE_TCB_NAMES); }

// The parameters of moe_tcp and moe_tcr (moe_tcb's, less its rows per block; moe::tcb_args).
#define MOE_TILE_ARGS                                                                                                \
    const u32 *__restrict__ w, const u16 *__restrict__ s, const u16 *__restrict__ b, const u32 *__restrict__ w2,     \
        const u16 *__restrict__ s2, const u16 *__restrict__ b2, const u32 *__restrict__ sw,                          \
        const u16 *__restrict__ ss, const u16 *__restrict__ sb, const u32 *__restrict__ sw2,                         \
        const u16 *__restrict__ ss2, const u16 *__restrict__ sb2, int shared_e, int shared_base,                    \
        float *__restrict__ y, int rows, int cols, const u32 *__restrict__ frag, const float *__restrict__ gs_in,   \
        int xdiv, const int *__restrict__ counts, const int *__restrict__ offsets, const int *__restrict__ list,     \
        const int *__restrict__ tiles

// moe_tcp: moe_tcb's blocks made persistent. One wave of blocks, each taking a contiguous run of
// the (tile, 16-row) items: a block stages the tokens of each tile its run meets once (one or two
// tiles in a batched decode step) and its warps then walk several items apiece (moe_tcb_rows),
// where a moe_tcb block stages its tile for 128 rows, one item per warp. The same products in the
// same order: bit-identical. grid: one wave (any count), block 256; moe_tcb's shared memory.
#define MOE_TILE_NAMES \
    w, s, b, w2, s2, b2, sw, ss, sb, sw2, ss2, sb2, shared_e, shared_base, y, rows, cols, frag, gs_in, xdiv, counts, offsets, list, tiles
// In moe_tcp's and moe_tcq's persistent blocks: the tile of item `lo` (ti; the run's items of it
// end at hi), its expert e's slots (nt of them from f0, listed at lst) and matrix rows (we, se, be:
// the shared expert's own when e is shared_e). A macro over the kernels' parameters and locals, as
// EXPERT_MATS.
#define TCP_RUN_TILE                                                                   \
    const int ti = lo / rtiles, hi = min(i1, (ti + 1) * rtiles);                      \
    const int e = tiles[1 + 2 * ti], f0 = tiles[2 + 2 * ti];                          \
    const int nt = min(TCB_TOK, counts[e] - f0);                                      \
    const int* lst = list + offsets[e] + f0;                                          \
    const bool sh = e == shared_e;                                                    \
    const size_t erows = sh ? 0 : (size_t)e * rows;                                   \
    const u32* we = (sh ? sw : w) + erows * wpr;                                      \
    const u16 *se = (sh ? ss : s) + erows * gpr, *be = (sh ? sb : b) + erows * gpr;

template <bool FRAG>
__device__ __forceinline__ void moe_tcp_body(MOE_TILE_ARGS) {
    extern __shared__ float smem[];
    tl_stamp();  // launched in order, not as a dependent: the timeline's stamp at entry
    const int rtiles = (rows + 15) >> 4, gpr = cols >> 6;
    const long long total = (long long)tiles[0] * rtiles;
    const int i0 = (int)(total * blockIdx.x / gridDim.x), i1 = (int)(total * (blockIdx.x + 1) / gridDim.x);
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + 2 * gpr * TCB_WORDS;
    const size_t wpr = (size_t)cols >> 3;
    __shared__ int slot[TCB_TOK], xrow[TCB_TOK];
    for (int lo = i0; lo < i1;) {
        TCP_RUN_TILE
        const u32* w2e = w2 ? (sh ? sw2 : w2) + erows * wpr : nullptr;
        const u16 *s2e = w2 ? (sh ? ss2 : s2) + erows * gpr : nullptr, *b2e = w2 ? (sh ? sb2 : b2) + erows * gpr : nullptr;
        __syncthreads();  // the previous tile's fragments and slots are no longer read
        TILE_SLOTS
        __syncthreads();
        load_tokens_tc(frag, gs_in, cols, 0, nt, xrow, xf, gsum);
        const int r_begin = (lo - ti * rtiles) * 16, r_end = min(rows, (hi - ti * rtiles) * 16);
        if (nt > 8) moe_tcb_rows<2, FRAG>(we, se, be, w2e, s2e, b2e, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum);
        else moe_tcb_rows<1, FRAG>(we, se, be, w2e, s2e, b2e, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum);
        lo = hi;
    }
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcp(MOE_TILE_ARGS) { moe_tcp_body<false>(MOE_TILE_NAMES); }
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcp_f(MOE_TILE_ARGS) { moe_tcp_body<true>(MOE_TILE_NAMES); }

// moe_tcr: moe_tcb's products with each warp's weights streamed through a ring in shared memory
// (common.cuh). Why: a moe_tcb warp loads a 512-column item of its 16 rows into registers and
// then multiplies it, so its loads are in flight only between items and it stalls on them at
// every item (long scoreboard, the most of its stalls at 16 rows); the item's 48 registers leave
// no room for a second. The ring keeps TCR_DEPTH - 1 stages in flight while the warp multiplies,
// and the first ones load while the block stages its tokens. No block barrier after the tokens:
// each warp waits on its own copies. The same products in the same order per group (tcb_group):
// bit-identical to moe_tcb. grid (ceil(rows / 128), tiles), block 256 (8 warps, one 16-row tile
// each). Dynamic shared memory: moe_tcb's + 8 * TCR_DEPTH * TCR_STAGE_BYTES (moe::tcr_smem).
// cols: a multiple of 64 * TCR_GROUPS.

// A warp's 16-row tile through its ring: the first matrix's stages (and the second's, GLU), the
// first TCR_DEPTH - 1 already issued; then SwiGLU and the store as moe_tcb's.
template <int NTG, bool FRAG>
__device__ __forceinline__ void tcr_tile(unsigned char* ring, const TcrSrc<FRAG>& src, const TcrSrc<FRAG>& src2, bool glu,
                                         float* __restrict__ y, int rows, int cols, int r0, int r_end, const int* slots,
                                         int nt, const u32* xf, const float* gsum, u32* __restrict__ sfrag, float* red) {
    const int gpr = cols >> 6, half = gpr / TCR_GROUPS, nst = (glu ? 2 : 1) * half;
    float acc[NTG][4], up[NTG][4];
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = up[tg][0] = up[tg][1] = up[tg][2] = up[tg][3] = 0.f;
    const unsigned ring_s = smem_u32(ring);
    // Stage n = k + TCR_DEPTH - 1 to issue is group TCR_GROUPS * nh of the first matrix
    // (second == 0) or of the second: counted along, not divided out per stage (a division by
    // the run-time `half` is some 25 instructions on the issue path every stage waits behind).
    int nh = TCR_DEPTH - 1, second = 0;
    while (nh >= half) {
        nh -= half;
        ++second;
    }
    for (int k = 0; k < nst; ++k) {
        __syncwarp();  // every lane is done with stage k - 1, whose slot the next copies overwrite
        const int n = k + TCR_DEPTH - 1;
        if (n < nst) {
            tcr_issue<FRAG>(ring_s + (n % TCR_DEPTH) * TCR_STAGE_BYTES, src, src2, second, TCR_GROUPS * nh);
            if (++nh == half) {
                nh = 0;
                ++second;
            }
        } else {
            cp_commit();  // an empty group keeps the count the wait below relies on
        }
        cp_wait<TCR_DEPTH - 1>();
        __syncwarp();  // stage k's copies, made by every lane, are visible to all
        const unsigned char* cur = ring + (k % TCR_DEPTH) * TCR_STAGE_BYTES;
        if (k < half) tcr_stage<NTG, FRAG>(cur, TCR_GROUPS * k, xf, gsum, gpr, acc);
        else tcr_stage<NTG, FRAG>(cur, TCR_GROUPS * (k - half), xf, gsum, gpr, up);
    }
    if (glu) tcb_swiglu<NTG>(acc, up);
    if (sfrag) tcb_stage_words<NTG>(acc, sfrag, red, r0, rows >> 6, slots, nt);
    else tcb_store<NTG>(acc, y, rows, r_end, r0, slots, nt);
}

// The group sums of a moe_tcr block's staged outputs (tcb_stage_words): per token and 64-column
// group of the block's rows, the four quarters' partial sums in stage_tcb's butterfly order.
__device__ __forceinline__ void tcr_stage_sums(const float* red, float* __restrict__ sgsum, int r_begin, int r_end, int gpr,
                                               const int* slots, int nt) {
    const int tid = threadIdx.x, gh = tid >> 4, tok = tid & (TCB_TOK - 1);
    if (tid >= 2 * TCB_TOK || tok >= nt || r_begin + 64 * gh >= r_end) return;
    auto d = [&](int tq, int r) { return red[((4 * gh + tq) * TCB_TOK + tok) * 2 + r]; };
    const float e0 = (d(0, 0) + d(2, 0)) + (d(1, 0) + d(3, 0)), e1 = (d(0, 1) + d(2, 1)) + (d(1, 1) + d(3, 1));
    sgsum[(size_t)slots[tok] * gpr + (r_begin >> 6) + gh] = e0 + e1;
}

template <bool FRAG>
__device__ __forceinline__ void moe_tcr_body(MOE_TILE_ARGS, u32* __restrict__ sfrag, float* __restrict__ sgsum) {
    extern __shared__ float smem[];
    tl_stamp();  // launched in order, not as a dependent: the timeline's stamp at entry
    if ((int)blockIdx.y >= tiles[0]) return;
    const int e = tiles[1 + 2 * blockIdx.y], f0 = tiles[2 + 2 * blockIdx.y];
    const int gpr = cols >> 6, warp = threadIdx.x >> 5;
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + 2 * gpr * TCB_WORDS;
    unsigned char* ring = reinterpret_cast<unsigned char*>(gsum + TCB_TOK * gpr) + warp * (TCR_DEPTH * TCR_STAGE_BYTES);
    const u16 *st = s, *st2 = s2;  // FRAG: the scales and biases in stage order (tcr_issue)
    EXPERT_MATS;
    if constexpr (FRAG) {
        // Stage order holds both, 2 * gpr words per row: expert e's from row e * rows on.
        s = e == shared_e ? ss : st + 2 * erows * gpr;
        s2 = e == shared_e ? ss2 : st2 + 2 * erows * gpr;
    }
    const int r0 = blockIdx.x * 128 + warp * 16, r_end = min(rows, (int)blockIdx.x * 128 + 128);
    const int half = gpr / TCR_GROUPS, nst = (w2 ? 2 : 1) * half;
    const TcrSrc<FRAG> src(w, s, b, r0, r_end, cols), src2(w2 ? w2 : w, w2 ? s2 : s, w2 ? b2 : b, r0, r_end, cols);
    // The ring's first stages load while the block stages its tokens.
    if (r0 < r_end)
        for (int n = 0; n < TCR_DEPTH - 1 && n < nst; ++n) {
            const bool second = n >= half;
            tcr_issue<FRAG>(smem_u32(ring + n * TCR_STAGE_BYTES), src, src2, second, TCR_GROUPS * (n % half));
        }
    for (int n = nst; n < TCR_DEPTH - 1; ++n) cp_commit();
    const int nt = min(TCB_TOK, counts[e] - f0);
    const int* lst = list + offsets[e] + f0;
    __shared__ int slot[TCB_TOK], xrow[TCB_TOK];
    TILE_SLOTS
    __syncthreads();
    load_tokens_tc(frag, gs_in, cols, 0, nt, xrow, xf, gsum);
    __shared__ float red[8 * TCB_TOK * 2];
    if (r0 < r_end) {
        if (nt > 8) tcr_tile<2, FRAG>(ring, src, src2, w2 != nullptr, y, rows, cols, r0, r_end, slot, nt, xf, gsum, sfrag, red);
        else tcr_tile<1, FRAG>(ring, src, src2, w2 != nullptr, y, rows, cols, r0, r_end, slot, nt, xf, gsum, sfrag, red);
    }
    if (sfrag) {
        __syncthreads();
        tcr_stage_sums(red, sgsum, blockIdx.x * 128, r_end, rows >> 6, slot, nt);
    }
}
// sfrag / sgsum: null to store y; else (rows a multiple of 64) the outputs staged there as
// stage_tcb would stage them from y (the next product's input, bit for bit), and y is not written.
#define MOE_TCR_ARGS MOE_TILE_ARGS, u32 *__restrict__ sfrag, float *__restrict__ sgsum
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcr(MOE_TCR_ARGS) { moe_tcr_body<false>(MOE_TILE_NAMES, sfrag, sgsum); }
// moe_tcr over codes in fragment order (tc_load) with the scales and biases in stage order: s,
// s2, ss and ss2 hold them (tcr_issue), b, b2, sb and sb2 are not read.
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcr_f(MOE_TCR_ARGS) { moe_tcr_body<true>(MOE_TILE_NAMES, sfrag, sgsum); }
// moe_tcr_f at the 35B's gate|up shapes (512 rows of 2,048 columns per expert matrix) as
// compile-time constants, so its ring's and tiles' index arithmetic folds (as moe_tcq_f_35b).
// The same products in the same order; the host launches it only at those shapes (the rows and
// cols arguments are not read).
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcr_f_35b(MOE_TCR_ARGS) {
    moe_tcr_body<true>(w, s, b, w2, s2, b2, sw, ss, sb, sw2, ss2, sb2, shared_e, shared_base, y, 512, 2048, frag, gs_in,
                       xdiv, counts, offsets, list, tiles, sfrag, sgsum);
}

// moe_tcq: moe_tcp's persistent blocks with each warp's weights streamed through a ring as
// moe_tcr's (the down products; no second matrix). Why: a moe_tcp warp loads a whole item (16 rows
// x 512 columns) into registers and then multiplies it, so it waits on memory at every item with
// nothing else in flight (Nsight Compute: long scoreboard the largest stall); here the ring runs
// on across the warp's items of a tile, so the next item's stages load while the current one is
// multiplied. A block's run of (tile, 16-row) items is moe_tcp's; per tile of the run the first
// stages are issued before the block stages the tile's tokens. The same products per group in
// group order (tcr_stage): bit-identical to moe_tcp. Fragment-order codes with row-order scales
// and biases (TcrSrc<true, false>). grid: one wave (any count), block 256; moe_tcr's shared
// memory. cols: a multiple of 64 * TCR_GROUPS.
// Issues stage `ig` (TCR_GROUPS groups) of the warp's item at row `im` into the ring slot at
// `dst`, then moves (ig, im, isrc) on to the next stage: the next groups, or the warp's next item
// (`step` rows on) once the item's `spi` stages are issued.
__device__ __forceinline__ void tcq_issue_next(unsigned dst, TcrSrc<true, false>& isrc, int& ig, int& im, int spi, int step,
                                               const u32* we, const u16* se, const u16* be, int r_end, int cols) {
    tcr_issue<true, false>(dst, isrc, isrc, false, TCR_GROUPS * ig);
    if (++ig == spi) {
        ig = 0;
        im += step;
        isrc = TcrSrc<true, false>(we, se, be, im, r_end, cols);
    }
}

template <int NTG>
__device__ __forceinline__ void tcq_run(unsigned char* ring, const u32* we, const u16* se, const u16* be, float* __restrict__ y,
                                        int rows, int cols, int r_begin, int r_end, const int* slots, int nt, const u32* xf,
                                        const float* gsum, int& ig, int& im, int nst, TcrSrc<true, false>& isrc) {
    const int gpr = cols >> 6, spi = gpr / TCR_GROUPS, step = 16 * (blockDim.x >> 5);
    const unsigned ring_s = smem_u32(ring);
    float acc[NTG][4];
#pragma unroll
    for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
    int r0 = r_begin + 16 * (threadIdx.x >> 5), cg = 0;
    for (int k = 0; k < nst; ++k) {
        __syncwarp();  // every lane is done with stage k - 1, whose slot the next copies overwrite
        if (k + TCR_DEPTH - 1 < nst) {
            tcq_issue_next(ring_s + ((k + TCR_DEPTH - 1) % TCR_DEPTH) * TCR_STAGE_BYTES, isrc, ig, im, spi, step, we, se, be, r_end, cols);
        } else {
            cp_commit();  // an empty group keeps the count the wait below relies on
        }
        cp_wait<TCR_DEPTH - 1>();
        __syncwarp();  // stage k's copies, made by every lane, are visible to all
        tcr_stage<NTG, true>(ring + (k % TCR_DEPTH) * TCR_STAGE_BYTES, TCR_GROUPS * cg, xf, gsum, gpr, acc);
        if (++cg == spi) {
            tcb_store<NTG>(acc, y, rows, r_end, r0, slots, nt);
#pragma unroll
            for (int tg = 0; tg < NTG; ++tg) acc[tg][0] = acc[tg][1] = acc[tg][2] = acc[tg][3] = 0.f;
            cg = 0;
            r0 += step;
        }
    }
}

__device__ __forceinline__ void moe_tcq_body(MOE_TILE_ARGS) {
    extern __shared__ float smem[];
    tl_stamp();  // launched in order, not as a dependent: the timeline's stamp at entry
    const int rtiles = (rows + 15) >> 4, gpr = cols >> 6, spi = gpr / TCR_GROUPS;
    const long long total = (long long)tiles[0] * rtiles;
    const int i0 = (int)(total * blockIdx.x / gridDim.x), i1 = (int)(total * (blockIdx.x + 1) / gridDim.x);
    const int warp = threadIdx.x >> 5, step = 16 * (blockDim.x >> 5);
    u32* xf = reinterpret_cast<u32*>(smem);
    float* gsum = smem + 2 * gpr * TCB_WORDS;
    unsigned char* ring = reinterpret_cast<unsigned char*>(gsum + TCB_TOK * gpr) + warp * (TCR_DEPTH * TCR_STAGE_BYTES);
    const size_t wpr = (size_t)cols >> 3;
    __shared__ int slot[TCB_TOK], xrow[TCB_TOK];
    for (int lo = i0; lo < i1;) {
        TCP_RUN_TILE
        const int r_begin = (lo - ti * rtiles) * 16, r_end = min(rows, (hi - ti * rtiles) * 16);
        // The warp's items of the run: rows r_begin + 16 warp + k step, k < its count.
        const int first = r_begin + 16 * warp;
        const int items = first < r_end ? (r_end - first + step - 1) / step : 0, nst = items * spi;
        __syncthreads();  // the previous tile's fragments, slots and ring stages are no longer read
        // The ring's first stages load while the block stages the tile's tokens.
        int ig = 0, im = first;
        TcrSrc<true, false> isrc(we, se, be, first, r_end, cols);
        for (int n = 0; n < TCR_DEPTH - 1; ++n) {
            if (n < nst) {
                tcq_issue_next(smem_u32(ring + n * TCR_STAGE_BYTES), isrc, ig, im, spi, step, we, se, be, r_end, cols);
            } else {
                cp_commit();
            }
        }
        TILE_SLOTS
        __syncthreads();
        load_tokens_tc(frag, gs_in, cols, 0, nt, xrow, xf, gsum);
        if (nt > 8) tcq_run<2>(ring, we, se, be, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum, ig, im, nst, isrc);
        else tcq_run<1>(ring, we, se, be, y, rows, cols, r_begin, r_end, slot, nt, xf, gsum, ig, im, nst, isrc);
        lo = hi;
    }
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcq_f(MOE_TILE_ARGS) { moe_tcq_body(MOE_TILE_NAMES); }
// moe_tcq_f at the 35B's down shapes (2,048 rows of 512 columns per expert) as compile-time
// constants, so its ring's and tiles' index arithmetic folds (as the GDN steps' _35b instances).
// The same products in the same order; the host launches it only at those shapes (the rows and
// cols arguments are not read).
extern "C" __global__ void __launch_bounds__(256, 2) moe_tcq_f_35b(MOE_TILE_ARGS) {
    moe_tcq_body(w, s, b, w2, s2, b2, sw, ss, sb, sw2, ss2, sb2, shared_e, shared_base, y, 2048, 512, frag, gs_in, xdiv,
                 counts, offsets, list, tiles);
}

// ============ the routed experts of long prefill chunks on warpgroup MMA (wgmma) ============
// Why: with ~128 slots per expert a 4K chunk's expert products are compute work (8.2 TFLOP per
// forward), and mma.sync made every warp load its B fragments from shared memory and build its A
// fragments for each 16 x 8 x 16 product: the issue slots, not the tensor cores, bound them. A
// wgmma of 64 rows x 128 slots x 16 columns reads its B (the slots' activations) from shared
// memory by itself, asynchronously, so each warp only dequantises its weights into A fragments
// (affine_a_frag, the operands the other bf16 paths multiply) while the previous group's
// products run, and each dequantised weight serves 128 slots.
//
// Per CTA (four warpgroups): one (expert, 128-slot) tile of pf_scan's lists and a block of 256 A
// rows. Every 64-column group, the block copies the slots' bf16 inputs (stage_wg's order) and
// its rows' codes into one of WG_STAGES stages of shared memory by cp.async, and the rows'
// scales and biases 8 groups at a time; each thread then reads its two rows' operands from
// there. Whole 16-byte copies shared by the block, not each thread's own small loads: per-thread
// 4- and 8-byte copies of the same bytes queued so many requests that the gate|up kernel got
// slower than with plain loads two groups ahead (docs/cuda-prefill.md). Gate|up with SwiGLU
// (pf_moe_wg_glu): each warp's 16 A rows are 8 gate rows and the same 8 up rows (A rows g and
// g + 8 of lane g), so the thread holding a slot's gate accumulator holds its up one too; the
// result h = silu(gate) * up goes out as bf16 in stage_wg's order, the down product's input.
// Down (pf_moe_wg_down_res, below): each warp 16 rows, bf16 out [slot][row].
#define WG_N 128         // slots per tile, as staged (pf_moe_wg_tile narrows each tile's wgmmas)
#define WG_STAGES 4      // 64-column groups of the slots' inputs in shared memory
#define WG_THREADS 512   // four warpgroups: the more rows share each staged input, the fewer L2 reads
#define WG_GLU_ROWS 128  // output rows per CTA: 32 per warpgroup (gate and up interleaved)
#define WG_DOWN_ROWS 256 // 64 per warpgroup

// The u16 index, within a staged row of whole 64-column groups, of column c in stage_wg's order.
__device__ __forceinline__ int wg_pos(int c) {
    const int G = c >> 6, cg = c & 63, t = cg >> 4, h = (cg >> 3) & 1, nib = cg & 7, J = nib & 3;
    const int i = 2 * h + (J >> 1), reg = J & 1;
    return 2 * (G * 32 + i * 8 + reg * 4 + t) + (nib >> 2);
}

// stage_wg: rows of x [n][cols] (f32) as bf16 words in the order the wgmma's B reads them: word
// 32G + 8i + 4reg + t of a row holds columns (c, c + 4), c = 64G + 16t + 8(i >> 1) + 2(i & 1) + reg,
// i.e. k slots (2t, 2t + 1) (reg 0) and (2t + 8, 2t + 9) (reg 1) of mma step i of group G as
// affine_a_frag pairs them; each 16 bytes (fixed G, i, reg) is one row of a core matrix.
// grid (n), block 256.
extern "C" __global__ void __launch_bounds__(256) stage_wg(const float* __restrict__ x, int cols, u32* __restrict__ out) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    for (int w = threadIdx.x; w < cols / 2; w += blockDim.x) {
        const int G = w >> 5, i = (w >> 3) & 3, reg = (w >> 2) & 1, t = w & 3;
        const int c = 64 * G + 16 * t + 8 * (i >> 1) + 2 * (i & 1) + reg;
        out[(size_t)blockIdx.x * (cols / 2) + w] = pack_bf16(xr[c], xr[c + 4]);
    }
}

// Shared memory of a CTA: WG_STAGES stages of (the slots' inputs of one 64-column group, the
// block's 256 A rows' codes of one group), two buffers of the rows' scales and biases of 8
// groups, then the tile's slot and input-row indices.
#define WG_AROWS 256                 // A rows per CTA: 16 per warp
#define WG_CODES (WG_AROWS * 32)     // one group's codes of the A rows
#define WG_SCALES (WG_AROWS * 2 * 16)  // 8 groups' scales and biases of the A rows
// A stage of tiles of NS slots (WG_N, or WG_NARROW for the narrow kernels).
#define WG_STAGE(NS) ((NS) * 128 + WG_CODES)
// moe::wg_smem: WG_STAGES * WG_STAGE(NS) + 2 * WG_SCALES + 2 * NS * 4 bytes.
// The narrow kernels (pf_moe_wg_glu_n, pf_moe_wg_down_res_n): tiles of WG_NARROW slots staged as
// such, for short chunks (a few dozen slots per expert, every expert's weights read once per
// layer at ~1.5 TB/s by one CTA per SM): their stages are a quarter of the wide kernels' inputs,
// so two CTAs share an SM (64 registers) and each one's step chain and ring fill run beside the
// other's. Each A fragment is built in the step that multiplies it (one buffer: at 32 slots the
// products are short, and the second buffer's 16 registers would spill).
#define WG_NARROW 32

// One thread's A operands of one group before dequantisation: its two rows' codes (lane t's 16
// columns each) and their scales and biases as bf16 pairs.
struct WgGroup {
    uint2 qa, qb;
    u32 sa, ba, sb, bb;
};

// The scales and biases of A rows ka and kb for one group (`ss`: the group's first row's scale;
// each row's 8 scales then 8 biases are 32 bytes), as bf16 pairs.
__device__ __forceinline__ void wg_read_scales(u32 ss, int ka, int kb, WgGroup& c) {
    c.sa = lds_bf16_pair(ss + ka * 32);
    c.ba = lds_bf16_pair(ss + ka * 32 + 16);
    c.sb = lds_bf16_pair(ss + kb * 32);
    c.bb = lds_bf16_pair(ss + kb * 32 + 16);
}

// The tile's slots (-1 past its `cnt`) and their input rows (slot / xdiv) into shared memory,
// by the block's first N threads (`tid`: this one).
template <int N>
__device__ __forceinline__ void wg_tile_slots(int tid, int* slot, int* xrow, const int* lst, int cnt, int xdiv) {
    if (tid < N) {
        const int sl = tid < cnt ? lst[tid] : -1;
        slot[tid] = sl;
        xrow[tid] = sl >= 0 ? sl / xdiv : -1;
    }
}

// A stage ring's barriers at `bars`: `stages` full ones expecting `fulls` arrivals per phase,
// then as many empty ones expecting `empties`.
__device__ __forceinline__ void wg_ring_init(u32 bars, int stages, u32 fulls, u32 empties) {
    if (threadIdx.x == 0) {
        for (int k = 0; k < stages; ++k) {
            mbar_init(bars + 8 * k, fulls);
            mbar_init(bars + 8 * (stages + k), empties);
        }
        mbar_init_fence();
    }
}

// The gate|up epilogue: thread (warp, g, t) holds output row R = 8 warp + g of the block (gate
// accumulators acc[4j + q], up acc[4j + 2 + q] of column 8j + 2t + q); h = silu(gate) * up goes
// out as bf16 in stage_wg's order to each of the tile's `cnt` slots.
template <int NW>
__device__ __forceinline__ void wg_glu_store(float (&acc)[NW / 2], const int* slot, int cnt, int rows, void* out, int warp, int g,
                                             int t) {
#pragma unroll
    for (int q = 0; q < NW / 2; ++q) wgmma_keep(acc[q]);
    const int R = blockIdx.x * WG_GLU_ROWS + warp * 8 + g;
    if (R >= rows) return;
    u16* h = reinterpret_cast<u16*>(out);
    const int pos = wg_pos(R);
#pragma unroll
    for (int j = 0; j < NW / 8; ++j) {
        const int2 sl = *reinterpret_cast<const int2*>(slot + 8 * j + 2 * t);  // columns 8j + 2t, + 1
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int n = 8 * j + 2 * t + q;
            // A 32-bit element offset: moe::wg_outputs_fit bounds h below 2^32 elements.
            const u32 off = (u32)(q ? sl.y : sl.x) * (u32)rows + (u32)pos;
            if (n < cnt) h[off] = (u16)(pack_bf16(silu_f(acc[4 * j + q]) * acc[4 * j + 2 + q], 0.f) & 0xffffu);
        }
    }
}

template <bool FRAG, int NW, int NS = WG_N>
__device__ __forceinline__ void pf_moe_wg_body(const u32* __restrict__ w, const u16* __restrict__ s,
                                               const u16* __restrict__ b, const u32* __restrict__ w2,
                                               const u16* __restrict__ s2, const u16* __restrict__ b2,
                                               void* __restrict__ out, int rows, int cols,
                                               const u32* __restrict__ x, int xdiv, const int* __restrict__ counts,
                                               const int* __restrict__ offsets, const int* __restrict__ list,
                                               const int* __restrict__ tiles) {
    constexpr int N = NS;
    constexpr bool NARROW = NS < WG_N;
    extern __shared__ uint4 wg_sm4[];  // 16-byte aligned: cp.async pieces, descriptor addresses
    unsigned char* wg_sm = reinterpret_cast<unsigned char*>(wg_sm4);
    if ((int)blockIdx.y >= tiles[0]) return;
    const int e = tiles[1 + 2 * blockIdx.y], f0 = tiles[2 + 2 * blockIdx.y];
    const int cnt = min(N, counts[e] - f0);
    const int* lst = list + offsets[e] + f0;
    const int gpr = cols >> 6, xwords = cols >> 1;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    constexpr int STAGE = WG_STAGE(NS), SCALES = WG_STAGES * STAGE;
    int* slot = reinterpret_cast<int*>(wg_sm + SCALES + 2 * WG_SCALES);
    int* xrow = slot + N;
    wg_tile_slots<N>(tid, slot, xrow, lst, cnt, xdiv);
    // A row k (0..255) of the block: warp k / 16, lane group k % 8, the thread's row a (k & 8 == 0)
    // or b: a = gate row R, b = up row R (one output row R). A row past `rows` reads the expert's
    // row 0 with zero scales and biases, i.e. zero weights.
    auto a_row = [&](int k, bool& valid) {
        const int wk = k >> 4, gk = k & 7;
        const int R = blockIdx.x * WG_GLU_ROWS + wk * 8 + gk;
        valid = R < rows;
        return e * rows + (valid ? R : 0);
    };
    // The block's copies: thread tid copies half tid & 1 of row tid >> 1's codes of each group
    // (32 bytes per row) and, every 8 groups, its scales (tid & 1 == 0) or biases (16 bytes).
    const int crow = tid >> 1, chalf = tid & 1;
    bool cvalid;
    const int cr = a_row(crow, cvalid);
    const bool cup = (crow >> 3) & 1;
    // Offsets rather than pointers, to spare registers: bytes into the codes, elements into the
    // scales or biases of the copied row; the matrix is picked at each copy.
    const u32 coff = (u32)cr * (u32)(cols >> 1) + chalf * 16, soff = (u32)cr * (u32)gpr;
    const u32 sm0 = smem_u32(wg_sm);
    const u32 cdst = sm0 + N * 128 + crow * 32 + chalf * 16;  // + SCALES - N * 128: the scales' place
    // Fragment order (FRAG): thread tid copies lane tid & 31's 16 bytes of one 16-row tile's group
    // instead, to byte 16 tid of the same 8 KB: gate tiles 0..7 of the block's rows (tid < 256),
    // then the up tiles. A tile past `rows` copies the expert's first (zero scales, as above).
    const int ftile = (tid >> 5) & 7;
    const bool fup = tid >= 256;
    const int fr = blockIdx.x * WG_GLU_ROWS + 16 * ftile;
    const u32 fcoff = (u32)(e * rows + (fr < rows ? fr : 0)) * (u32)(cols >> 1) + lane * 16;
    auto copy_codes = [&](int G) {
        if (G < gpr) {
            if constexpr (FRAG) {
                const unsigned char* src = reinterpret_cast<const unsigned char*>(fup ? w2 : w);
                cp_async16(sm0 + (G % WG_STAGES) * STAGE + N * 128 + tid * 16, src + fcoff + G * 512);
            } else {
                const unsigned char* src = reinterpret_cast<const unsigned char*>(cup ? w2 : w);
                cp_async16(cdst + (G % WG_STAGES) * STAGE, src + coff + G * 32);
            }
        }
    };
    // Groups 8k .. 8k + 7 into buffer k % 2: 16 bytes when they are whole and aligned (gpr a
    // multiple of 8), else element by element (small matrices), zeros past the row or for rows
    // past `rows`.
    auto copy_scales = [&](int k) {
        if (8 * k >= gpr) return;
        const u16* src = (chalf ? (cup ? b2 : b) : (cup ? s2 : s)) + soff;
        const u32 dst = cdst + (SCALES - N * 128) + (k & 1) * WG_SCALES;
        if ((gpr & 7) == 0) {
            cp_async16z(dst, src + 8 * k, cvalid);
        } else {
            u32 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int G0 = 8 * k + 2 * j;
                const u32 lo = cvalid && G0 < gpr ? src[G0] : 0u, hi = cvalid && G0 + 1 < gpr ? src[G0 + 1] : 0u;
                v[j] = lo | (hi << 16);
            }
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
        }
    };
    // This thread's operands of group G from shared memory.
    const int ka = (warp * 2) * 8 + g, kb = ka + 8;
    auto read = [&](int G, WgGroup& c) {
        const u32 cs = sm0 + (G % WG_STAGES) * STAGE + N * 128 + 8 * t, ss = sm0 + SCALES + ((G >> 3) & 1) * WG_SCALES + 2 * (G & 7);
        if constexpr (FRAG) {
            // Gate rows of tile warp / 2, half warp & 1, and the same up rows 4 KB on.
            const u32 fs = sm0 + (G % WG_STAGES) * STAGE + N * 128 + lane * 16;
            const u32 fa = fs + (warp >> 1) * 512 + (warp & 1) * 8;
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qa.x), "=r"(c.qa.y) : "r"(fa));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qb.x), "=r"(c.qb.y) : "r"(fa + 4096));
        } else {
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qa.x), "=r"(c.qa.y) : "r"(cs + ka * 32));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qb.x), "=r"(c.qb.y) : "r"(cs + kb * 32));
        }
        wg_read_scales(ss, ka, kb, c);
    };
    __syncthreads();  // slot and xrow
    // Group G's inputs of the tile's slots go into stage G % WG_STAGES: 16-byte pieces p = 2i + reg
    // of each slot's row (one core-matrix row each) at p * (N * 16) + n * 16, so step i's B is two
    // core matrices along K (LBO N * 16 bytes) by N / 8 along N (SBO 128 bytes). A warp copies 8
    // slots x 4 pieces: whole 64-byte runs of each row into conflict-free 128-byte rows of shared
    // memory. The first N / 8 warps copy two pieces each of every group (all 16 warps at WG_N).
    // Thread tid's first piece: slot n, piece p; its other is piece p + 4 of the same slot.
    constexpr int WG_CP = 2, NG = N / 8;
    static_assert(NG * 32 * WG_CP == N * 8 && NG <= WG_THREADS / 32, "two input pieces per copying thread");
    const int n_in = (lane & 7) + 8 * ((tid >> 5) & (NG - 1)), p_in = lane >> 3;
    const int r_in = (NG * 32 >= WG_THREADS || (tid >> 5) < NG) ? xrow[n_in] : -1;
    const u32 xoff = (u32)max(r_in, 0) * (u32)xwords + p_in * 4, xdst = sm0 + p_in * (N * 16) + n_in * 16;
    auto copy_inputs = [&](int G) {
        if (G < gpr && r_in >= 0) {
            const u32 st = (G % WG_STAGES) * STAGE;
#pragma unroll
            for (int k = 0; k < WG_CP; ++k) cp_async16(xdst + st + k * 4 * (N * 16), x + xoff + G * 32 + k * 16);
        }
    };
    float acc[NW / 2];
#pragma unroll
    for (int q = 0; q < NW / 2; ++q) acc[q] = 0.f;
    // Commits (one per step, some empty, so the count is uniform): P0 = inputs(0), codes(0),
    // codes(1), scales(0); P1 = inputs(1), codes(2); P2 = inputs(2), codes(3); step G: inputs(G + 3),
    // codes(G + 4) and, when G % 8 == 0, scales(G / 8 + 1). Step G waits for all but the two latest
    // commits (everything up to step G - 3's), then the barrier: group G's inputs and group
    // G + 1's codes and scales are in for every thread, and every thread is done with group G - 1,
    // whose stage takes inputs(G + 3) and codes(G + 4) (codes(G) were read during step G - 1).
    static_assert(WG_STAGES == 4, "the commit accounting below");
    // Step i's B: two core matrices along K (LBO N * 16 bytes) by N / 8 along N (SBO 128 bytes).
    const WgmmaDescs bdesc(N * 16, 128);
    const u32 sm4 = sm0 >> 4;
    auto build = [&](const WgGroup& c, u32 (&a)[4][4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) affine_a_frag(c.qa, c.qb, i, c.sa, c.ba, c.sb, c.bb, a[i]);
    };
    if constexpr (NARROW) {
        // Every copy three groups ahead: P0 = inputs(0), codes(0), scales(0); P1 = inputs(1),
        // codes(1); P2 = inputs(2), codes(2); step G: inputs(G + 3), codes(G + 3) and, when
        // G % 8 == 0, scales(G / 8 + 1), into the stage of group G - 1, which every thread read
        // (codes) and multiplied (inputs, waited for) before step G's barrier. Step G waits for
        // all but the two latest commits: group G's.
        copy_inputs(0);
        copy_codes(0);
        copy_scales(0);
        cp_commit();
        for (int G = 1; G < 3; ++G) {
            copy_inputs(G);
            copy_codes(G);
            cp_commit();
        }
        for (int G = 0; G < gpr; ++G) {
            cp_wait<2>();
            fence_proxy_async_smem();
            __syncthreads();
            u32 a[4][4];
            {
                WgGroup c;
                read(G, c);
                build(c, a);
            }
            const u32 st4 = sm4 + (G % WG_STAGES) * (STAGE >> 4);
            wgmma_fence();
#pragma unroll
            for (int i = 0; i < 4; ++i) wgmma_m64k16<NW>(acc, a[i], bdesc.at(st4 + i * 2 * N));
            wgmma_commit();
            copy_inputs(G + 3);
            copy_codes(G + 3);
            if ((G & 7) == 0) copy_scales((G >> 3) + 1);
            cp_commit();
            wgmma_wait<0>();
        }
    } else {
        copy_inputs(0);
        copy_codes(0);
        copy_codes(1);
        copy_scales(0);
        cp_commit();
        copy_inputs(1);
        copy_codes(2);
        cp_commit();
        copy_inputs(2);
        copy_codes(3);
        cp_commit();
        u32 a0[4][4], a1[4][4];
        cp_wait<2>();
        __syncthreads();
        {
            WgGroup c;
            read(0, c);
            build(c, a0);
        }
        // Step G: the wgmmas of group G run while this thread builds group G + 1's A.
        // The products go first, so the tensor cores start right after the barrier; then the copies
        // into the stage of group G - 1 (free once every thread passed the barrier) and the codes'
        // part of group G's stage (read into registers during step G - 1).
        auto step = [&](int G, const u32 (&cur)[4][4], u32 (&nxt)[4][4]) {
            cp_wait<2>();
            fence_proxy_async_smem();
            __syncthreads();
            const bool more = G + 1 < gpr;
            const u32 st4 = sm4 + (G % WG_STAGES) * (STAGE >> 4);
            wgmma_fence();
#pragma unroll
            for (int i = 0; i < 4; ++i) wgmma_m64k16<NW>(acc, cur[i], bdesc.at(st4 + i * 2 * N));
            wgmma_commit();
            copy_inputs(G + 3);
            copy_codes(G + 4);
            if ((G & 7) == 0) copy_scales((G >> 3) + 1);
            cp_commit();
            if (more) {
                WgGroup c;
                read(G + 1, c);
                build(c, nxt);
            }
            wgmma_wait<0>();
        };
        for (int G = 0; G < gpr; G += 2) {
            step(G, a0, a1);
            if (G + 1 < gpr) step(G + 1, a1, a0);
        }
    }
    wg_glu_store<NW>(acc, slot, cnt, rows, out, warp, g, t);
}

#define PF_MOE_WG_ARGS                                                                                          \
    const u32 *__restrict__ w, const u16 *__restrict__ s, const u16 *__restrict__ b, const u32 *__restrict__ w2, \
        const u16 *__restrict__ s2, const u16 *__restrict__ b2, void *__restrict__ out, int rows, int cols,     \
        const u32 *__restrict__ x, int xdiv, const int *__restrict__ counts, const int *__restrict__ offsets,    \
        const int *__restrict__ list, const int *__restrict__ tiles
#define PF_MOE_WG_PASS w, s, b, w2, s2, b2, out, rows, cols, x, xdiv, counts, offsets, list, tiles
// A tile's products at the narrowest wgmma width NW that covers its slots: an expert's last tile
// usually holds a remainder of its slots (at 4K tokens ~128 per expert, so about every other
// expert has a second tile of a few slots), and at NW = 128 its block ran the full tile's tensor
// work for them. The staging layout stays that of WG_N slots; columns past the tile's slots
// multiply whatever the stage holds and are never stored.
// WG_AT_TILE_WIDTH(call): in a kernel over the lists' tiles (blockIdx.y; blocks past the last
// tile return), `call` with NW the narrowest width that covers the tile's slots. A macro: NVRTC
// takes no generic lambda in device code, and every kernel over the tiles dispatches so but the
// cluster gate|up, whose tiles' slots come from wgm_tile_slots.
#define WG_AT_TILE_WIDTH(...)                                                             \
    if ((int)blockIdx.y >= tiles[0]) return;                                              \
    const int wg_cnt = counts[tiles[1 + 2 * blockIdx.y]] - tiles[2 + 2 * blockIdx.y];     \
    if (wg_cnt <= 32) {                                                                   \
        constexpr int NW = 32;                                                            \
        __VA_ARGS__;                                                                      \
    } else if (wg_cnt <= 64) {                                                            \
        constexpr int NW = 64;                                                            \
        __VA_ARGS__;                                                                      \
    } else if (wg_cnt <= 96) {                                                            \
        constexpr int NW = 96;                                                            \
        __VA_ARGS__;                                                                      \
    } else {                                                                              \
        constexpr int NW = WG_N;                                                          \
        __VA_ARGS__;                                                                      \
    }
template <bool FRAG>
__device__ __forceinline__ void pf_moe_wg_tile(PF_MOE_WG_ARGS) {
    WG_AT_TILE_WIDTH(pf_moe_wg_body<FRAG, NW>(PF_MOE_WG_PASS))
}
// gate|up with SwiGLU into h (bf16, stage_wg's order, [slot][rows], pf_moe_wg_down_res's input):
// grid (ceil(rows / WG_GLU_ROWS), tiles), block WG_THREADS, dynamic shared memory moe::WG_SMEM;
// tiles of WG_N slots.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) pf_moe_wg_glu(PF_MOE_WG_ARGS) {
    pf_moe_wg_tile<false>(PF_MOE_WG_PASS);
}
// The same over experts in fragment order (tc_load).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) pf_moe_wg_glu_f(PF_MOE_WG_ARGS) {
    pf_moe_wg_tile<true>(PF_MOE_WG_PASS);
}
// Narrow: tiles of WG_NARROW slots (lists built with that tile), two CTAs per SM; shared memory
// moe::wg_smem(WG_NARROW).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 2) pf_moe_wg_glu_n(PF_MOE_WG_ARGS) {
    pf_moe_wg_body<false, WG_NARROW, WG_NARROW>(PF_MOE_WG_PASS);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 2) pf_moe_wg_glu_n_f(PF_MOE_WG_ARGS) {
    pf_moe_wg_body<true, WG_NARROW, WG_NARROW>(PF_MOE_WG_PASS);
}

#define WGM_STAGES 6
#define WGM_AHEAD 3                        // groups copied ahead of the one multiplied
#define WGM_SLACK 32                       // slots past WG_N an expert's last tile takes in
#define WGM_N (WG_N + WGM_SLACK)           // slots a stage holds
#define WGM_STAGE (WGM_N * 128 + WG_CODES)  // the slots' inputs, then the codes
// moe::wgm_smem: 1,024 (alignment) + WGM_STAGES * WGM_STAGE + 4 * 128 * wgm_scale_row(cols / 64) + 16 * WGM_STAGES
// (barriers) + 2 * WGM_N * 4 (slot and input-row indices).
// A scale row's stride in shared memory: 16 bytes past the groups' scales, so the 8 rows a warp
// reads at once fall in distinct banks.
__device__ __forceinline__ int wgm_scale_row(int gpr) { return 2 * gpr + 16; }
// The slots pf_moe_wg_glu_mc takes at the WG_N-slot tile at slot f0 of an expert's `count`: all
// the rest where at most WGM_N are left; none (its CTAs leave at once) at an expert's last tile
// of up to WGM_SLACK slots past a full one, which the tile before took.
__device__ __forceinline__ int wgm_tile_slots(int count, int f0) {
    const int rest = count - f0;
    if (f0 > 0 && rest <= WGM_SLACK) return 0;
    return rest <= WGM_N ? rest : WG_N;
}

// pf_moe_wg_glu_mc: the wide gate|up over codes in fragment order, its stages handed between
// warps by mbarriers instead of a block barrier per step, and the slots' inputs brought once per
// thread block cluster of the tile's row blocks (the launch's clusters span x: the expert's
// 128-row blocks of one tile read the same inputs, which were the most of the kernel's L2
// reads). Each block of a cluster of C copies 1 / C of every warp's slots (up to 10) per group
// by tensor copies multicast to all C blocks (the map's 128-byte swizzle, so a stage holds the
// slots as K-major rows the wgmma's B reads with SBO 1,024), and its own rows' codes by one
// 512-byte bulk copy per warp; each warp arrives on its block's full barrier expecting its slots'
// and its codes' bytes, whoever copies them. Each warp arrives on the empty barrier of every block of the
// cluster once its products from a stage are done (C x 16 arrivals per phase), and a stage is
// refilled only after all of them. The warps then drift apart by up to WGM_STAGES - WGM_AHEAD - 1
// groups, one's dequantisation under another's products (the step is bound by its instruction
// stream: the block barrier held every warp to the slowest). The rows' scales and biases of every
// group stay in shared memory (copied once). An expert's last tile takes in the up to WGM_SLACK
// slots past it (wgm_tile_slots), so at ~128 slots per expert about every other expert makes one
// tile of up to 160 slots instead of a full one and one of a few: the step's dequantisation and
// copies, which set its pace, then serve all of them once (NW = 160 keeps one A buffer, built in
// the step that multiplies it, for want of registers). Same products in the same order as
// pf_moe_wg_glu_f: the same bits.
template <int NW>
__device__ __forceinline__ void pf_moe_wgc_body(PF_MOE_WG_ARGS, const TmaMap* xmap, int cnt) {
    constexpr int N = WGM_N, S = WGM_STAGES, L = WGM_AHEAD, SPW = N / 16;
    static_assert(S > L + 1, "the warps drift apart by S - L - 1 groups");
    static_assert(WGM_STAGE % 1024 == 0, "every stage starts on a swizzle atom");
    (void)x;
    extern __shared__ uint4 wg_sm4[];
    const u32 raw = smem_u32(wg_sm4);
    const u32 sm0 = (raw + 1023u) & ~1023u;  // the swizzle's 8-row atoms sit on 1,024-byte boundaries
    const u32 C = cluster_blocks(), rank = cluster_rank();
    const int e = tiles[1 + 2 * blockIdx.y], f0 = tiles[2 + 2 * blockIdx.y];
    const int* lst = list + offsets[e] + f0;
    const int gpr = cols >> 6, srs = wgm_scale_row(gpr);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const u32 scl = sm0 + S * WGM_STAGE;  // gate scales, gate biases, up scales, up biases: 128 rows each
    const u32 bars = scl + 4 * 128 * srs;  // full[S], then empty[S]
    int* xrow = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(wg_sm4) + (bars + 16 * S - raw));
    int* slot = xrow + N;
    wg_tile_slots<N>(tid, slot, xrow, lst, cnt, xdiv);
    auto full = [&](u32 st) { return bars + 8 * st; };
    auto empty = [&](u32 st) { return bars + 8 * (S + st); };
    // Full: one arrival per warp (with its expected bytes); empty: every warp of the cluster.
    wg_ring_init(bars, S, WG_THREADS / 32, C * (WG_THREADS / 32));
    {
        // Thread tid copies row tid & 127 of matrix tid >> 7 (gate scales, gate biases, up
        // scales, up biases: 4 x 128 rows, one per thread), its gpr / 8 16-byte runs.
        static_assert(WG_THREADS == 4 * 128, "one scale or bias row per thread");
        const int m = tid >> 7, r = tid & 127, R = blockIdx.x * WG_GLU_ROWS + r;
        const u16* src = (m == 0 ? s : m == 1 ? b : m == 2 ? s2 : b2) + (size_t)(e * rows + (R < rows ? R : 0)) * gpr;
        const u32 dst = scl + (m * 128 + r) * srs;
        for (int k = 0; k < gpr >> 3; ++k) cp_async16z(dst + 16 * k, src + 8 * k, R < rows);
        cp_commit();
    }
    __syncthreads();  // slot and xrow
    // Every block's barriers initialised (fenced above) before any block's copies land in another.
    cluster_arrive_relaxed();
    cluster_wait();
    // This warp's slots are warp, warp + 16, ... (lane j < SPW: slot warp + 16 j), so the copies
    // spread over all 16 warps whatever the tile's count; this block copies those of lanes rank,
    // rank + C, ... into every block of the cluster. A 16-row tile of codes past `rows` copies
    // the expert's first (its scales are zeros).
    const int n_in = warp + 16 * lane;
    const int r_in = lane < SPW && lane % (int)C == (int)rank ? xrow[n_in] : -1;
    const unsigned short mask = (unsigned short)((1u << C) - 1u);
    const u32 wbytes = 512 + 128 * (u32)(cnt > warp ? min(SPW, (cnt - warp + 15) >> 4) : 0);
    const int fr = blockIdx.x * WG_GLU_ROWS + 16 * (warp & 7);
    const unsigned char* csrc = reinterpret_cast<const unsigned char*>(warp >= 8 ? w2 : w) +
                                (size_t)(e * rows + (fr < rows ? fr : 0)) * (size_t)(cols >> 1);
    auto issue = [&](int G, u32 st) {
        const u32 base = sm0 + st * WGM_STAGE, fb = full(st);
        if (lane == 0) mbar_arrive_expect_tx(fb, wbytes);
        __syncwarp();
        if (r_in >= 0) {
            if (C > 1) tma_load_2d_multicast(base + n_in * 128, xmap, 64 * G, r_in, fb, mask);
            else tma_load_2d(base + n_in * 128, xmap, 64 * G, r_in, fb);
        }
        if (lane == 0) bulk_load(base + N * 128 + warp * 512, csrc + G * 512, 512, fb);
    };
    const u32 sth = scl + (warp * 8 + g) * srs;
    auto read = [&](u32 st, int G, WgGroup& c) {
        const u32 fa = sm0 + st * WGM_STAGE + N * 128 + lane * 16 + (warp >> 1) * 512 + (warp & 1) * 8;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qa.x), "=r"(c.qa.y) : "r"(fa));
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(c.qb.x), "=r"(c.qb.y) : "r"(fa + 4096));
        const u32 ss = sth + 2 * G;
        c.sa = lds_bf16_pair(ss);
        c.ba = lds_bf16_pair(ss + 128 * srs);
        c.sb = lds_bf16_pair(ss + 256 * srs);
        c.bb = lds_bf16_pair(ss + 384 * srs);
    };
    auto build = [&](const WgGroup& c, u32 (&a)[4][4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) affine_a_frag(c.qa, c.qb, i, c.sa, c.ba, c.sb, c.bb, a[i]);
    };
    for (int G = 0; G < L && G < gpr; ++G) issue(G, G);
    cp_wait<0>();  // the scales
    __syncthreads();
    float acc[NW / 2];
#pragma unroll
    for (int q = 0; q < NW / 2; ++q) acc[q] = 0.f;
    // Step i's B: the slots' 128-byte rows of the group, 8-row atoms 1,024 bytes apart, k step i
    // 32 bytes into each row.
    const WgmmaDescs bdesc = wgmma_descs_sw128(1024);
    // NW = 160 (ONE): one A buffer, group G's fragments built from its codes (read in step G - 1)
    // right before its products, the copies of group G + L and the read of group G + 1's codes
    // under them; else two, group G + 1's built while group G's products run.
    constexpr bool ONE = NW > WG_N;
    u32 a0[4][4], a1[4][4];
    WgGroup c;
    mbar_wait(full(0), 0);
    read(0, 0, c);
    if constexpr (!ONE) build(c, a0);
    // Step G (stage st = G % S, phase parity ph = (G / S) & 1, carried from step to step): group
    // G's products (its stage waited for in step G - 1); the copies of group G + L into the stage
    // of group G + L - S once every warp of the cluster is done with that group; group G + 1's
    // codes read (and without ONE its A built) once its stage is in; then this warp's release of
    // group G's stage, to every block.
    u32 st = 0, ph = 0;
    auto step = [&](int G, u32 (&cur)[4][4], u32 (&nxt)[4][4]) {
        const bool wrap1 = st + 1 == S, wrapL = st + L >= S;
        const u32 st1 = wrap1 ? 0 : st + 1, ph1 = ph ^ (u32)wrap1, stL = wrapL ? st + L - S : st + L;
        const u32 st4 = (sm0 + st * WGM_STAGE) >> 4;
        if constexpr (ONE) build(c, cur);
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma_m64k16<NW>(acc, cur[i], bdesc.at(st4 + 2 * i));
        wgmma_commit();
        if (G + L < gpr) {
            if (G + L >= S) mbar_wait(empty(stL), ph ^ (u32)wrapL ^ 1u);
            issue(G + L, stL);
        }
        if (G + 1 < gpr) {
            mbar_wait(full(st1), ph1);
            read(st1, G + 1, c);
            if constexpr (!ONE) build(c, nxt);
        }
        wgmma_wait<0>();
        __syncwarp();
        if (lane < (int)C) mbar_arrive_in(empty(st), (u32)lane);
        st = st1;
        ph = ph1;
    };
    if constexpr (ONE) {
        for (int G = 0; G < gpr; ++G) step(G, a0, a0);
    } else {
        for (int G = 0; G < gpr; G += 2) {
            step(G, a0, a1);
            if (G + 1 < gpr) step(G + 1, a1, a0);
        }
    }
    // No block leaves while another may still arrive on its barriers.
    cluster_arrive();
    cluster_wait();
    wg_glu_store<NW>(acc, slot, cnt, rows, out, warp, g, t);
}
// grid (ceil(rows / WG_GLU_ROWS), tiles) in clusters along x of 1, 2 or 4 blocks, block
// WG_THREADS, dynamic shared memory moe::wgm_smem; `xmap`: the staged inputs x as a 2-D bf16
// tensor [x rows][cols], 64 x 1 boxes, 128-byte swizzle (x stays an argument, unread, so the
// launch passes the other wgmma gate|up kernels' arguments and the map).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) pf_moe_wg_glu_mc(PF_MOE_WG_ARGS, const __grid_constant__ TmaMap xmap) {
    if ((int)blockIdx.y >= tiles[0]) return;
    const int cnt = wgm_tile_slots(counts[tiles[1 + 2 * blockIdx.y]], tiles[2 + 2 * blockIdx.y]);
    if (cnt <= 0) return;
    if (cnt <= 32) pf_moe_wgc_body<32>(PF_MOE_WG_PASS, &xmap, cnt);
    else if (cnt <= 64) pf_moe_wgc_body<64>(PF_MOE_WG_PASS, &xmap, cnt);
    else if (cnt <= 96) pf_moe_wgc_body<96>(PF_MOE_WG_PASS, &xmap, cnt);
    else if (cnt <= WG_N) pf_moe_wgc_body<WG_N>(PF_MOE_WG_PASS, &xmap, cnt);
    else pf_moe_wgc_body<WGM_N>(PF_MOE_WG_PASS, &xmap, cnt);
}

// ---- down over a tile's whole K with its inputs resident ----
// pf_moe_wg_down_res: the down products of one tile over `rbs` consecutive 256-row blocks per CTA
// as one run of steps (K = cols of at most WG_RES_GROUPS groups: the 35B's 512). The tile's
// inputs are copied into shared memory once, every group, and serve every row block; only the
// rows' codes (and with each row block's first group its scales and biases) stream through a
// ring of WG_RES_STAGES stages. So the copies run ahead across row blocks instead of filling and
// draining every gpr steps, and the inputs are read from L2 once per CTA, not once per row block.
// Each row's sum runs over the groups in order whatever the row blocks per CTA: the same bits.
// Shared memory (moe::wg_res_smem): gpr input groups of WG_N slots (WG_N * 128 bytes each), the
// code ring (WG_RES_STAGES x WG_CODES), nb = (WG_RES_STAGES - 2) / gpr + 2 buffers of a row
// block's scales and biases (WG_SCALES each: a buffer is refilled only after every read of the
// row block it held), then the slot and input-row indices.
#define WG_RES_GROUPS 8
#define WG_RES_STAGES 8

// Where the copies of one step go and come from, advanced one step at a time (no divisions on the
// step path): the step's group G, its row block's scale buffer, the byte offset of the thread's
// code piece of group 0 and the element offset of its row's scales.
struct WgResCursor {
    int s, G, buf, rb;  // step, group, scale buffer, row block (local)
    u32 coff, soff;
    bool valid;
};

template <bool FRAG, int NW, int NS = WG_N, int S = WG_RES_STAGES, bool MB = false>
__device__ __forceinline__ void pf_moe_wg_down_res_body(const u32* __restrict__ w, const u16* __restrict__ s,
                                                        const u16* __restrict__ b, u16* __restrict__ y, int rows,
                                                        int cols, const u32* __restrict__ x, int xdiv,
                                                        const int* __restrict__ counts, const int* __restrict__ offsets,
                                                        const int* __restrict__ list, const int* __restrict__ tiles,
                                                        int rbs) {
    constexpr int N = NS;
    static_assert((S & (S - 1)) == 0, "the code ring's stages are a power of two (its index is a mask)");
    extern __shared__ uint4 wg_sm4[];
    unsigned char* wg_sm = reinterpret_cast<unsigned char*>(wg_sm4);
    const int gpr = cols >> 6, xwords = cols >> 1, nb = (S - 2) / gpr + 2;
    const int rb0 = blockIdx.x * rbs, nrb = min(rbs, (rows + WG_DOWN_ROWS - 1) / WG_DOWN_ROWS - rb0);
    if (nrb <= 0) return;
    const int steps = nrb * gpr;
    const int e = tiles[1 + 2 * blockIdx.y], f0 = tiles[2 + 2 * blockIdx.y];
    const int cnt = min(N, counts[e] - f0);
    const int* lst = list + offsets[e] + f0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const u32 sm0 = smem_u32(wg_sm), codes0 = sm0 + gpr * (N * 128), scales0 = codes0 + S * WG_CODES;
    int* slot = reinterpret_cast<int*>(wg_sm + (scales0 - sm0) + nb * WG_SCALES);
    int* xrow = slot + N;
    if (tid < N) {
        const int sl = tid < cnt ? lst[tid] : -1;
        slot[tid] = sl;
        xrow[tid] = sl >= 0 ? sl / xdiv : -1;
    }
    // MB: the code stages' full and empty barriers after the indices (moe::wg_res_smem).
    const u32 bars = smem_u32(xrow + N);
    auto full = [&](int st) { return bars + 8 * (st & (S - 1)); };
    auto empty = [&](int st) { return bars + 8 * (S + (st & (S - 1))); };
    // Full: every thread's copies arrive; empty: one arrival per warp.
    if constexpr (MB) wg_ring_init(bars, S, WG_THREADS, WG_THREADS / 32);
    // The copies: thread tid copies half tid & 1 of block row tid >> 1's codes of each group (32
    // bytes a row) and, with a row block's first group, that row's scales (tid & 1 == 0) or
    // biases; in fragment order (FRAG) lane tid & 31's 16 bytes of 16-row tile tid >> 5's group
    // instead. A row past `rows` reads the expert's row 0 with zero scales and biases.
    const int crow = tid >> 1, chalf = tid & 1;
    const int crow_code = FRAG ? 16 * (tid >> 5) : crow;  // the block row whose codes this thread copies
    const u32 row_bytes = (u32)cols >> 1, block_bytes = WG_DOWN_ROWS * row_bytes;
    const u32 cdst = FRAG ? codes0 + tid * 16 : codes0 + crow * 32 + chalf * 16;
    const u32 sdst = scales0 + crow * 32 + chalf * 16;
    const u16* ssrc = chalf ? b : s;
    const u32 cpiece = FRAG ? lane * 16 : chalf * 16, cstep = FRAG ? 512 : 32;
    WgResCursor c;
    c.s = 0, c.G = 0, c.buf = 0, c.rb = 0;
    {
        const int R = rb0 * WG_DOWN_ROWS + crow_code, Rs = rb0 * WG_DOWN_ROWS + crow;
        c.valid = Rs < rows;
        c.coff = (u32)(e * rows + (R < rows ? R : 0)) * row_bytes + cpiece;
        c.soff = (u32)(e * rows + (c.valid ? Rs : 0)) * (u32)gpr;
    }
    auto copy_step = [&]() {
        if (c.s < steps) {
            cp_async16(cdst + (c.s & (S - 1)) * WG_CODES, reinterpret_cast<const unsigned char*>(w) + c.coff + c.G * cstep);
            if (c.G == 0) {
                const u32 dst = sdst + c.buf * WG_SCALES;
                const u16* src = ssrc + c.soff;
                if (gpr == WG_RES_GROUPS) {
                    cp_async16z(dst, src, c.valid);
                } else {
                    u32 v[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int G0 = 2 * j;
                        const u32 lo = c.valid && G0 < gpr ? src[G0] : 0u, hi = c.valid && G0 + 1 < gpr ? src[G0 + 1] : 0u;
                        v[j] = lo | (hi << 16);
                    }
                    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
                }
            }
        }
        ++c.s;
        if (++c.G == gpr) {
            c.G = 0;
            if (++c.buf == nb) c.buf = 0;
            ++c.rb;
            const int R = (rb0 + c.rb) * WG_DOWN_ROWS + crow_code, Rs = (rb0 + c.rb) * WG_DOWN_ROWS + crow;
            c.coff = R < rows ? c.coff + block_bytes : (u32)(e * rows) * row_bytes + cpiece;
            c.valid = Rs < rows;
            c.soff = c.valid ? c.soff + WG_DOWN_ROWS * (u32)gpr : (u32)(e * rows) * (u32)gpr;
        }
    };
    // This thread's operands of one group: codes from code stage `st`, scales from buffer `sb`.
    const int ka = warp * 16 + g, kb = ka + 8;
    auto read = [&](u32 st, u32 sb, int G, WgGroup& q) {
        if constexpr (FRAG) {
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(q.qa.x), "=r"(q.qa.y), "=r"(q.qb.x), "=r"(q.qb.y)
                         : "r"(st + lane * 16 + warp * 512));
        } else {
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(q.qa.x), "=r"(q.qa.y) : "r"(st + 8 * t + ka * 32));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(q.qb.x), "=r"(q.qb.y) : "r"(st + 8 * t + kb * 32));
        }
        wg_read_scales(sb + 2 * G, ka, kb, q);
    };
    __syncthreads();  // slot and xrow
    // Every group's inputs (pf_moe_wg_body's layout, group G at G * N * 128 bytes; the first N / 8
    // warps copy).
    constexpr int WG_CP = 2, NG = N / 8;
    const int n_in = (lane & 7) + 8 * ((tid >> 5) & (NG - 1)), p_in = lane >> 3;
    const int r_in = (NG * 32 >= WG_THREADS || (tid >> 5) < NG) ? xrow[n_in] : -1;
    const u32 xoff = (u32)max(r_in, 0) * (u32)xwords + p_in * 4, xdst = sm0 + p_in * (N * 16) + n_in * 16;
    if (r_in >= 0)
        for (int G = 0; G < gpr; ++G)
#pragma unroll
            for (int k = 0; k < WG_CP; ++k) cp_async16(xdst + G * (N * 128) + k * 4 * (N * 16), x + xoff + G * 32 + k * 16);
    float acc[NW / 2];
    auto build = [&](const WgGroup& q, u32 (&a)[4][4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) affine_a_frag(q.qa, q.qb, i, q.sa, q.ba, q.sb, q.bb, a[i]);
    };
    // The step being multiplied: group G of local row block rb, its scales in buffer buf.
    int G = 0, rb = 0, buf = 0;
    // After a row block's last group: its outputs, then its accumulators cleared for the next
    // row block. Rows in pairs, one 4-byte store per lane: lane g (even) stores rows R, R + 1 (its
    // own row and its neighbour g + 1's, lane + 4), lane g + 1 rows R + 7, R + 8 (the
    // neighbour's R + 8 and its own). rows is even, so a pair is whole or past the end.
    auto store_block = [&]() {
#pragma unroll
        for (int q = 0; q < NW / 2; ++q) wgmma_keep(acc[q]);
        const int R = (rb0 + rb) * WG_DOWN_ROWS + warp * 16 + g;
        const bool lo = (g & 1) == 0;
        const int r0 = lo ? R : R + 7;
        const int cnt_ok = r0 < rows ? cnt : 0;  // columns this lane stores: none past the last row
#pragma unroll
        for (int j = 0; j < NW / 8; ++j) {
            const int2 sl = *reinterpret_cast<const int2*>(slot + 8 * j + 2 * t);  // columns 8j + 2t, + 1
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const float va = acc[4 * j + q], vb = acc[4 * j + 2 + q];
                // Each lane sends what its neighbour stores: lane g's row R + 8 (vb) to lane g + 1,
                // lane g + 1's row R + 1 (va) to lane g. One shuffle, not one per row.
                const float nb_val = __shfl_xor_sync(0xffffffffu, lo ? vb : va, 4);
                const int n = 8 * j + 2 * t + q;
                // A 32-bit element offset: moe::wg_outputs_fit bounds the outputs below 2^32.
                const u32 off = (u32)(q ? sl.y : sl.x) * (u32)rows + (u32)r0;
                st_global_u32_if(y + off, lo ? pack_bf16(va, nb_val) : pack_bf16(nb_val, vb), n < cnt_ok);
            }
        }
#pragma unroll
        for (int q = 0; q < NW / 2; ++q) acc[q] = 0.f;
        G = 0;
        ++rb;
        buf = buf + 1 == nb ? 0 : buf + 1;
    };
    // Commits (one per step, some empty, so the count is uniform). Wide: P0 = the inputs, step 0's
    // and step 1's copies; P1 .. P(S-2) = step j + 1's; step s: step s + S's. Step s waits for all
    // but the S - 2 latest (everything up to step s - S + 1's: the codes of step s + 1 and, copied
    // with its row block's first codes, its scales), then the barrier: every thread is done with
    // step s - 1, whose code stage takes step s + S's. Narrow (one A buffer, built in the step
    // that multiplies it): each copy S - 1 steps ahead. P0 = the inputs and step 0's copies;
    // P1 .. P(S-2) = step j's; step s: step s + S - 1's, into the code stage of step s - 1, which
    // every thread read before step s's barrier; step s waits for all but the S - 2 latest
    // commits: its own copies.
    constexpr bool NARROW = NS < WG_N;
    // Group G's step i reads the resident inputs at G * N * 128 + i * 2 * (N * 16) bytes (layout as
    // pf_moe_wg_body's stages).
    const WgmmaDescs bdesc(N * 16, 128);
    const u32 sm4 = sm0 >> 4;
    // MB: the code stages handed over by mbarriers instead of a block barrier per step: each
    // thread's copies of a step arrive on its stage's full barrier as they land (the first step's
    // after the inputs, so its barrier covers them too); each warp arrives on the stage's empty
    // barrier once it has read the codes; the copies of step s + L wait for every warp's read of
    // step s + L - S. The warps drift apart by up to S - L - 1 steps (the scale buffers' count nb
    // allows that: a buffer's refill still follows its last read).
    static_assert(!(MB && NARROW), "the narrow kernels keep the block barrier");
    constexpr int L = S - 3;
    if constexpr (MB) {
        for (int j = 0; j < L; ++j) {
            const int s0 = c.s;
            copy_step();
            if (s0 < steps) cp_async_arrive_noinc(full(s0));
        }
    } else {
        copy_step();
        if constexpr (!NARROW) copy_step();
        cp_commit();
#pragma unroll
        for (int j = 1; j < S - 1; ++j) {
            copy_step();
            cp_commit();
        }
    }
#pragma unroll
    for (int q = 0; q < NW / 2; ++q) acc[q] = 0.f;
    if constexpr (NARROW) {
        for (int st = 0; st < steps; ++st) {
            cp_wait<S - 2>();
            fence_proxy_async_smem();
            __syncthreads();
            u32 a[4][4];
            {
                WgGroup q;
                read(codes0 + (st & (S - 1)) * WG_CODES, scales0 + buf * WG_SCALES, G, q);
                build(q, a);
            }
            wgmma_fence();
#pragma unroll
            for (int i = 0; i < 4; ++i) wgmma_m64k16<NW>(acc, a[i], bdesc.at(sm4 + G * (N * 8) + i * 2 * N));
            wgmma_commit();
            copy_step();
            cp_commit();
            wgmma_wait<0>();
            if (G + 1 == gpr) store_block();
            else ++G;
        }
        return;
    }
    u32 a0[4][4], a1[4][4];
    if constexpr (MB) {
        mbar_wait(full(0), 0);
        fence_proxy_async_smem();  // the resident inputs, for this thread's wgmmas
    } else {
        cp_wait<S - 2>();
        __syncthreads();
    }
    {
        WgGroup q;
        read(codes0, scales0, 0, q);
        build(q, a0);
    }
    if constexpr (MB) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(0));
    }
    auto step = [&](int st, const u32 (&cur)[4][4], u32 (&nxt)[4][4]) {
        if constexpr (!MB) {
            cp_wait<S - 2>();
            fence_proxy_async_smem();
            __syncthreads();
        }
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma_m64k16<NW>(acc, cur[i], bdesc.at(sm4 + G * (N * 8) + i * 2 * N));
        wgmma_commit();
        if constexpr (MB) {
            if (c.s < steps) {  // c.s == st + L
                const int done = c.s - S;
                if (done >= 0) mbar_wait(empty(done), (u32)(done / S) & 1u);
                const int s0 = c.s;
                copy_step();
                cp_async_arrive_noinc(full(s0));
            }
        } else {
            copy_step();
            cp_commit();
        }
        const bool last = G + 1 == gpr;
        if (st + 1 < steps) {
            const int nbuf = last ? (buf + 1 == nb ? 0 : buf + 1) : buf;
            if constexpr (MB) mbar_wait(full(st + 1), (u32)((st + 1) / S) & 1u);
            WgGroup q;
            read(codes0 + ((st + 1) & (S - 1)) * WG_CODES, scales0 + nbuf * WG_SCALES, last ? 0 : G + 1, q);
            if constexpr (MB) {
                __syncwarp();
                if (lane == 0) mbar_arrive(empty(st + 1));
            }
            build(q, nxt);
        }
        wgmma_wait<0>();
        if (last) store_block();
        else ++G;
    };
    for (int st = 0; st < steps; st += 2) {
        step(st, a0, a1);
        if (st + 1 < steps) step(st + 1, a1, a0);
    }
}

// Codes in fragment order (FRAG) take the mbarrier-handed ring (MB); row order the block barrier.
template <bool FRAG>
__device__ __forceinline__ void pf_moe_wg_down_res_tile(PF_MOE_WG_ARGS, int rbs) {
    u16* y = reinterpret_cast<u16*>(out);
    constexpr int S = WG_RES_STAGES;
    WG_AT_TILE_WIDTH(pf_moe_wg_down_res_body<FRAG, NW, WG_N, S, FRAG>(w, s, b, y, rows, cols, x, xdiv, counts, offsets, list, tiles, rbs))
}
// Down with resident inputs into y (bf16 [slot][rows], as pf_moe_wg_down): grid
// (ceil(rows / (rbs * WG_DOWN_ROWS)), tiles), block WG_THREADS, dynamic shared memory
// moe::wg_res_smem(cols); cols at most WG_RES_GROUPS * 64. w2, s2, b2 unused.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) pf_moe_wg_down_res(PF_MOE_WG_ARGS, int rbs) {
    pf_moe_wg_down_res_tile<false>(PF_MOE_WG_PASS, rbs);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) pf_moe_wg_down_res_f(PF_MOE_WG_ARGS, int rbs) {
    pf_moe_wg_down_res_tile<true>(PF_MOE_WG_PASS, rbs);
}
// Narrow (pf_moe_wg_glu_n's tiles): WG_NARROW_RES_STAGES code stages, two CTAs per SM; shared
// memory moe::wg_res_smem(cols, WG_NARROW, WG_NARROW_RES_STAGES).
#define WG_NARROW_RES_STAGES 4
extern "C" __global__ void __launch_bounds__(WG_THREADS, 2) pf_moe_wg_down_res_n(PF_MOE_WG_ARGS, int rbs) {
    if ((int)blockIdx.y >= tiles[0]) return;
    pf_moe_wg_down_res_body<false, WG_NARROW, WG_NARROW, WG_NARROW_RES_STAGES>(w, s, b, reinterpret_cast<u16*>(out), rows, cols, x, xdiv,
                                                                          counts, offsets, list, tiles, rbs);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 2) pf_moe_wg_down_res_n_f(PF_MOE_WG_ARGS, int rbs) {
    if ((int)blockIdx.y >= tiles[0]) return;
    pf_moe_wg_down_res_body<true, WG_NARROW, WG_NARROW, WG_NARROW_RES_STAGES>(w, s, b, reinterpret_cast<u16*>(out), rows, cols, x, xdiv,
                                                                         counts, offsets, list, tiles, rbs);
}

// Block-wide exclusive prefix sums of two per-thread values (counts and tile counts): a warp scan
// by shuffles, then the earlier warps' totals from `wa` / `wb` (one entry per warp, shared). Ends
// with the block synchronised.
__device__ __forceinline__ void block_excl_scan2(int a, int b, int* wa, int* wb, int& ea, int& eb) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int ia = a, ib = b;  // inclusive over the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, ia, o), y = __shfl_up_sync(0xffffffffu, ib, o);
        if (lane >= o) { ia += x; ib += y; }
    }
    if (lane == 31) { wa[warp] = ia; wb[warp] = ib; }
    __syncthreads();
    ea = ia - a;
    eb = ib - b;
    for (int w = 0; w < warp; ++w) { ea += wa[w]; eb += wb[w]; }
}

// The routing of a batched decode step in one launch: the f32 router logits (rows 0..E-1) and
// the shared-expert gate logit (row E) of the n staged-normalised tokens u, then, in the last
// block to finish of each RB_TOK-token group (the top-k of its tokens) and the last of those
// (the rest), what pf_route + pf_scan + pf_scatter produce: top-k ids and weights per token
// (warp_route_topk, so the same picks as every other path), per-expert counts, offsets, fill
// cursors, tensor-core tiles and slot lists, with the shared expert as one more expert if asked
// (so moe_tcb runs it beside the routed ones). Codes are dequantised (s * q + b, 4- or 8-bit,
// groups of a multiple of 8 columns) and multiplied by the f32 inputs as the CPU does, summed in
// another order. grid (ceil((E + 1) / RB_ROWS), ceil(n / RB_TOK)), block RB_THREADS; each thread
// owns 8-column chunks of H for the block's RB_ROWS rows and RB_TOK tokens, read straight from
// global memory (every block reads all of u; it is L2-resident). Tiles are TCB_TOK slots (one
// moe_tcb pass each). `done` counts finished blocks and groups, then holds the groups' summed
// counts (RB_DONE words, then E); the blocks that use them reset them, so the kernel replays in
// a graph. Dynamic shared memory: route_batch_smem (moe.rs). Instances of 1 and 4
// router rows per block (moe_route_batch_1 / _4): few tokens spread the router over more blocks
// (moe.rs route_rows_per_block).
#define RB_TOK 16
#define RB_THREADS 256
#define RB_DONE 16  // counters of `done` before its count scratch (moe.rs ROUTE_DONE_WORDS)

__device__ __forceinline__ void rb_dequant8(const u32* __restrict__ w, const u16* __restrict__ s,
                                            const u16* __restrict__ b, int bits, int H, int group, int row,
                                            int ch, float (&v)[8]) {
    const int g = ch * 8 / group, gpr = H / group;
    const float sc = bf16f(__ldg(s + (size_t)row * gpr + g)), bi = bf16f(__ldg(b + (size_t)row * gpr + g));
    if (bits == 4) {
        const u32 q = __ldg(w + (size_t)row * (H / 8) + ch);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = fmaf(sc, (float)((q >> (4 * k)) & 15u), bi);
    } else {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(w + (size_t)row * (H / 4)) + ch);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = fmaf(sc, (float)(((k < 4 ? q.x : q.y) >> (8 * (k & 3))) & 255u), bi);
    }
}

template <int RB_ROWS>
__device__ __forceinline__ void
moe_route_batch(const float* __restrict__ u, int n, int H, int group, const u32* __restrict__ rw,
                const u16* __restrict__ rs, const u16* __restrict__ rbias, int rbits, const u32* __restrict__ gw,
                const u16* __restrict__ gs, const u16* __restrict__ gbias, int gbits, int E, int K,
                float* __restrict__ logits, float* __restrict__ sgl, int* __restrict__ top_ids,
                float* __restrict__ top_w, int* __restrict__ counts, int* __restrict__ offsets,
                int* __restrict__ fill, int* __restrict__ list, int* __restrict__ tiles, int with_shared,
                unsigned* __restrict__ done) {
    extern __shared__ float rb_sm[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = RB_THREADS / 32;
    const int r0 = blockIdx.x * RB_ROWS, nr = min(RB_ROWS, E + 1 - r0);
    const int c0 = blockIdx.y * RB_TOK, nt = min(RB_TOK, n - c0);
    float acc[RB_ROWS][RB_TOK];
#pragma unroll
    for (int i = 0; i < RB_ROWS; ++i)
#pragma unroll
        for (int j = 0; j < RB_TOK; ++j) acc[i][j] = 0.f;
    float wv[RB_ROWS][8];
    auto dequant = [&](int ch) {
#pragma unroll
        for (int i = 0; i < RB_ROWS; ++i) {
            const int r = r0 + i;
            if (i < nr) {
                if (r < E) rb_dequant8(rw, rs, rbias, rbits, H, group, r, ch, wv[i]);
                else rb_dequant8(gw, gs, gbias, gbits, H, group, 0, ch, wv[i]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) wv[i][k] = 0.f;
            }
        }
    };
    // The block's first router columns before the PDL wait: they do not depend on the step.
    if (tid < H / 8) dequant(tid);
    pdl_wait_trigger();
    for (int ch = tid; ch < H / 8; ch += RB_THREADS) {
        if (ch != tid) dequant(ch);
#pragma unroll
        for (int j = 0; j < RB_TOK; ++j) {
            if (j < nt) {
                const float4* xp = reinterpret_cast<const float4*>(u + (size_t)(c0 + j) * H + ch * 8);
                const float4 a = xp[0], b = xp[1];
                const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < RB_ROWS; ++i)
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[i][j] = fmaf(wv[i][k], x[k], acc[i][j]);
            }
        }
    }
    // Block sums: per warp by shuffles (warp_sum's bits, scattered over the lanes), then across
    // the warps in shared memory.
    constexpr int NV = RB_ROWS * RB_TOK, PER = NV >= 32 ? NV / 32 : 1;
    float* red = rb_sm;  // [nwarps][NV]
    {
        float v[NV];
#pragma unroll
        for (int i = 0; i < RB_ROWS; ++i)
#pragma unroll
            for (int j = 0; j < RB_TOK; ++j) v[i * RB_TOK + j] = acc[i][j];
        const int base = warp_sum_scatter<NV>(v);
        if (NV >= 32 || (lane & (32 / NV - 1)) == 0)
#pragma unroll
            for (int k = 0; k < PER; ++k) red[warp * NV + base + k] = v[k];
    }
    __syncthreads();
    if (tid < NV) {
        const int i = tid / RB_TOK, j = tid % RB_TOK;
        float v = 0.f;
        for (int w = 0; w < nwarps; ++w) v += red[w * NV + tid];
        if (i < nr && j < nt) {
            const int r = r0 + i;
            if (r < E) logits[(size_t)(c0 + j) * E + r] = v;
            else sgl[c0 + j] = v;
        }
    }
    // The last block of each token group routes the group's tokens (top-k, counts); with several
    // groups their counts meet in `gcounts` and the last group's block finishes the lists, so the
    // top-k of a big batch runs in one block per RB_TOK tokens, not in one block for all of them.
    // done[0]: groups finished; done[1 + y]: blocks of group y finished; both left at zero, as
    // is gcounts.
    // The tickets: the barrier orders the block's writes before thread 0's fence, whose release
    // (cumulative) puts them before the ticket; the last block's fence after its ticket acquires
    // every other block's, and its barrier passes that on to the block's reads (as a grid sync
    // does). One acq_rel fence in one thread, not a sequentially consistent one in every thread.
    unsigned* gdone = done;
    int* gcounts = reinterpret_cast<int*>(done + RB_DONE);
    __syncthreads();
    __shared__ int last;
    if (tid == 0) {
        fence_acq_rel_gpu();
        last = atomicAdd(&gdone[1 + blockIdx.y], 1u) == gridDim.x - 1;
        if (last) {
            gdone[1 + blockIdx.y] = 0u;
            fence_acq_rel_gpu();
        }
    }
    __syncthreads();
    if (!last) return;
    float* lg = rb_sm;                                         // [nt][E] the group's logits
    int* cnt = reinterpret_cast<int*>(rb_sm + min(RB_TOK, n) * E);  // [E] counts, then fill cursors
    int* off = cnt + E;                                        // [E]
    int* ids = off + E;                                        // [n * K] every slot's expert
    float* wts = reinterpret_cast<float*>(ids + n * K);        // [nwarps][2][K] two tokens' weights per warp
    int* wid = reinterpret_cast<int*>(wts + 2 * nwarps * K);   // [nwarps][2][K]
    for (int e = tid; e < E; e += RB_THREADS) cnt[e] = 0;
    // All loads in flight at once (L2, written by the other blocks), not one token's per warp.
    for (int i = tid; i < nt * E; i += RB_THREADS) lg[i] = __ldcg(logits + (size_t)c0 * E + i);
    __syncthreads();
    // Tokens t and t + nwarps on warp t (RB_TOK = 2 * nwarps): their top-k's dependent
    // reductions interleave.
    for (int t = warp; t < nt; t += 2 * nwarps) {
        const int two = t + nwarps < nt ? 2 : 1;
        int* wi = wid + warp * 2 * K;
        float* ww = wts + warp * 2 * K;
        warp_route_topk_n<2>(lg + (size_t)t * E, nwarps * E, two, E, K, wi, ww);
        for (int u = 0; u < two; ++u)
            if (lane < K) {
                const int id = wi[u * K + lane], sl = (c0 + t + u * nwarps) * K + lane;
                top_ids[sl] = id;
                top_w[sl] = ww[u * K + lane];
                ids[sl] = id;
                atomicAdd(&cnt[id], 1);
            }
        __syncwarp();
    }
    __syncthreads();
    if (gridDim.y > 1) {
        for (int e = tid; e < E; e += RB_THREADS)
            if (cnt[e]) atomicAdd(&gcounts[e], cnt[e]);
        __syncthreads();
        if (tid == 0) {
            fence_acq_rel_gpu();
            last = atomicAdd(&gdone[0], 1u) == gridDim.y - 1;
            if (last) {
                gdone[0] = 0u;
                fence_acq_rel_gpu();
            }
        }
        __syncthreads();
        if (!last) return;
        for (int e = tid; e < E; e += RB_THREADS) {
            cnt[e] = __ldcg(gcounts + e);
            gcounts[e] = 0;
        }
        for (int sl = tid; sl < n * K; sl += RB_THREADS) ids[sl] = __ldcg(top_ids + sl);
        __syncthreads();
    }
    // Exclusive scans of the counts and of the tiles (TCB_TOK slots each: a tile is one pass of
    // moe_tcb, so an expert with many slots is spread over blocks instead of looping in one) in
    // expert order: thread i takes experts 2i and 2i + 1 (E + with_shared <= 2 * RB_THREADS).
    // With `with_shared` the shared expert is expert E, every token once, in slots n * K + t; its
    // tiles (full ones, where most routed experts have a slot or two) are listed first, so the
    // expert kernels' heaviest blocks start in the first wave instead of ending the last.
    const int EA = E + with_shared, ts = with_shared ? (n + TCB_TOK - 1) / TCB_TOK : 0;
    {
        __shared__ int wc[RB_THREADS / 32], wt[RB_THREADS / 32];
        int c[2], tl[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int e = 2 * tid + q;
            c[q] = e < E ? cnt[e] : e < EA ? n : 0;
            tl[q] = (c[q] + TCB_TOK - 1) / TCB_TOK;
        }
        int oc, ot;
        block_excl_scan2(c[0] + c[1], tl[0] + tl[1], wc, wt, oc, ot);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int e = 2 * tid + q;
            if (e < EA) {
                if (e < E) off[e] = oc;
                counts[e] = c[q];
                offsets[e] = oc;
                fill[e] = c[q];
                for (int k = 0; k < tl[q]; ++k, ++ot) {
                    const int at = e < E ? ts + ot : k;
                    tiles[1 + 2 * at] = e;
                    tiles[2 + 2 * at] = k * TCB_TOK;
                }
                oc += c[q];
            }
        }
        if (tid == RB_THREADS - 1) tiles[0] = ot;
        __syncthreads();
        for (int e = tid; e < E; e += RB_THREADS) cnt[e] = 0;
        __syncthreads();
    }
    for (int sl = tid; sl < n * K; sl += RB_THREADS) {
        const int e = ids[sl];
        list[off[e] + atomicAdd(&cnt[e], 1)] = sl;
    }
    if (with_shared)
        for (int t = tid; t < n; t += RB_THREADS) list[n * K + t] = n * K + t;
}

#define MOE_ROUTE_BATCH(R)                                                                                        \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) moe_route_batch_##R(                                \
        const float* u, int n, int H, int group, const u32* rw, const u16* rs, const u16* rbias, int rbits,       \
        const u32* gw, const u16* gs, const u16* gbias, int gbits, int E, int K, float* logits, float* sgl,       \
        int* top_ids, float* top_w, int* counts, int* offsets, int* fill, int* list, int* tiles, int with_shared, \
        unsigned* done) {                                                                                         \
        moe_route_batch<R>(u, n, H, group, rw, rs, rbias, rbits, gw, gs, gbias, gbits, E, K, logits, sgl,         \
                           top_ids, top_w, counts, offsets, fill, list, tiles, with_shared, done);                \
    }
MOE_ROUTE_BATCH(1)
MOE_ROUTE_BATCH(4)
// moe_route_batch at the 35B's router shapes (hidden 2,048 in groups of 64, 8-bit router and
// shared-expert gate rows, 256 experts, top 8, the shared expert listed) as compile-time
// constants: the dequantisation keeps only its 8-bit path, the index arithmetic folds and the
// top-k's loops over the experts have known trip counts. The same operations on the same values
// as moe_route_batch; the host launches these only at those shapes (the shape arguments are not
// read).
#define MOE_ROUTE_BATCH_35B(R)                                                                                     \
    extern "C" __global__ void __launch_bounds__(RB_THREADS) moe_route_batch_##R##_35b(                            \
        const float* u, int n, int H, int group, const u32* rw, const u16* rs, const u16* rbias, int rbits,       \
        const u32* gw, const u16* gs, const u16* gbias, int gbits, int E, int K, float* logits, float* sgl,       \
        int* top_ids, float* top_w, int* counts, int* offsets, int* fill, int* list, int* tiles, int with_shared, \
        unsigned* done) {                                                                                         \
        moe_route_batch<R>(u, n, 2048, 64, rw, rs, rbias, 8, gw, gs, gbias, 8, 256, 8, logits, sgl, top_ids,      \
                           top_w, counts, offsets, fill, list, tiles, 1, done);                                   \
    }
MOE_ROUTE_BATCH_35B(1)
MOE_ROUTE_BATCH_35B(4)

// ============================== prefill (T tokens) ==============================
// Activations are token-major f32 [T][dim] (docs/cuda-prefill.md, src/backend/cuda/prefill.rs).

// Routing: one warp per token: softmax top-k (ties -> lower id), renormalised weights, sorted by
// expert id (the CPU accumulates experts in ascending id order); pf_scan counts them.
// grid (ceil(T/4)), block 128. E <= 512, K <= 16.
extern "C" __global__ void pf_route(const float* __restrict__ logits, int T, int E, int K, int* __restrict__ top_ids,
                                    float* __restrict__ top_w) {
    __shared__ int sids[4][MOE_MAXK];
    __shared__ float swts[4][MOE_MAXK];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    if (t >= T) return;
    int* ids = sids[warp];
    float* wts = swts[warp];
    warp_route_topk(logits + (size_t)t * E, E, K, ids, wts);
    if (lane < K) {
        top_ids[(size_t)t * K + lane] = ids[lane];
        top_w[(size_t)t * K + lane] = wts[lane];
    }
}

// The per-expert counts of TK top-k slots (shared-memory counters: every token's K picks
// counted in one block, not by TK global atomics on E counters), their exclusive scan and that of
// their tile counts (E <= 512, one thread per expert: warp scans, then the warp totals); zeroes
// `fill`. When `tiles` is set it also lists the (expert, first token) tiles of `tile` tokens in
// expert order (64 for the grouped GEMMs, 16 for moe_tcb's passes): tiles[0] = count. block 512.
extern "C" __global__ void __launch_bounds__(512) pf_scan(const int* __restrict__ top_ids, int TK, int* __restrict__ counts,
                                                          int E, int* __restrict__ offsets, int* __restrict__ fill,
                                                          int* __restrict__ tiles, int tile) {
    __shared__ int wc[16], wt[16], hist[512];
    const int e = threadIdx.x;
    hist[e] = 0;
    __syncthreads();
    // Four independent loads in flight per thread between the shared-memory increments.
    int i = e;
    for (; i + 3 * 512 < TK; i += 4 * 512) {
        int id[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) id[u] = top_ids[i + u * 512];
#pragma unroll
        for (int u = 0; u < 4; ++u) atomicAdd(&hist[id[u]], 1);
    }
    for (; i < TK; i += 512) atomicAdd(&hist[top_ids[i]], 1);
    __syncthreads();
    const int c = e < E ? hist[e] : 0;
    const int nt = tiles ? (c + tile - 1) / tile : 0;
    int oc, ot;
    block_excl_scan2(c, nt, wc, wt, oc, ot);
    if (e < E) {
        counts[e] = c;
        offsets[e] = oc;
        fill[e] = 0;
        for (int k = 0, t = ot; k < nt; ++k, ++t) {
            tiles[1 + 2 * t] = e;
            tiles[2 + 2 * t] = k * tile;
        }
    }
    if (tiles && e == (int)blockDim.x - 1) tiles[0] = ot + nt;
}

// Per-expert slot lists (order inside an expert is arbitrary; every slot's result is computed
// on its own, so the output does not depend on it). A block takes SCATTER_SLOTS consecutive
// slots: their places within their experts' runs come from shared-memory counters, and each
// expert present reserves its run with one global atomic per block, not one per slot (at 4K
// tokens an expert's ~128 slots waited on one address in turn). grid ceil(TK / SCATTER_SLOTS),
// block SCATTER_THREADS; E <= SCATTER_MAX_EXPERTS.
#define SCATTER_THREADS 1024
#define SCATTER_MAX_EXPERTS 512
#define SCATTER_PER_THREAD 4
#define SCATTER_SLOTS (SCATTER_THREADS * SCATTER_PER_THREAD)
extern "C" __global__ void __launch_bounds__(SCATTER_THREADS) pf_scatter(const int* __restrict__ top_ids, int TK,
                                                                        const int* __restrict__ offsets,
                                                                        int* __restrict__ fill, int* __restrict__ list,
                                                                        int E) {
    __shared__ int cnt[SCATTER_MAX_EXPERTS], base[SCATTER_MAX_EXPERTS];
    const int tid = threadIdx.x, s0 = blockIdx.x * SCATTER_SLOTS + tid;
    for (int e = tid; e < E; e += SCATTER_THREADS) cnt[e] = 0;
    __syncthreads();
    int ids[SCATTER_PER_THREAD], place[SCATTER_PER_THREAD];
#pragma unroll
    for (int i = 0; i < SCATTER_PER_THREAD; ++i) ids[i] = s0 + i * SCATTER_THREADS < TK ? top_ids[s0 + i * SCATTER_THREADS] : -1;
#pragma unroll
    for (int i = 0; i < SCATTER_PER_THREAD; ++i) place[i] = ids[i] >= 0 ? atomicAdd(&cnt[ids[i]], 1) : 0;
    __syncthreads();
    for (int e = tid; e < E; e += SCATTER_THREADS) base[e] = cnt[e] ? offsets[e] + atomicAdd(&fill[e], cnt[e]) : 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < SCATTER_PER_THREAD; ++i)
        if (ids[i] >= 0) list[base[ids[i]] + place[i]] = s0 + i * SCATTER_THREADS;
}

// pf_moe_combine over bf16 routed outputs D (the wgmma down kernel's): two columns per thread,
// each summed in moe_combined's order. grid (ceil(h / 512), T), block 256; h even. The shared
// expert's outputs SH f32, or bf16 (`_sh16`).
template <typename ST>
__device__ __forceinline__ void moe_combine_bf16(const u32* __restrict__ D, const float* __restrict__ top_w, int K,
                                                 const ST* __restrict__ SH, const float* __restrict__ sgl,
                                                 float* __restrict__ x, int h) {
    const int t = blockIdx.y, c = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= h) return;
    float a0 = 0.f, a1 = 0.f;
    for (int k = 0; k < K; ++k) {
        const float w = top_w[(size_t)t * K + k];
        const u32 d = D[(((size_t)t * K + k) * h + c) >> 1];
        a0 += w * __uint_as_float(d << 16);
        a1 += w * __uint_as_float(d & 0xffff0000u);
    }
    const float g = sigmoid_f(sgl[t]);
    const float2 sh = act_ld2(SH + (size_t)t * h + c);
    a0 += g * sh.x;
    a1 += g * sh.y;
    x[(size_t)t * h + c] += a0;
    x[(size_t)t * h + c + 1] += a1;
}
extern "C" __global__ void pf_moe_combine_bf16(const u32* __restrict__ D, const float* __restrict__ top_w, int K,
                                               const float* __restrict__ SH, const float* __restrict__ sgl,
                                               float* __restrict__ x, int h) {
    moe_combine_bf16(D, top_w, K, SH, sgl, x, h);
}
extern "C" __global__ void pf_moe_combine_bf16_sh16(const u32* __restrict__ D, const float* __restrict__ top_w, int K,
                                                    const u16* __restrict__ SH, const float* __restrict__ sgl,
                                                    float* __restrict__ x, int h) {
    moe_combine_bf16(D, top_w, K, SH, sgl, x, h);
}
// pf_moe_combine_bf16 of row t fused with the next layer's input norm (pf_rmsnorm of the updated
// row, its bf16 staging included): one block per row, thread i the float4s c = i, i + NORM_THREADS,
// ... of it (common.cuh). Each column's sum is pf_moe_combine_bf16's (the K products in order,
// then the shared expert's, then added into x) and the norm's pf_rmsnorm's, on the same values in
// the same order, so x, out and staged come out bit for bit as the two launches wrote them.
// grid (T), block NORM_THREADS; h a multiple of 4, at most NORM_THREADS * 4 * NORM_V. SH f32, or
// bf16 (`_sh16`).
template <typename ST>
__device__ __forceinline__ void moe_combine_norm_bf16(const uint2* __restrict__ D, const float* __restrict__ top_w, int K,
                                                      const ST* __restrict__ SH, const float* __restrict__ sgl,
                                                      float4* __restrict__ x, const float4* __restrict__ gain,
                                                      float4* __restrict__ out, uint2* __restrict__ staged, int rows,
                                                      int h, float eps) {
    __shared__ float red[33];
    const int t = blockIdx.x, tid = threadIdx.x, n4 = h / 4;
    const float g = sigmoid_f(sgl[t]);
    float4 v[NORM_V];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_V; ++i) {
        const int c = tid + NORM_THREADS * i;
        v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < n4) {
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            // Unrolled so that several experts' loads are in flight at once (the sums stay in order).
#pragma unroll 4
            for (int k = 0; k < K; ++k) {
                const float w = top_w[(size_t)t * K + k];
                const uint2 d = D[((size_t)t * K + k) * n4 + c];
                a0 += w * __uint_as_float(d.x << 16);
                a1 += w * __uint_as_float(d.x & 0xffff0000u);
                a2 += w * __uint_as_float(d.y << 16);
                a3 += w * __uint_as_float(d.y & 0xffff0000u);
            }
            const float4 s = act_ld4(SH + ((size_t)t * n4 + c) * 4);
            a0 += g * s.x;
            a1 += g * s.y;
            a2 += g * s.z;
            a3 += g * s.w;
            float4 xv = x[(size_t)t * n4 + c];
            xv.x += a0;
            xv.y += a1;
            xv.z += a2;
            xv.w += a3;
            x[(size_t)t * n4 + c] = xv;
            v[i] = xv;
        }
        ss += sq4(v[i]);
    }
    const float inv = inv_rms_from(block_sum(ss, red), h, eps);
#pragma unroll
    for (int i = 0; i < NORM_V; ++i) {
        const int c = tid + NORM_THREADS * i;
        if (c >= n4) break;
        const float4 o = norm4(v[i], inv, gain[c]);
        out[(size_t)t * n4 + c] = o;
        if (staged) staged[(size_t)t * n4 + c] = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
    }
}
#define PF_MOE_COMBINE_NORM_BF16(NAME, ST)                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                                    \
    NAME(const uint2* __restrict__ D, const float* __restrict__ top_w, int K, const ST* __restrict__ SH,           \
         const float* __restrict__ sgl, float4* __restrict__ x, const float4* __restrict__ gain,                  \
         float4* __restrict__ out, uint2* __restrict__ staged, int rows, int h, float eps) {                      \
        moe_combine_norm_bf16(D, top_w, K, SH, sgl, x, gain, out, staged, rows, h, eps);                           \
    }
PF_MOE_COMBINE_NORM_BF16(pf_moe_combine_norm_bf16, float)
PF_MOE_COMBINE_NORM_BF16(pf_moe_combine_norm_bf16_sh16, u16)
// x[t] += sum_k w[t,k] * D[t*K + k] + sigmoid(sgl[t]) * SH[t]. grid (ceil(h/256), T).
extern "C" __global__ void pf_moe_combine(const float* __restrict__ D, const float* __restrict__ top_w, int K,
                                          const float* __restrict__ SH, const float* __restrict__ sgl,
                                          float* __restrict__ x, int h) {
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= h) return;
    x[(size_t)t * h + c] += moe_combined(D, top_w, K, SH, sgl, h, t, c);
}
