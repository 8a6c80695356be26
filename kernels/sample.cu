// Token choice on the device.
//   decode (T = 1): argmax_next (greedy), sample_prep + sample_select + sample_draw (sampling)
// Every kernel takes a batch of rows along blockIdx.y (batched decode): row r reads logits row r
// and writes step buffer r ([token, position] pairs back to back), each with its own parameters
// and scratch; one row (grid.y = 1) is the single-sequence decode.

// (value desc, index asc) maximum over the warp; NaN never wins.
__device__ __forceinline__ void argmax_warp(float& best, int& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
}

// Whether this block is the last of the grid to take a ticket (after its partials are written
// and fenced); its threads then see every block's partials.
__device__ __forceinline__ bool last_block(u32* ticket) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The block's (value desc, index asc) maximum of every thread's candidate: thread 0 (lane 0 of
// warp 0) gets it.
__device__ __forceinline__ void sample_block_argmax(float& best, int& idx) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    argmax_warp(best, idx);
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        argmax_warp(best, idx);
    }
}

// The grid's (value desc, index asc) maximum of every thread's candidate: true in one thread
// (lane 0 of warp 0 of the last block to finish), which then holds it in best / idx; the ticket
// is zero again. part: 2 x gridDim.x words.
__device__ __forceinline__ bool argmax_grid(float& best, int& idx, float* part, u32* ticket) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    sample_block_argmax(best, idx);
    if (warp == 0 && lane == 0) {
        part[2 * blockIdx.x] = best;
        part[2 * blockIdx.x + 1] = __int_as_float(idx);
    }
    if (!last_block(ticket) || warp != 0) return false;
    best = NEG_INF;
    idx = 0x7fffffff;
    for (int b = lane; b < (int)gridDim.x; b += 32) {
        const float v = __ldcg(part + 2 * b);
        const int i = __float_as_int(__ldcg(part + 2 * b + 1));
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    argmax_warp(best, idx);
    if (lane != 0) return false;
    *ticket = 0u;
    return true;
}

// Greedy sampling on the device: argmax over the logits (ties -> lowest id, like
// engine::sampling::argmax), written into the step buffer as the next token together with the
// next position, so a decode loop can run without the host reading anything.
// 64 blocks of 1024 threads, a slice each, the last to finish merging; the vocabulary (248,320)
// is read once from L2 (just written).
//
// n <= 0 is not an argmax: the block spins for -n microseconds and returns (the profiler holds
// the stream with it so the host can queue a whole step first; no extra entry point needed).
#define ARGMAX_MAX_BLOCKS 64  // blocks per row at most (sampling.rs ARGMAX_BLOCKS)
extern "C" __global__ void argmax_next(const float* __restrict__ logits, int n, int* __restrict__ step,
                                       float* __restrict__ part) {
    pdl_wait_trigger();
    if (n <= 0) {
        if (blockIdx.x != 0 || threadIdx.x != 0) return;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { __nanosleep(1000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < 1000ull * (unsigned long long)(-n));
        return;
    }
    // Row blockIdx.y of a batch: its logits, step buffer and scratch (ARGMAX_MAX_BLOCKS partial
    // pairs and the ticket, at a place that does not depend on the grid, so launches with fewer
    // blocks per row find it zero).
    const size_t r = blockIdx.y;
    logits += r * n;
    step += 2 * r;
    part += r * (2 * ARGMAX_MAX_BLOCKS + 1);
    // Block b reduces the contiguous slice [b*chunk, (b+1)*chunk) (ascending, first max kept).
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = logits[i];
        if (v > best) { best = v; idx = i; }
    }
    if (!argmax_grid(best, idx, part, reinterpret_cast<u32*>(part + 2 * ARGMAX_MAX_BLOCKS))) return;
    step[0] = idx == 0x7fffffff ? 0 : idx;  // all-NaN logits: token 0 rather than garbage
    step[1] += 1;
}

