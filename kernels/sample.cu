// Sampling.
//   decode (T = 1): argmax_next

// Greedy sampling on the device: argmax over the logits (ties -> lowest id, like
// engine::sampling::argmax), written into the step buffer as the next token together with the
// next position, so a decode loop can run without the host reading anything.
// One block of 1024 threads; the vocabulary (248,320) is read once from L2 (just written).
//
// n <= 0 is not an argmax: the block spins for -n microseconds and returns (the profiler holds
// the stream with it so the host can queue a whole step first; no extra entry point needed).
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
    __shared__ float bv[32];
    __shared__ int bi[32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // Block b reduces the contiguous slice [b*chunk, (b+1)*chunk) (ascending, first max kept).
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = logits[i];
        if (v > best) { best = v; idx = i; }
    }
    // (value desc, index asc) merge; NaN never wins (like the single-block version).
    auto merge = [&]() {
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
    };
    merge();
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        merge();
        if (lane == 0) {
            part[2 * blockIdx.x] = best;
            part[2 * blockIdx.x + 1] = __int_as_float(idx);
            __threadfence();
            unsigned int* ticket = reinterpret_cast<unsigned int*>(part + 2 * gridDim.x);
            last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    best = NEG_INF;
    idx = 0x7fffffff;
    for (int b = lane; b < (int)gridDim.x; b += 32) {
        float v = __ldcg(part + 2 * b);
        int i = __float_as_int(__ldcg(part + 2 * b + 1));
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    merge();
    if (lane == 0) {
        step[0] = idx == 0x7fffffff ? 0 : idx;  // all-NaN logits: token 0 rather than garbage
        step[1] += 1;
        *reinterpret_cast<unsigned int*>(part + 2 * gridDim.x) = 0u;  // ticket ready for the next use
    }
}
