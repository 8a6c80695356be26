"""Timing-only variants of moe_route_batch (kernels/moe.cu): one of its three parts runs twice,
with the same outputs, so a lily-bench step's time grows by that part's cost in the graph
(the decode stays correct: every digest must equal main's).
  gemv  - the router GEMV and the logits' block sums (every block);
  topk  - each token group's last block: its logits from L2, the top-k, the counts;
  lists - the last group's block: the scans, tiles and slot lists.
A second pass reads through an offset the compiler cannot see (an `asm volatile` zero), so it
cannot reuse the first pass's loads. Usage: python3 route_twice.py PART < moe.cu > moe.cu.new"""
import sys

part = sys.argv[1]
s = sys.stdin.read()
Z = 'int rz_; asm volatile("mov.u32 %0, 0;" : "=r"(rz_));'


def sub(old, new):
    global s
    assert s.count(old) == 1, old[:80]
    s = s.replace(old, new)


if part == "gemv":
    # Two blocks per SM, as main's 128 registers give (the loop alone took 238).
    sub("extern \"C\" __global__ void __launch_bounds__(RB_THREADS) moe_route_batch_##R##_35b(",
        "extern \"C\" __global__ void __launch_bounds__(RB_THREADS, 2) moe_route_batch_##R##_35b(")
    sub("""        for (int j = 0; j < RB_TOK; ++j) acc[i][j] = 0.f;
    float wv[RB_ROWS][8];""", """        for (int j = 0; j < RB_TOK; ++j) acc[i][j] = 0.f;
    float wv[RB_ROWS][8];
    int rz = 0;""")
    sub("if (r < E) rb_dequant8(rw, rs, rbias, rbits, H, group, r, ch, wv[i]);",
        "if (r < E) rb_dequant8(rw + rz, rs, rbias, rbits, H, group, r, ch, wv[i]);")
    sub("""    pdl_wait_trigger();
    for (int ch = tid; ch < H / 8; ch += RB_THREADS) {
        if (ch != tid) dequant(ch);""", """    pdl_wait_trigger();
#pragma unroll 1
    for (int rep = 0; rep < 2; ++rep) {
    if (rep) { %s rz = rz_; __syncthreads(); if (tid < H / 8) dequant(tid);
#pragma unroll
    for (int i = 0; i < RB_ROWS; ++i)
#pragma unroll
        for (int j = 0; j < RB_TOK; ++j) acc[i][j] = 0.f;
    }
    for (int ch = tid; ch < H / 8; ch += RB_THREADS) {
        if (ch != tid) dequant(ch);""" % Z)
    sub("const float4* xp = reinterpret_cast<const float4*>(u + (size_t)(c0 + j) * H + ch * 8);",
        "const float4* xp = reinterpret_cast<const float4*>(u + rz + (size_t)(c0 + j) * H + ch * 8);")
    sub("""            if (r < E) logits[(size_t)(c0 + j) * E + r] = v;
            else sgl[c0 + j] = v;
        }
    }""", """            if (r < E) logits[(size_t)(c0 + j) * E + r] = v;
            else sgl[c0 + j] = v;
        }
    }
    }""")
elif part == "topk":
    sub("""    for (int e = tid; e < E; e += RB_THREADS) cnt[e] = 0;
    // All loads in flight""", """#pragma unroll 1
    for (int rep = 0; rep < 2; ++rep) {
    int rz = 0;
    if (rep) { %s rz = rz_; __syncthreads(); }
    for (int e = tid; e < E; e += RB_THREADS) cnt[e] = 0;
    // All loads in flight""" % Z)
    sub("lg[i] = __ldcg(logits + (size_t)c0 * E + i);", "lg[i] = __ldcg(logits + rz + (size_t)c0 * E + i);")
    sub("""        __syncwarp();
    }
    __syncthreads();
    if (gridDim.y > 1) {""", """        __syncwarp();
    }
    }
    __syncthreads();
    if (gridDim.y > 1) {""")
elif part == "lists":
    sub("""    const int EA = E + with_shared, ts = with_shared ? (n + TCB_TOK - 1) / TCB_TOK : 0;
    {""", """    const int EA = E + with_shared, ts = with_shared ? (n + TCB_TOK - 1) / TCB_TOK : 0;
#pragma unroll 1
    for (int rep = 0; rep < 2; ++rep) {
    if (rep) { %s if (rz_) return; __syncthreads(); }
    {""" % Z)
    sub("""        list[off[e] + atomicAdd(&cnt[e], 1)] = sl;
    }
    if (with_shared)""", """        list[off[e] + atomicAdd(&cnt[e], 1)] = sl;
    }
    }
    if (with_shared)""")
else:
    sys.exit("part: gemv | topk | lists")
sys.stdout.write(s)