// ---- sampling on the device: penalties, temperature, top-k, min-p, top-p, seeded draw ----
// Same selection as engine::sampling::Sampler::sample, without sorting: the kept set is every
// finite token whose (penalised) logit z is at least a threshold tau, so
//   min-p: tau_minp = zmax + T * ln(min_p)          (p / p_max >= min_p)
//   top-k: tau_k    = the k-th largest z             (radix select over the z bits, 4 passes)
//   top-p: tau_p    = the largest z whose set above reaches top_p of the top-k set's mass
//                      (4 more passes, masses in 2^-32 fixed point so sums are exact and the
//                      result does not depend on the order blocks finish in)
// and the draw is the Gumbel-max trick over the kept set: argmax(z / T + g), g = -ln(-ln u) with
// u from a hash of (seed, position, token), which samples exactly from softmax(z / T) restricted
// to the set; the same seed gives the same tokens. Ties at a threshold keep every tied token
// (the host sampler breaks them by id): equal float logits only. Temperature 0 is the argmax of
// the penalised logits. Launches: sample_prep, sample_select x 8 (passes that do not apply
// return at once), sample_draw; the last block of each (ticket) reduces the blocks' partials.
//   decode (T = 1): sample_prep, sample_select, sample_draw

#define SAMPLE_BINS 256
#define SAMPLE_THREADS 1024  // threads per block of every sampling kernel (sampling.rs)

struct SampleParams {
    float temperature, top_p, min_p, presence, frequency, repetition;
    int top_k;      // 0 = off
    int penalties;  // apply the counts
    unsigned long long seed;
};

struct SampleRow {
    float zmax;
    float tau_k;     // top-k threshold (NEG_INF: off)
    float tau;       // the kept set: z >= tau
    u32 prefix;      // radix select: key bits found so far
    unsigned long long remaining;  // rank (top-k) or fixed-point mass (top-p) still to cover
    unsigned long long finite;     // finite tokens
    u32 ticket;
    u32 active;      // bit 0: top-k search, bit 1: top-p search
    u32 ncand;       // tokens the last top-k pass listed (SAMPLE_CAND per row at most kept)
    u32 listed;      // the list holds every token at or above tau_k: later passes read it alone
};

// The last top-k pass lists every finite token at or above the lowest value of the threshold's
// 24-bit bucket (a superset of the top-k set), so the top-p passes and the draw read those few
// tokens instead of the whole row. A row with more than SAMPLE_CAND of them reads the row.
#define SAMPLE_CAND 2048
struct SampleCand {
    int idx;
    float v;
};

// Order-preserving map of a float onto u32 (larger float, larger key).
__device__ __forceinline__ u32 sample_key(float z) {
    u32 b = __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sample_key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ bool sample_finite(float z) { return isfinite(z); }

// 2^-32 fixed-point weight exp((z - zmax) / T) of a kept token.
__device__ __forceinline__ unsigned long long sample_mass(float z, float zmax, float t) {
    return (unsigned long long)(expf((z - zmax) / t) * 4294967296.f);
}

// The block's slice of the row: [lo, hi).
__device__ __forceinline__ void sample_slice(int n, int& lo, int& hi) {
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    lo = blockIdx.x * chunk;
    hi = min(n, lo + chunk);
}

// f(token, z) for this thread's share of the tokens a pass after the top-k search reads: the
// row's listed candidates when the list holds them (spread over the row's blocks), else its
// slice of the row. The order differs; what the passes compute from it does not.
template <typename F>
__device__ __forceinline__ void sample_each_kept(const SampleRow* row, const SampleCand* cand, const float* z, int n, F f) {
    int lo, hi;
    sample_slice(n, lo, hi);
    if (row->listed) {
        const int nc = (int)row->ncand;
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < nc; j += gridDim.x * blockDim.x) f(cand[j].idx, cand[j].v);
    } else {
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) f(i, z[i]);
    }
}

// z of this thread's share of tokens [lo, hi) of a row: the logits with the tokens outside the
// row's mask (`allowed`, null for none) at -inf and the penalties of the counts applied; the
// finite values' maximum and count go into m and fin.
__device__ __forceinline__ void sample_z(const float* __restrict__ logits, const SampleParams& p,
                                         const int* __restrict__ counts, const u32* __restrict__ allowed,
                                         float* __restrict__ z, int lo, int hi, float& m, unsigned long long& fin) {
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = logits[i];
        if (allowed && !((allowed[i >> 5] >> (i & 31)) & 1u)) v = NEG_INF;
        if (p.penalties) {
            const int c = counts[i];
            if (c > 0) {
                if (p.repetition != 1.f) v = v > 0.f ? v / p.repetition : v * p.repetition;
                v -= p.presence + p.frequency * (float)c;
            }
        }
        z[i] = v;
        if (sample_finite(v)) {
            m = fmaxf(m, v);
            fin++;
        }
    }
}

