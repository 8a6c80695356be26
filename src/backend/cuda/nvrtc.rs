//! NVRTC: `kernels/*.cu` to a CUBIN for sm_90a, cached on disk by source, options and NVRTC
//! version.
//!
//! Why CUBIN and not PTX: no driver-side PTX JIT at start-up and no PTX-ISA-vs-driver version
//! trap when a newer libnvrtc is picked up (ecosystem.md §1.1). cudarc's safe NVRTC API only
//! returns PTX, so the CUBIN is fetched through `cudarc::nvrtc::sys`.

use anyhow::{anyhow, bail, Result};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// Code shared by every module (prepended, so NVRTC needs no include path and no CUDA headers).
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// The only architecture we build for: sm_90a cubins load on compute capability 9.0 exactly.
pub const ARCH: &str = "sm_90a";

/// The runtime build: optimised, with line info for the profilers.
fn nvrtc_options() -> Vec<String> {
    with_arch("-lineinfo")
}

/// The compile check's build (tests/cuda_compile.rs, CI without a GPU): device debug (-G) skips
/// the optimisers, a third of the time on CI's two cores, and still parses every kernel,
/// instantiates every template, assembles every inline PTX statement for sm_90a and emits every
/// entry point.
fn check_options() -> Vec<String> {
    with_arch("--device-debug")
}

fn with_arch(last: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={ARCH}"), "-std=c++17".into(), last.into()]
}

/// True when libnvrtc can be loaded (the CI compile check skips otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its standard names.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((a, b))
}

/// Full source of one module as compiled.
pub fn module_source(src: &str) -> String {
    format!("{COMMON}\n// ---- module ----\n{src}")
}

/// [`module_source`] with the decode timeline's stamps compiled in (timeline.rs).
pub fn timeline_source(src: &str) -> String {
    format!("#define LILY_TIMELINE\n{}", module_source(src))
}

/// Compiles one source string to a CUBIN for [`ARCH`]; the error carries NVRTC's log.
pub fn compile_cubin(name: &str, src: &str) -> Result<Vec<u8>> {
    compile_with(name, src, &nvrtc_options())
}

/// [`compile_cubin`] with the compile check's options (see `check_options`).
pub fn check_compile_cubin(name: &str, src: &str) -> Result<Vec<u8>> {
    compile_with(name, src, &check_options())
}

fn compile_with(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>> {
    let csrc =
        CString::new(src).map_err(|_| anyhow!("{name}: kernel source contains a NUL byte"))?;
    let cname = CString::new(format!("{name}.cu")).unwrap();
    let prog = nvrtc_result::create_program(&csrc, Some(&cname))
        .map_err(|e| anyhow!("{name}: nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program until destroy_program below.
    let compiled = unsafe { nvrtc_result::compile_program(prog, opts) };
    let out = (|| -> Result<Vec<u8>> {
        if let Err(e) = compiled {
            // SAFETY: as above.
            let log = unsafe { nvrtc_result::get_program_log(prog) }.unwrap_or_default();
            let log: Vec<u8> = log
                .iter()
                .map(|&c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            bail!(
                "NVRTC failed to compile kernels/{name}.cu for {ARCH} ({e:?}):\n{}",
                String::from_utf8_lossy(&log)
            );
        }
        let mut size = 0usize;
        // SAFETY: as above; `size` is an out-parameter.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| anyhow!("{name}: nvrtcGetCUBINSize: {e:?}"))?;
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has the size NVRTC reported.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) }
            .result()
            .map_err(|e| anyhow!("{name}: nvrtcGetCUBIN: {e:?}"))?;
        Ok(buf)
    })();
    // SAFETY: destroyed once.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    out
}

/// FNV-1a 64: a stable cache key (std's hasher is not stable across Rust releases).
fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for p in parts {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x100000001b3);
    }
    h
}

/// `kernels/` under Lily's cache root (`$LILY_CACHE_DIR`, else `~/.cache/lily`).
pub fn cache_dir() -> PathBuf {
    crate::engine::default_model::cache_dir().join("kernels")
}

/// CUBIN of one module, from the on-disk cache when the source, options and NVRTC version match.
/// Cache problems are never fatal: we just compile.
pub fn cubin_cached(name: &str, src: &str) -> Result<Vec<u8>> {
    let (maj, min) = nvrtc_version().unwrap_or((0, 0));
    let opts = nvrtc_options().join(" ");
    let key = fnv64(&[src.as_bytes(), opts.as_bytes(), format!("nvrtc {maj}.{min}").as_bytes()]);
    let path = cache_dir().join(format!("{name}-{key:016x}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok(bytes);
        }
    }
    let cubin = compile_cubin(name, src)?;
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        // A name of its own per write: two compilations of one module in one process (backends
        // opened side by side) must not write into each other's file before the rename.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let tmp = path.with_extension(format!("tmp{}-{}", std::process::id(), WRITES.fetch_add(1, Ordering::Relaxed)));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}
