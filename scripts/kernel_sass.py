#!/usr/bin/env python3
"""kernel_sass: a CUDA kernel's machine code as the backend compiles it, summarised per loop.

Compiles the module that holds KERNEL (`kernels/*.cu` with `kernels/common.cuh` prepended, NVRTC
options as src/backend/cuda/nvrtc.rs, through scripts/kernel_text_diff.py's cached compile) with
ptxas's resource report, disassembles the kernel (cuobjdump + nvdisasm) and prints its registers
and spills, its instruction count, and each innermost loop: its instructions by opcode, its
matrix instructions and the integer divisions in it (I2F.RP: the reciprocal a division or modulo
by a run-time value starts with, some 25 instructions). A kernel whose pace is its instruction
stream (Nsight Compute's issue-active and pipe figures) gains from what this shows without a
GPU: the loop's instructions per matrix instruction before and after a change.

Usage (from the repository root):
    scripts/kernel_sass.py moe_tcr_f                # the working tree
    scripts/kernel_sass.py moe_tcr_f --ref HEAD     # a git ref
    scripts/kernel_sass.py moe_tcr_f --sass         # and the whole disassembly

Needs libnvrtc (CUDA 13, as scripts/kernel_text_diff.py) and cuobjdump + nvdisasm: the pip wheels
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` (13.2), or the tools on PATH. No GPU.
"""
import argparse
import collections
import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("kernel_text_diff", os.path.join(HERE, "kernel_text_diff.py"))
ktd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ktd)

def die(msg):
    print(f"kernel_sass: {msg}", file=sys.stderr)
    sys.exit(2)


INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
MMA = ("HMMA", "HGMMA", "IMMA", "DMMA")


def parse(sass):
    """[(address, instruction text)] of one kernel's disassembly."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, sass.splitlines()) if m]


def opcode(text):
    """The opcode without predicate or modifiers: '@!P0 LDS.128 R4, [R2]' -> 'LDS'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def inner_loops(ins):
    """The innermost loops, as (first, last) instruction indices: the ranges a backward branch
    closes that hold no other such range."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = set()
    for i, (a, t) in enumerate(ins):
        if opcode(t) != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
            loops.add((at[int(m.group(1), 16)], i))
    return sorted(l for l in loops if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops))


def division(text):
    """Whether an instruction starts a division or modulo by a run-time value (I2F.RP)."""
    return "I2F" in text and ".RP" in text


def summary(ins):
    """One line per innermost loop and a total line."""
    out = [f"{len(ins)} instructions, {sum(opcode(t) in MMA for _, t in ins)} matrix, "
           f"{sum(division(t) for _, t in ins)} divisions"]
    for s, e in inner_loops(ins):
        body = [t for _, t in ins[s:e + 1]]
        ops = collections.Counter(map(opcode, body))
        mma = sum(ops[o] for o in MMA)
        divs = sum(map(division, body))
        mix = ", ".join(f"{o} {n}" for o, n in ops.most_common(8))
        out.append(f"  loop {ins[s][0]:#06x}-{ins[e][0]:#06x}: {len(body)} instructions, {mma} matrix, {divs} divisions ({mix})")
    return out


def tool(name):
    """cuobjdump / nvdisasm: on PATH, else from the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
        for d in nvidia.__path__:
            for p in glob.glob(os.path.join(d, "*", "bin", name)):
                return p
    except ImportError:
        pass
    die(f"{name} not found: `python3 -m pip install nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51`")


def ptxas_report(nvrtc, src, kernel):
    """ptxas's registers / spills lines for `kernel` (a compile with --ptxas-options=-v)."""
    lib = nvrtc[0]
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"module.cu", 0, None, None)
    opts = ktd.OPTS + [b"--ptxas-options=-v"]
    try:
        lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    lines = log.value.decode(errors="replace").splitlines()
    i = next((k for k, l in enumerate(lines) if f"entry function '{kernel}'" in l), None)
    keep = [l for l in lines[i + 1:i + 4] if "spill" in l or "Used" in l] if i is not None else []
    return [re.sub(r"^ptxas\s*(info\s*:|\.)\s*", "", l).strip() for l in keep]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel")
    ap.add_argument("--ref", help="git ref (default: the working tree)")
    ap.add_argument("--repo", default=".", help="repository root (default .)")
    ap.add_argument("--sass", action="store_true", help="print the whole disassembly too")
    a = ap.parse_args()
    nvrtc = ktd.load_nvrtc()
    common, mods = ktd.sources(a.repo, a.ref)
    for name, body in mods:
        src = f"{common}\n// ---- module ----\n{body}"
        cub = ktd.cubin_cached(nvrtc, name, src)
        if f".text.{a.kernel}".encode() not in cub:
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cub)
            f.flush()
            env = dict(os.environ, NVDISASM_PATH=os.path.dirname(tool("nvdisasm")))
            r = subprocess.run([tool("cuobjdump"), "-sass", "-fun", a.kernel, f.name], capture_output=True, text=True, env=env)
        if r.returncode:
            die(f"cuobjdump: {r.stderr.strip()}")
        print(f"{a.kernel} (kernels/{name}.cu, {a.ref or 'working tree'}): " + "; ".join(ptxas_report(nvrtc, src, a.kernel)))
        print("\n".join(summary(parse(r.stdout))))
        if a.sass:
            print(r.stdout)
        return
    die(f"no kernel {a.kernel} in kernels/*.cu of {a.ref or 'the working tree'}")


if __name__ == "__main__":
    main()
