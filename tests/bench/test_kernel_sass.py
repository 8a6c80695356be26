"""scripts/kernel_sass.py's reading of a disassembly (a canned cuobjdump excerpt: no NVRTC or GPU
needed): opcodes without predicates and modifiers, the innermost loops a backward branch closes,
and the matrix instructions and divisions counted in them."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(ROOT, "scripts", "kernel_sass.py"))
ks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ks)

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                /* 0x00000a00ff017b82 */
                                                                                         /* 0x000ff00000000800 */
        /*0010*/                   IABS R26, R81 ;                                       /* 0x0000000000000000 */
        /*0020*/                   I2F.RP R27, R26 ;                                     /* 0x0000000000000000 */
        /*0030*/                   MUFU.RCP R27, R27 ;                                   /* 0x0000000000000000 */
        /*0040*/              @!P0 LDS.128 R24, [R25] ;                                  /* 0x0000000000000000 */
        /*0050*/                   HMMA.16816.F32.BF16 R32, R32, R40, RZ ;               /* 0x0000000000000000 */
        /*0060*/                   I2F.RP R28, R26 ;                                     /* 0x0000000000000000 */
        /*0070*/               @P1 BRA 0x40 ;                                            /* 0x0000000000000000 */
        /*0080*/                   BRA 0x10 ;                                            /* 0x0000000000000000 */
        /*0090*/                   EXIT ;                                                /* 0x0000000000000000 */
"""


def test_opcodes_lose_predicates_and_modifiers():
    assert ks.opcode("@!P0 LDS.128 R24, [R25]") == "LDS"
    assert ks.opcode("HMMA.16816.F32.BF16 R32, R32, R40, RZ") == "HMMA"
    assert ks.opcode("@!UP1 BRA 0x40") == "BRA"


def test_innermost_loops_and_their_counts():
    ins = ks.parse(SASS)
    assert [a for a, _ in ins] == list(range(0, 0xA0, 0x10))
    # 0x40-0x70 lies inside 0x10-0x80: only the inner one is reported.
    assert [(ins[s][0], ins[e][0]) for s, e in ks.inner_loops(ins)] == [(0x40, 0x70)]
    lines = ks.summary(ins)
    assert lines[0] == "10 instructions, 1 matrix, 2 divisions"
    assert lines[1].startswith("  loop 0x0040-0x0070: 4 instructions, 1 matrix, 1 divisions (")