// z = logits with the tokens outside the row's mask at -inf (where masked[r]: mask row r, bit
// t % 32 of word t / 32 allows token t, as the host's backend::apply_mask) and the repetition,
// presence and frequency penalties of the counts applied (as Sampler::apply_penalties); zmax; the
// min-p threshold; which searches the row needs. part: gridDim.x floats.
extern "C" __global__ void sample_prep(const float* __restrict__ logits, int n, const SampleParams* __restrict__ prm,
                                       const int* __restrict__ counts, const int* __restrict__ masked,
                                       const u32* __restrict__ mask, int mask_words, float* __restrict__ z,
                                       SampleRow* __restrict__ row, float* __restrict__ part) {
    pdl_wait_trigger();
    const size_t r = blockIdx.y;
    logits += r * n;
    prm += r;
    counts += r * n;
    z += r * n;
    row += r;
    part += r * gridDim.x;
    const SampleParams p = *prm;
    const u32* allowed = masked[r] ? mask + r * mask_words : nullptr;
    int lo, hi;
    sample_slice(n, lo, hi);
    float m = NEG_INF;
    unsigned long long fin = 0;
    sample_z(logits, p, counts, allowed, z, lo, hi, m, fin);
    __shared__ float red[32];
    __shared__ unsigned long long redn[32];
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        fin += __shfl_xor_sync(0xffffffffu, fin, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { red[warp] = m; redn[warp] = fin; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; w++) { m = fmaxf(m, red[w]); fin += redn[w]; }
        part[blockIdx.x] = m;
        atomicAdd(reinterpret_cast<unsigned long long*>(&row->finite), fin);
    }
    if (!last_block(&row->ticket) || warp != 0) return;
    float zmax = NEG_INF;
    for (int b = lane; b < (int)gridDim.x; b += 32) zmax = fmaxf(zmax, __ldcg(part + b));
    for (int o = 16; o > 0; o >>= 1) zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffffu, zmax, o));
    if (lane != 0) return;
    const unsigned long long finite = __ldcg(&row->finite);
    const bool sampled = p.temperature > 0.f && finite > 0;
    row->zmax = zmax;
    row->tau_k = NEG_INF;
    row->tau = sampled && p.min_p > 0.f ? zmax + p.temperature * logf(p.min_p) : NEG_INF;
    row->prefix = 0;
    row->active = (sampled && p.top_k > 0 && (unsigned long long)p.top_k < finite ? 1u : 0u) |
                  (sampled && p.top_p < 1.f ? 2u : 0u);
    row->remaining = (row->active & 1u) ? (unsigned long long)p.top_k : 0ull;
    row->ncand = 0;
    row->listed = 0;
    row->ticket = 0;
}

