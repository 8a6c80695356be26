#!/usr/bin/env python3
# Simulates moe_tcs's per-warp ring bookkeeping (issue cursor vs consumption) for several shapes.
DEPTH, TCR_GROUPS, PARTS = 4, 2, 8
def run(tiles, rows, cols, grid):
    gpr, rtiles = cols // 64, rows // 16
    total = tiles * rtiles
    S = gpr // TCR_GROUPS
    for b in range(grid):
        lo, hi = total * b // grid, total * (b + 1) // grid
        if lo >= hi: continue
        for warp in range(16):
            pt = warp % PARTS
            s0 = pt * S // PARTS; ns = (pt + 1) * S // PARTS - s0; nst = (hi - lo) * ns
            # issue cursor
            i_ti = lo // rtiles; i_r0 = (lo - i_ti * rtiles) * 16; i_st = 0; issued = 0
            slots = {}  # ring slot -> (ti, r0, G) issued
            committed = []  # list of group contents (None = empty)
            def issue():
                nonlocal i_ti, i_r0, i_st, issued
                if issued < nst:
                    slots[issued % DEPTH] = (i_ti, i_r0, TCR_GROUPS * (s0 + i_st))
                    committed.append(issued)
                    i_st += 1
                    if i_st == ns:
                        i_st = 0; i_r0 += 16
                        if i_r0 == rows:
                            i_r0 = 0
                            if issued + 1 < nst: i_ti += 1
                else:
                    committed.append(None)
                issued += 1
            for _ in range(DEPTH - 1): issue()
            k = 0
            for it in range(hi - lo):
                rg = lo + it; ti = rg // rtiles; r0 = (rg - ti * rtiles) * 16
                for j in range(ns):
                    issue()
                    # wait<DEPTH-1>: all but the last DEPTH-1 committed groups complete
                    done = committed[:len(committed) - (DEPTH - 1)]
                    assert k in done, (b, warp, it, j, k)
                    got = slots[k % DEPTH]
                    want = (ti, r0, TCR_GROUPS * s0 + TCR_GROUPS * j)
                    assert got == want, (b, warp, it, j, got, want)
                    k += 1
            assert k == nst
    return True
for tiles, rows, cols, grid in [(103, 512, 2048, 132), (9, 512, 2048, 132), (33, 512, 2048, 132), (264, 512, 2048, 132), (40, 64, 128, 132), (3, 64, 128, 132), (1, 512, 2048, 132), (0, 512, 2048, 132)]:
    run(tiles, rows, cols, grid)
    print("ok", tiles, rows, cols, grid)
