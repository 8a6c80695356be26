// Greedy sampling on the device: argmax over the logits (ties -> lowest id, like
// engine::sampling::argmax), written into the step buffer as the next token together with the
// next position, so a decode loop can run without the host reading anything.
// One block of 1024 threads; the vocabulary (248,320) is read once from L2 (just written).
extern "C" __global__ void argmax_next(const float* __restrict__ logits, int n, int* __restrict__ step) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = logits[i];
        if (v > best) { best = v; idx = i; }  // strided ascending: first max kept per thread
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : NEG_INF;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) {
            step[0] = idx == 0x7fffffff ? 0 : idx;  // all-NaN logits: token 0 rather than garbage
            step[1] += 1;
        }
    }
}