// One radix-select pass over 8 bits of the z keys (pass 0-3: top-k, 4-7: top-p, most significant
// byte first). hist: gridDim.x x 256 partials.
extern "C" __global__ void sample_select(const float* __restrict__ z, int n, const SampleParams* __restrict__ prm,
                                         SampleRow* __restrict__ row, unsigned long long* __restrict__ hist, int pass,
                                         SampleCand* __restrict__ cand) {
    pdl_wait_trigger();
    const size_t r = blockIdx.y;
    z += r * n;
    prm += r;
    row += r;
    hist += r * gridDim.x * SAMPLE_BINS;
    cand += r * SAMPLE_CAND;
    const int phase = pass >> 2, digit = 3 - (pass & 3), shift = 8 * digit;
    const u32 active = row->active;
    if (!(active & (1u << phase))) return;
    const SampleParams p = *prm;
    const u32 prefix = row->prefix;
    const u32 mask = digit == 3 ? 0u : ~0u << (shift + 8);
    const float zmax = row->zmax, tau_k = row->tau_k, tau = fmaxf(row->tau, tau_k);
    __shared__ unsigned long long h[SAMPLE_BINS];
    __shared__ unsigned long long topk_mass;
    for (int c = threadIdx.x; c < SAMPLE_BINS; c += blockDim.x) h[c] = 0;
    if (threadIdx.x == 0) topk_mass = 0;
    __syncthreads();
    int lo, hi;
    sample_slice(n, lo, hi);
    unsigned long long tm = 0;
    if (phase == 0) {
        // Counts: most of a row's keys share their top bits, so the lanes of a warp that hit the
        // same bin add once together (one shared atomic per distinct bin instead of per lane).
        // The last pass lists every finite token at or above its bucket's lowest value (prefix:
        // the threshold's top 24 bits), compared as floats so that -0 goes with +0 as later
        // passes compare.
        const bool list = digit == 0;
        const float list_lo = sample_key_float(prefix);
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float v = z[i];
            const u32 key = sample_key(v);
            const bool take = sample_finite(v) && (key & mask) == prefix;
            const u32 bin = take ? (key >> shift) & 255u : 0xffffffffu;
            const u32 peers = __match_any_sync(__activemask(), bin);
            if (take && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], (unsigned long long)__popc(peers));
            if (list && sample_finite(v) && v >= list_lo) {
                const u32 c = atomicAdd(&row->ncand, 1u);
                if (c < SAMPLE_CAND) cand[c] = SampleCand{i, v};
            }
        }
    } else {
        sample_each_kept(row, cand, z, n, [&](int, float v) {
            if (!sample_finite(v) || v < tau_k) return;
            const u32 key = sample_key(v);
            const unsigned long long w = sample_mass(v, zmax, p.temperature);
            if (pass == 4) tm += w;  // the top-k set's mass: top-p is relative to it
            if (v >= tau && (key & mask) == prefix) atomicAdd(&h[(key >> shift) & 255u], w);
        });
    }
    if (pass == 4) {
        for (int o = 16; o > 0; o >>= 1) tm += __shfl_xor_sync(0xffffffffu, tm, o);
        if ((threadIdx.x & 31) == 0 && tm) atomicAdd(&topk_mass, tm);
    }
    __syncthreads();
    unsigned long long* mine = hist + (size_t)blockIdx.x * SAMPLE_BINS;
    for (int c = threadIdx.x; c < SAMPLE_BINS; c += blockDim.x) mine[c] = h[c];
    __threadfence();  // every writer's partials visible before the block takes its ticket
    if (pass == 4 && threadIdx.x == 0) atomicAdd(&row->remaining, topk_mass);  // remaining was zeroed by pass 3 or prep
    if (!last_block(&row->ticket)) return;
    // Bucket totals in a fixed order (exact integers: the same whichever block finished last):
    // SAMPLE_THREADS / 256 threads per bucket, each summing every fourth block's partial with its
    // loads in flight together, then one add per bucket.
    __shared__ unsigned long long quarter[SAMPLE_THREADS / SAMPLE_BINS][SAMPLE_BINS];
    {
        const int c = threadIdx.x % SAMPLE_BINS, q = threadIdx.x / SAMPLE_BINS, nq = SAMPLE_THREADS / SAMPLE_BINS;
        unsigned long long acc = 0;
#pragma unroll 16
        for (int b = q; b < (int)gridDim.x; b += nq) acc += __ldcg(hist + (size_t)b * SAMPLE_BINS + c);
        quarter[q][c] = acc;
    }
    __syncthreads();
    if (threadIdx.x < SAMPLE_BINS) {
        unsigned long long acc = 0;
        for (int q = 0; q < SAMPLE_THREADS / SAMPLE_BINS; q++) acc += quarter[q][threadIdx.x];
        h[threadIdx.x] = acc;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    unsigned long long need = __ldcg(&row->remaining);
    if (pass == 4) {
        // `remaining` holds the top-k set's mass: the target is top_p of it (as the host
        // sampler's prefix sum over probabilities normalised within the top-k set).
        need = (unsigned long long)ceil((double)need * (double)p.top_p);
        if (need == 0) need = 1;
    }
    // The bucket where the count (mass) from the top reaches `need`: lane l holds buckets
    // 8l..8l+7; a suffix sum over the lanes finds the lane, that lane its bucket.
    unsigned long long in_lane = 0;
    for (int j = 0; j < 8; j++) in_lane += h[8 * lane + j];
    unsigned long long from_top = in_lane;  // buckets of this lane and every lane above
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_down_sync(0xffffffffu, from_top, o);
        if (lane + o < 32) from_top += t;
    }
    const u32 reach = __ballot_sync(0xffffffffu, from_top >= need);
    const int owner = reach ? 31 - __clz(reach) : 0;
    if (lane != owner) return;
    if (!reach) {
        // The candidates cannot reach the target (min-p cut more than top-p would): keep them all.
        row->active = active & ~(1u << phase);
        if (phase == 0) row->remaining = 0;
    } else {
        unsigned long long above = from_top - in_lane;
        int c = 8 * lane + 7;
        for (; c > 8 * lane; c--) {
            if (above + h[c] >= need) break;
            above += h[c];
        }
        row->prefix = prefix | ((u32)c << shift);
        row->remaining = need - above;
        if (digit == 0) {
            const float t = sample_key_float(row->prefix);
            if (phase == 0) {
                row->tau_k = t;
                row->prefix = 0;
                row->remaining = 0;  // pass 4 adds the top-k set's mass into it
                row->listed = __ldcg(&row->ncand) <= SAMPLE_CAND;
            } else {
                row->tau = fmaxf(row->tau, t);
            }
        }
    }
    row->ticket = 0;
}

