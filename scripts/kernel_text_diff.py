#!/usr/bin/env python3
"""kernel_text_diff: did a change alter the machine code of any CUDA kernel?

Compiles every kernel module (`kernels/*.cu`) of two versions of the repository with NVRTC exactly
as the backend does (src/backend/cuda/nvrtc.rs: `kernels/common.cuh` prepended as
"{common}\\n// ---- module ----\\n{src}", options --gpu-architecture=sm_90a -std=c++17 -lineinfo)
and compares each kernel's `.text.<kernel>` ELF section byte for byte, matching kernels by name
across modules (so kernels may move between files). Also compared, and reported but not gating:
`.nv.info.<kernel>` (symbol indices mapped to names), `.rela.text.<kernel>` (relocations with
symbol names), `.nv.shared.<kernel>` and `.nv.constant0.<kernel>`.

Usage (from the repository root, or with --repo DIR):
    scripts/kernel_text_diff.py                    # HEAD vs the working tree
    scripts/kernel_text_diff.py OLD_REF            # OLD_REF vs the working tree
    scripts/kernel_text_diff.py OLD_REF NEW_REF    # two commits

Exit status: 0 when every kernel present on both sides has identical .text (kernels only on one
side are listed, not counted), 1 when some differ or none were compared, 2 when it could not
compare (no NVRTC, a git error, a compile error).

Needs libnvrtc (CUDA 13): the pip wheel `pip install nvidia-cuda-nvrtc==13.0.88`, else
libnvrtc.so.13 on the loader path. No GPU. Cubins are cached in /tmp/kernel_text_diff_cubins/.
"""
import argparse, ctypes, glob, hashlib, os, struct, subprocess, sys

OPTS = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"-lineinfo"]
CACHE = "/tmp/kernel_text_diff_cubins"


def die(msg):
    print(f"kernel_text_diff: {msg}", file=sys.stderr)
    sys.exit(2)


# ---- NVRTC ----