// splitmix64 finaliser: a well-mixed 64-bit hash.
__device__ __forceinline__ unsigned long long sample_mix(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// The draw's score of kept token i (z / T + Gumbel noise with u a hash of the step's key and i;
// z itself at temperature 0), folded into (best, idx): the larger score, the lower id on a tie.
__device__ __forceinline__ void sample_draw_take(int i, float v, bool sampled, float inv_t, unsigned long long key,
                                                 float& best, int& idx) {
    float s = v;
    if (sampled) {
        const float u = ((float)(sample_mix(key + (unsigned long long)i) >> 40) + 0.5f) * (1.f / 16777216.f);
        s = v * inv_t - logf(-logf(u));
    }
    if (s > best || (s == best && i < idx)) { best = s; idx = i; }
}

// The draw: argmax of z / T + Gumbel noise over the kept set (argmax of z at temperature 0),
// ties to the lowest id; writes the token and the next position into the step buffer and counts
// the token when penalties are on. part: 2 x gridDim.x words.
extern "C" __global__ void sample_draw(const float* __restrict__ z, int n, const SampleParams* __restrict__ prm,
                                       SampleRow* __restrict__ row, int* __restrict__ counts, int* __restrict__ step,
                                       float* __restrict__ part, const SampleCand* __restrict__ cand) {
    pdl_wait_trigger();
    const size_t r = blockIdx.y;
    z += r * n;
    cand += r * SAMPLE_CAND;
    prm += r;
    row += r;
    counts += r * n;
    step += 2 * r;
    part += r * 2 * gridDim.x;
    const SampleParams p = *prm;
    const float tau = fmaxf(row->tau, row->tau_k);
    const bool sampled = p.temperature > 0.f;
    const float inv_t = sampled ? 1.f / p.temperature : 0.f;
    const unsigned long long key = sample_mix(p.seed ^ sample_mix((unsigned long long)(unsigned)step[1]));
    float best = NEG_INF;
    int idx = 0x7fffffff;
    // Candidates in any order: the larger score, the lower id on a tie (argmax_grid's order).
    sample_each_kept(row, cand, z, n, [&](int i, float v) {
        if (!sample_finite(v) || v < tau) return;
        sample_draw_take(i, v, sampled, inv_t, key, best, idx);
    });
    if (!argmax_grid(best, idx, part, &row->ticket)) return;
    const int tok = idx == 0x7fffffff ? 0 : idx;  // no finite logit: token 0 rather than garbage
    step[0] = tok;
    step[1] += 1;
    if (p.penalties) counts[tok] += 1;
    row->finite = 0;
}

// ---- one launch for a small top-k (the chat settings) ----
// For rows whose top-k is at most SAMPLE_SMALL_K (sampling.rs picks it per step), what
// sample_prep, sample_select x 8 and sample_draw do, in one launch, with the same token: each
// block makes z for its slice (as sample_prep) and lists its K largest finite values (every value
// above its K-th largest, then those equal to it while slots remain); the row's last block takes
// the k-th largest of the lists (they hold every token at or above the row's k-th largest: no
// block's K-th largest is above it), then the top-k set's mass, the top-p threshold and the draw
// over those few tokens with the same integer masses, the same radix choice of thresholds and the
// same Gumbel scores. A block with more values equal to its K-th largest than slots (exactly
// equal floats) makes the last block read the whole row instead.
#define SAMPLE_SMALL_K 64
// Scratch per row (u64 words, in the select passes' histogram buffer): the blocks' lists, then
// one SampleSmallBlock per block.
#define SAMPLE_SMALL_LIST (ARGMAX_MAX_BLOCKS * SAMPLE_SMALL_K)
#define SAMPLE_SMALL_WORDS (SAMPLE_SMALL_LIST + 2 * ARGMAX_MAX_BLOCKS)
struct SampleSmallBlock {
    float zmax;
    u32 finite;
    u32 count;     // values listed (at most K)
    u32 overflow;  // values equal to the K-th largest did not all fit
};

// The radix search of one block, as sample_select's passes and last block do it over a row: the
// largest key whose candidates at or above it weigh `need` or more (T = u32: counts, each
// candidate 1; T = u64: fixed-point masses), digit by digit from the most significant byte;
// false when all candidates together weigh less. visit(f) calls f(key, take, w) for every
// candidate of every thread, the lanes of a warp together. Every thread of the block calls it and
// gets the same result. h: 256 T of shared memory.
template <typename T, typename Visit>
__device__ bool sample_block_search(Visit visit, T need, T* h, u32* result) {
    __shared__ u32 s_bucket;
    __shared__ T s_left;
    __shared__ int s_reach;
    u32 prefix = 0;
    for (int digit = 3; digit >= 0; --digit) {
        const int shift = 8 * digit;
        const u32 mask = digit == 3 ? 0u : ~0u << (shift + 8);
        for (int c = threadIdx.x; c < SAMPLE_BINS; c += blockDim.x) h[c] = 0;
        __syncthreads();
        visit([&](u32 key, bool take, T w) {
            take = take && (key & mask) == prefix;
            const u32 bin = (key >> shift) & 255u;
            if constexpr (sizeof(T) == 4) {
                // Counts: the lanes of a warp in the same bin add once together (most keys share
                // their top bits).
                const u32 peers = __match_any_sync(__activemask(), take ? bin : 0xffffffffu);
                if (take && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], (T)__popc(peers));
            } else {
                if (take) atomicAdd(&h[bin], w);
            }
        });
        __syncthreads();
        if (threadIdx.x < 32) {
            // The bucket where the weight from the top reaches `need`: lane l holds buckets
            // 8l..8l+7; a suffix sum over the lanes finds the lane, that lane its bucket.
            const int lane = threadIdx.x;
            T in_lane = 0;
            for (int j = 0; j < 8; j++) in_lane += h[8 * lane + j];
            T from_top = in_lane;
            for (int o = 1; o < 32; o <<= 1) {
                const T t = __shfl_down_sync(0xffffffffu, from_top, o);
                if (lane + o < 32) from_top += t;
            }
            const u32 reach = __ballot_sync(0xffffffffu, from_top >= need);
            if (lane == 0) s_reach = reach != 0;
            if (reach && lane == 31 - __clz(reach)) {
                T above = from_top - in_lane;
                int c = 8 * lane + 7;
                for (; c > 8 * lane; c--) {
                    if (above + h[c] >= need) break;
                    above += h[c];
                }
                s_bucket = (u32)c;
                s_left = need - above;
            }
        }
        __syncthreads();
        if (!s_reach) return false;
        prefix |= s_bucket << shift;
        need = s_left;
        __syncthreads();  // s_bucket / s_left are read by every thread before the next digit
    }
    *result = prefix;
    return true;
}