def load_nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel, else libnvrtc.so.13 on the loader path."""
    cands = []
    try:
        import nvidia
        cands = [p for d in nvidia.__path__ for p in [os.path.join(d, "cu13", "lib", "libnvrtc.so.13")]
                 if os.path.exists(p)]
    except ImportError:
        pass
    for c in cands + ["libnvrtc.so.13"]:
        try:
            # libnvrtc dlopens libnvrtc-builtins by name: load the wheel's copy first so it is found
            if os.path.dirname(c):
                for b in glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so.*")):
                    ctypes.CDLL(b)
            lib = ctypes.CDLL(c)
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return lib, f"{major.value}.{minor.value}", c
    die("libnvrtc not found: `python3 -m pip install nvidia-cuda-nvrtc==13.0.88`, "
        "or put libnvrtc.so.13 on LD_LIBRARY_PATH")


def compile_cubin(lib, name, src):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None):
        die(f"{name}: nvrtcCreateProgram failed")
    try:
        if lib.nvrtcCompileProgram(prog, len(OPTS), (ctypes.c_char_p * len(OPTS))(*OPTS)):
            n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
            die(f"NVRTC failed to compile kernels/{name}.cu:\n{log.value.decode(errors='replace')}")
        n = ctypes.c_size_t(); lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cubin_cached(nvrtc, name, src):
    lib, version, _ = nvrtc
    key = hashlib.sha256(b"\0".join([version.encode(), *OPTS, name.encode(), src.encode()])).hexdigest()[:16]
    path = os.path.join(CACHE, f"{name}-{key}.cubin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    cub = compile_cubin(lib, name, src)
    os.makedirs(CACHE, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(cub)
    os.replace(tmp, path)
    return cub


# ---- ELF (64-bit little-endian cubin) ----

def parse_elf(elf):
    """(section name -> bytes, symbol index -> name); SHT_NOBITS sections stand as their size."""
    if elf[:5] != b"\x7fELF\x02":
        die("NVRTC output is not a 64-bit ELF")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, align, entsize)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    cstr = lambda off: elf[off:elf.index(b"\0", off)].decode()
    names = [cstr(hdrs[shstrndx][4] + h[0]) for h in hdrs]
    secs = {n: b"(nobits %d)" % h[5] if h[1] == 8 else elf[h[4]:h[4] + h[5]] for n, h in zip(names, hdrs)}
    syms = []
    for h in (h for h in hdrs if h[1] == 2):  # SHT_SYMTAB
        strtab = hdrs[h[6]][4]
        for i in range(h[5] // 24):
            st_name, st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", elf, h[4] + 24 * i)
            n = cstr(strtab + st_name)
            if not n and st_info & 0xF == 3 and st_shndx < len(names):  # STT_SECTION
                n = "SECTION:" + names[st_shndx]
            syms.append(n)
    return secs, syms


NV_INFO_SYMATTR = {0x0A, 0x10, 0x11, 0x12, 0x23, 0x2F}  # attributes whose value starts with a u32 symbol index


def nv_info(secs, syms, sec):
    """The .nv.info records of one kernel, symbol indices replaced by symbol names."""
    b, i, out = secs.get(sec), 0, []
    if b is None:
        return None
    while i < len(b):
        fmt, attr = b[i], b[i + 1]; i += 2
        if fmt in (1, 2, 3):  # fixed 2-byte value (records are 4-byte aligned)
            val = b[i:i + 2]; i += 2
        elif fmt == 4:  # u16 size, then the value
            n, = struct.unpack_from("<H", b, i); val = b[i + 2:i + 2 + n]; i += 2 + n
        else:
            return ("unparsed", b.hex())
        if attr in NV_INFO_SYMATTR and len(val) >= 4:
            s, = struct.unpack_from("<I", val)
            out.append((attr, syms[s] if s < len(syms) else s, val[4:].hex()))
        else:
            out.append((attr, val.hex()))
    return out


def rela(secs, syms, sec):
    """Relocations of one kernel's code: (offset, type, symbol name, addend)."""
    b = secs.get(sec, b"")
    return [(off, info & 0xFFFFFFFF, syms[info >> 32] if info >> 32 < len(syms) else info >> 32, add)
            for off, info, add in struct.iter_unpack("<QQq", b[:len(b) // 24 * 24])]


# ---- sources ----

def git(repo, *args):
    r = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
    if r.returncode:
        die(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def sources(repo, ref):
    """(common.cuh, [(module name, source)]) of a git ref, or of the working tree when ref is None."""
    if ref is None:
        read = lambda p: open(os.path.join(repo, p), encoding="utf-8").read()
        paths = sorted(os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, "kernels", "*.cu")))
    else:
        read = lambda p: git(repo, "show", f"{ref}:{p}")
        paths = [p for p in git(repo, "ls-tree", "--name-only", ref, "kernels/").split() if p.endswith(".cu")]
    if not paths:
        die(f"no kernels/*.cu in {ref or 'the working tree'}")
    return read("kernels/common.cuh"), [(os.path.basename(p)[:-3], read(p)) for p in paths]


def build(nvrtc, label, repo, ref):
    """kernel name -> (module, sections, symbols) for every .text.<kernel> of every module."""
    common, mods = sources(repo, ref)
    kernels = {}
    for name, src in mods:
        cub = cubin_cached(nvrtc, name, f"{common}\n// ---- module ----\n{src}")
        secs, syms = parse_elf(cub)
        ks = [s[len(".text."):] for s in secs if s.startswith(".text.")]
        for k in ks:
            if k in kernels:
                die(f"{label}: kernel {k} in both {kernels[k][0]}.cu and {name}.cu")
            kernels[k] = (name, secs, syms)
        print(f"{label} {name}: {len(cub)} bytes, {len(ks)} kernels", file=sys.stderr)
    return kernels


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_ref", nargs="?", default="HEAD", help="git ref (default HEAD)")
    ap.add_argument("new_ref", nargs="?", help="git ref (default: the working tree)")
    ap.add_argument("--repo", default=".", help="repository root (default .)")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.repo, "kernels", "common.cuh")):
        die(f"{os.path.abspath(a.repo)} has no kernels/common.cuh: run from the repository root or pass --repo DIR")
    for ref in (a.old_ref, a.new_ref):
        if ref is not None:
            if subprocess.run(["git", "-C", a.repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                              capture_output=True).returncode:
                die(f"{ref}: not a commit in {os.path.abspath(a.repo)}")
    nvrtc = load_nvrtc()
    print(f"NVRTC {nvrtc[1]} ({nvrtc[2]})", file=sys.stderr)
    old = build(nvrtc, "old", a.repo, a.old_ref)
    new = build(nvrtc, "new", a.repo, a.new_ref)

    both = sorted(set(old) & set(new))
    rows, diff = [], []
    for k in both:
        (om, osecs, osyms), (nm, nsecs, nsyms) = old[k], new[k]
        ta, tb = osecs[".text." + k], nsecs[".text." + k]
        other = [name for name, same in [
            ("nv.info", nv_info(osecs, osyms, ".nv.info." + k) == nv_info(nsecs, nsyms, ".nv.info." + k)),
            ("rela.text", rela(osecs, osyms, ".rela.text." + k) == rela(nsecs, nsyms, ".rela.text." + k)),
            ("nv.shared", osecs.get(".nv.shared." + k) == nsecs.get(".nv.shared." + k)),
            ("nv.constant0", osecs.get(".nv.constant0." + k) == nsecs.get(".nv.constant0." + k))] if not same]
        if ta != tb:
            diff.append(k)
        rows.append((k, om, nm, len(ta), len(tb), ta == tb, other, first_diff(ta, tb)))

    print(f"old = {a.old_ref}, new = {a.new_ref or 'working tree'}")
    if rows:
        w = max(len(r[0]) for r in rows)
        mw = max(10, *(len(r[1]) for r in rows), *(len(r[2]) for r in rows))
        print(f"{'kernel':<{w}}  {'old module':<{mw}} {'new module':<{mw}} {'old bytes':>9} {'new bytes':>9}  text  other sections")
        for k, om, nm, la, lb, same, other, off in rows:
            print(f"{k:<{w}}  {om:<{mw}} {nm:<{mw}} {la:>9} {lb:>9}  {'same' if same else 'DIFF'}  "
                  f"{','.join(other) or 'same'}" + ("" if same else f"  (first differing byte: {off:#x})"))
    print(f"\ncompared {len(both)} kernels: {len(both) - len(diff)} identical .text, {len(diff)} different: {diff}")
    print("only in old:", sorted(set(old) - set(new)))
    print("only in new:", sorted(set(new) - set(old)))
    return 0 if both and not diff else 1


if __name__ == "__main__":
    sys.exit(main())