template <typename T>
__device__ __forceinline__ T sample_block_sum(T x, T* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    T s = 0;
    for (int w = 0; w < nw; w++) s += red[w];
    return s;
}

__device__ __forceinline__ float sample_block_max(float x, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < nw; w++) m = fmaxf(m, red[w]);
    return m;
}

// What sample_block_search visits (callables with a templated operator(): NVRTC compiles no
// generic lambdas). The finite-or-not keys of this thread's share of a block's slice:
struct SampleSliceKeys {
    const float* z;
    int lo, hi;
    template <typename F>
    __device__ void operator()(F f) const {
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float v = z[i];
            f(sample_key(v), sample_finite(v), 1u);
        }
    }
};
// One value per thread (its share's largest finite z, or none): the prefilter's keys.
struct SampleThreadKey {
    float v;
    template <typename F>
    __device__ void operator()(F f) const { f(sample_key(v), sample_finite(v), 1u); }
};
// The keys gathered in shared memory (all finite).
struct SampleSharedKeys {
    const u32* key;
    int n;
    template <typename F>
    __device__ void operator()(F f) const {
        for (int j = threadIdx.x; j < n; j += blockDim.x) f(key[j], true, 1u);
    }
};
// This thread's share of a row's candidates, f(token, z): the lists gathered in shared memory,
// or the whole row (read through L2: other blocks wrote it).
struct SampleSource {
    bool whole_row;
    const float* z;
    int n;
    const u32* ckey;
    const int* cidx;
    int total;
    template <typename F>
    __device__ void operator()(F f) const {
        if (whole_row) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) f(i, __ldcg(z + i));
        } else {
            for (int j = threadIdx.x; j < total; j += blockDim.x) f(cidx[j], sample_key_float(ckey[j]));
        }
    }
};
// The candidates' keys, counted (the top-k search).
struct SampleKeysOf {
    SampleSource src;
    template <typename F>
    __device__ void operator()(F f) const {
        src([&](int, float v) { f(sample_key(v), sample_finite(v), 1u); });
    }
};
// The candidates at or above both thresholds, weighed by their fixed-point masses (top-p).
struct SampleMassesOf {
    SampleSource src;
    float tau_k, cut, zmax, t;
    template <typename F>
    __device__ void operator()(F f) const {
        src([&](int, float v) {
            const bool take = sample_finite(v) && v >= tau_k && v >= cut;
            f(sample_key(v), take, take ? sample_mass(v, zmax, t) : 0ull);
        });
    }
};

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_small_k(const float* __restrict__ logits, int n, const SampleParams* __restrict__ prm,
                   int* __restrict__ counts, const int* __restrict__ masked, const u32* __restrict__ mask,
                   int mask_words, float* __restrict__ z, SampleRow* __restrict__ row,
                   unsigned long long* __restrict__ scratch, int* __restrict__ step) {
    pdl_wait_trigger();
    const size_t r = blockIdx.y;
    logits += r * n;
    prm += r;
    counts += r * n;
    z += r * n;
    row += r;
    step += 2 * r;
    scratch += r * SAMPLE_SMALL_WORDS;
    SampleCand* lists = reinterpret_cast<SampleCand*>(scratch);
    SampleSmallBlock* info = reinterpret_cast<SampleSmallBlock*>(scratch + SAMPLE_SMALL_LIST);
    const SampleParams p = *prm;
    const int K = max(1, min(p.top_k, SAMPLE_SMALL_K));
    const u32* allowed = masked[r] ? mask + r * mask_words : nullptr;
    __shared__ u32 h32[SAMPLE_BINS];
    __shared__ unsigned long long h64[SAMPLE_BINS];
    __shared__ float redf[32];
    __shared__ unsigned long long redu[32];
    __shared__ u32 s_count, s_overflow, s_ncand;
    // The block's candidates (keys and tokens), then the last block's merged lists.
    __shared__ u32 ckey[SAMPLE_SMALL_LIST];
    __shared__ int cidx[SAMPLE_SMALL_LIST];

    // z of the slice (sample_prep's arithmetic), its maximum and finite count.
    int lo, hi;
    sample_slice(n, lo, hi);
    float m = NEG_INF;
    unsigned long long fin = 0;
    sample_z(logits, p, counts, allowed, z, lo, hi, m, fin);
    const float thread_max = m;
    m = sample_block_max(m, redf);
    fin = sample_block_sum(fin, redu);
    if (threadIdx.x == 0) { s_count = 0; s_overflow = 0; s_ncand = 0; }
    __syncthreads();  // the slice's z (global, this block's own writes) and the counters

    // The slice's list: every finite value above its K-th largest, then the values equal to it
    // while slots remain (all finite values when fewer than K).
    SampleCand* mine = lists + (size_t)blockIdx.x * K;
    float tb = NEG_INF;
    if (fin >= (unsigned long long)K) {
        // The K-th largest of the threads' maxima, t, is at most the slice's K-th largest (K
        // threads hold a value at or above it), so the values at or above t hold every value the
        // list takes: gathered into shared memory (usually a few times K), the K-th largest and
        // the list come from them alone. Past SAMPLE_SMALL_LIST of them (many equal values), or
        // fewer than K threads with a finite value, the slice itself is searched.
        bool gathered = false;
        u32 key = 0;
        if (sample_block_search<u32>(SampleThreadKey{thread_max}, (u32)K, h32, &key)) {
            const float t = sample_key_float(key);
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
                const float v = z[i];
                if (sample_finite(v) && v >= t) {
                    const u32 c = atomicAdd(&s_ncand, 1u);
                    if (c < SAMPLE_SMALL_LIST) { ckey[c] = sample_key(v); cidx[c] = i; }
                }
            }
            __syncthreads();
            gathered = s_ncand <= SAMPLE_SMALL_LIST;
        }
        if (gathered) {
            const int nc = (int)s_ncand;
            sample_block_search<u32>(SampleSharedKeys{ckey, nc}, (u32)K, h32, &key);
            tb = sample_key_float(key);
            for (int j = threadIdx.x; j < nc; j += blockDim.x) {
                const float v = sample_key_float(ckey[j]);
                if (v > tb) mine[atomicAdd(&s_count, 1u)] = SampleCand{cidx[j], v};
            }
            __syncthreads();
            for (int j = threadIdx.x; j < nc; j += blockDim.x) {
                const float v = sample_key_float(ckey[j]);
                if (v == tb) {
                    const u32 c = atomicAdd(&s_count, 1u);
                    if (c < (u32)K) mine[c] = SampleCand{cidx[j], v};
                    else s_overflow = 1;
                }
            }
        } else {
            sample_block_search<u32>(SampleSliceKeys{z, lo, hi}, (u32)K, h32, &key);
            tb = sample_key_float(key);
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
                const float v = z[i];
                if (sample_finite(v) && v > tb) mine[atomicAdd(&s_count, 1u)] = SampleCand{i, v};
            }
            __syncthreads();
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
                const float v = z[i];
                if (v == tb) {
                    const u32 c = atomicAdd(&s_count, 1u);
                    if (c < (u32)K) mine[c] = SampleCand{i, v};
                    else s_overflow = 1;
                }
            }
        }
    } else {
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float v = z[i];
            if (sample_finite(v)) mine[atomicAdd(&s_count, 1u)] = SampleCand{i, v};
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) info[blockIdx.x] = SampleSmallBlock{m, (u32)fin, min(s_count, (u32)K), s_overflow};
    __threadfence();  // the lists, the block's info and its z visible before the ticket
    if (!last_block(&row->ticket)) return;

    // ---- the row's last block: the blocks' lists (or the row) to the token ----
    __shared__ u32 s_total;
    float zmax = NEG_INF;
    unsigned long long finite = 0;
    u32 over = 0;
    // Other blocks' writes: read through L2.
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
        zmax = fmaxf(zmax, __ldcg(&info[b].zmax));
        finite += __ldcg(&info[b].finite);
        over |= __ldcg(&info[b].overflow);
    }
    zmax = sample_block_max(zmax, redf);
    finite = sample_block_sum(finite, redu);
    const bool whole_row = sample_block_sum((unsigned long long)over, redu) != 0;
    if (threadIdx.x == 0) s_total = 0;
    __syncthreads();
    if (!whole_row) {
        for (int j = threadIdx.x; j < (int)gridDim.x * K; j += blockDim.x) {
            const int b = j / K, e = j % K;
            if (e < (int)__ldcg(&info[b].count)) {
                const SampleCand* c = lists + (size_t)b * K + e;
                const u32 at = atomicAdd(&s_total, 1u);
                ckey[at] = sample_key(__ldcg(&c->v));
                cidx[at] = __ldcg(&c->idx);
            }
        }
    }
    __syncthreads();
    const SampleSource each{whole_row, z, n, ckey, cidx, (int)s_total};
    const bool sampled = p.temperature > 0.f && finite > 0;
    float tau = sampled && p.min_p > 0.f ? zmax + p.temperature * logf(p.min_p) : NEG_INF;
    float tau_k = NEG_INF;
    if (sampled && p.top_k > 0 && (unsigned long long)p.top_k < finite) {
        u32 key = 0;
        if (sample_block_search<u32>(SampleKeysOf{each}, (u32)p.top_k, h32, &key)) tau_k = sample_key_float(key);
    }
    if (sampled && p.top_p < 1.f) {
        // The top-k set's mass; the target is top_p of it, as sample_select's pass 4 sets it.
        unsigned long long tm = 0;
        each([&](int, float v) {
            if (sample_finite(v) && v >= tau_k) tm += sample_mass(v, zmax, p.temperature);
        });
        unsigned long long need = (unsigned long long)ceil((double)sample_block_sum(tm, redu) * (double)p.top_p);
        if (need == 0) need = 1;
        u32 key = 0;
        const SampleMassesOf masses{each, tau_k, fmaxf(tau, tau_k), zmax, p.temperature};
        if (sample_block_search<unsigned long long>(masses, need, h64, &key)) tau = fmaxf(tau, sample_key_float(key));
    }
    // The draw (sample_draw's scores): Gumbel-max over the kept set, ties to the lowest id.
    const float keep = fmaxf(tau, tau_k);
    const bool draws = p.temperature > 0.f;
    const float inv_t = draws ? 1.f / p.temperature : 0.f;
    const unsigned long long key = sample_mix(p.seed ^ sample_mix((unsigned long long)(unsigned)step[1]));
    float best = NEG_INF;
    int idx = 0x7fffffff;
    each([&](int i, float v) {
        if (!sample_finite(v) || v < keep) return;
        sample_draw_take(i, v, draws, inv_t, key, best, idx);
    });
    sample_block_argmax(best, idx);
    if (threadIdx.x != 0) return;
    const int tok = idx == 0x7fffffff ? 0 : idx;  // no finite logit: token 0 rather than garbage
    step[0] = tok;
    step[1] += 1;
    if (p.penalties) counts[tok] += 1;
    row->ticket = 0;
}
