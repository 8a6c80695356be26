//! Device, stream and kernels: probing for a usable GPU, compiling `kernels/*.cu` with NVRTC to
//! a CUBIN for sm_90a (cached on disk by source hash), and a small launch helper.
//!
//! Why CUBIN and not PTX: no driver-side PTX JIT at start-up and no PTX-ISA-vs-driver version
//! trap when a newer libnvrtc is picked up (ecosystem.md §1.1). cudarc's safe NVRTC API only
//! returns PTX, so the CUBIN is fetched through `cudarc::nvrtc::sys`.

use anyhow::{anyhow, bail, Context as _, Result};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};
use std::collections::HashMap;
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::Arc;

/// Code shared by every module (prepended, so NVRTC needs no include path and no CUDA headers).
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel source: (module name, source, entry points).
pub const MODULES: &[(&str, &str, &[&str])] = &[
    (
        "gemv",
        include_str!("../../../kernels/gemv.cu"),
        &["gemv_q", "gemv_tc", "embed_q"],
    ),
    (
        "gdn",
        include_str!("../../../kernels/gdn.cu"),
        &["gdn_step"],
    ),
    (
        "attention",
        include_str!("../../../kernels/attention.cu"),
        &[
            "attn_prep",
            "attn_split_256",
            "attn_split_128",
            "attn_split_64",
            "attn_split_reg_256",
            "attn_split_reg_128",
            "attn_split_reg_64",
            "attn_prep_bf16",
            "attn_split_256_bf16",
            "attn_split_128_bf16",
            "attn_split_64_bf16",
            "attn_split_reg_256_bf16",
            "attn_split_reg_128_bf16",
            "attn_split_reg_64_bf16",
            "attn_combine",
        ],
    ),
    (
        "moe",
        include_str!("../../../kernels/moe.cu"),
        &["moe_gate_up", "moe_down", "moe_gate_up_tc", "moe_down_tc"],
    ),
    (
        "sample",
        include_str!("../../../kernels/sample.cu"),
        &["argmax_next"],
    ),
];

/// The only architecture we build for: sm_90a cubins load on compute capability 9.0 exactly.
pub const ARCH: &str = "sm_90a";

fn nvrtc_options() -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={ARCH}"),
        "-std=c++17".into(),
        "-lineinfo".into(),
    ];
    // Measurement knob: extra NVRTC options (e.g. `-DPDL_TRIGGER=2 -DMOE_DOWN_PF=0`); part of
    // the cubin cache key like every option.
    if let Ok(extra) = std::env::var("LILY_CUDA_NVRTC_DEFS") {
        o.extend(extra.split_whitespace().map(String::from));
    }
    o
}

/// True when libnvrtc can be loaded (the CI compile check skips otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its standard names.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// True when the CUDA driver library can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library by its standard names.
    unsafe { sys::is_culib_present() }
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

/// Compiles one source string to a CUBIN for [`ARCH`]; the error carries NVRTC's log.
pub fn compile_cubin(name: &str, src: &str) -> Result<Vec<u8>> {
    let csrc =
        CString::new(src).map_err(|_| anyhow!("{name}: kernel source contains a NUL byte"))?;
    let cname = CString::new(format!("{name}.cu")).unwrap();
    let prog = nvrtc_result::create_program(&csrc, Some(&cname))
        .map_err(|e| anyhow!("{name}: nvrtcCreateProgram: {e:?}"))?;
    let opts = nvrtc_options();
    // SAFETY: `prog` is a live program until destroy_program below.
    let compiled = unsafe { nvrtc_result::compile_program(prog, &opts) };
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

/// `$LILY_CACHE_DIR` or `~/.cache/lily/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("LILY_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    dirs::cache_dir().map(|d| d.join("lily").join("kernels"))
}

/// CUBIN of one module, from the on-disk cache when the source, options and NVRTC version match.
/// Cache problems are never fatal: we just compile.
pub fn cubin_cached(name: &str, src: &str) -> Result<Vec<u8>> {
    let (maj, min) = nvrtc_version().unwrap_or((0, 0));
    let opts = nvrtc_options().join(" ");
    let key = fnv64(&[
        src.as_bytes(),
        opts.as_bytes(),
        format!("nvrtc {maj}.{min}").as_bytes(),
    ]);
    let path = cache_dir().map(|d| d.join(format!("{name}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_cubin(name, src)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &cubin).is_ok() {
                    let _ = std::fs::rename(&tmp, p);
                }
            }
        }
    }
    Ok(cubin)
}

/// One kernel argument (raw device pointers keep launches free of borrow juggling; all buffers
/// outlive the stream work because the backend owns them and synchronises before freeing).
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    P(u64),
    I(i32),
    F(f32),
}

/// The device, its stream and the loaded kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub sms: u32,
    pub name: String,
    funcs: HashMap<&'static str, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
    /// Programmatic dependent launch for the decode kernels (`Gpu::launch`): on unless
    /// `LILY_CUDA_PDL=0`. Every kernel launched through `Gpu::launch` executes
    /// `griddepcontrol.wait` before touching anything the previous kernel writes, so either
    /// setting is correct. Since the tensor-core decode kernels issue their weight loads into
    /// registers before that wait, the next kernel's loads overlap the current one's tail:
    /// 471.7 vs 436.7 tok/s decode at 4K, 482.2 vs 447.1 at 256 on the H200, same digests
    /// (2026-11-29; it was neutral when the kernels only prefetched into L2).
    pdl: std::sync::atomic::AtomicBool,
    /// Decode attention uses the cp.async-tiled split kernel (`attn_split_{hd}`) unless
    /// `LILY_CUDA_ATTN_TILED=0` (then the register-streaming `attn_split_reg_{hd}`).
    pub attn_tiled: bool,
    /// Decode GEMVs and MoE experts on the tensor cores (`gemv_tc`, `moe_*_tc`) wherever the
    /// matrices are 4-bit with group 64, unless `LILY_CUDA_DECODE_TC=0` (then the CUDA-core
    /// `gemv_q` / `moe_gate_up` / `moe_down` everywhere).
    pub decode_tc: bool,
    /// Sets of fewer 16-row tiles than this stay on `gemv_q` (`LILY_CUDA_GEMV_TC_MIN_TILES`,
    /// default 256: the 2,048-row out-projections, 128 tiles, measured faster there; tests set 0
    /// so the tiny model's small sets run the tensor-core kernel too).
    gemv_tc_min_tiles: std::sync::atomic::AtomicUsize,
}

impl Gpu {
    /// Opens GPU 0, checks it is Hopper (sm_90) and loads every kernel. Errors are one line.
    pub fn open() -> Result<Self> {
        if !driver_available() {
            bail!("no NVIDIA driver found (libcuda.so could not be loaded)");
        }
        let count = CudaContext::device_count()
            .map_err(|e| anyhow!("CUDA driver present but not usable: {e:?}"))?;
        if count < 1 {
            bail!("the NVIDIA driver reports no GPU");
        }
        let ctx = CudaContext::new(0)
            .map_err(|e| anyhow!("cannot create a CUDA context on GPU 0: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| anyhow!("cannot query GPU 0: {e:?}"))?;
        if cc != (9, 0) {
            bail!("GPU 0 ({name}) has compute capability {}.{}; the CUDA backend needs Hopper (sm_90: H100/H200)", cc.0, cc.1);
        }
        if !nvrtc_available() {
            bail!("libnvrtc (CUDA 13 NVRTC) could not be loaded; it is needed to compile the kernels (set LD_LIBRARY_PATH to the CUDA lib64)");
        }
        // One stream, ordered by hand: per-slice event tracking only adds work (and would be
        // recorded into graphs).
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default stream: the decode step is captured into a
        // CUDA graph, which the legacy stream does not allow.
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e:?}"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(132)
            .max(1) as u32;
        let mut funcs = HashMap::new();
        let mut modules = Vec::new();
        for (mname, src, entries) in MODULES {
            let cubin = cubin_cached(mname, &module_source(src))?;
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| anyhow!("loading kernels/{mname}.cu: {e:?}"))?;
            for &e in entries.iter() {
                let f = module.load_function(e).map_err(|err| {
                    anyhow!("kernel {e} missing from kernels/{mname}.cu: {err:?}")
                })?;
                funcs.insert(e, f);
            }
            modules.push(module);
        }
        // The tiled split-KV kernels stage K/V through more than 48 KiB of shared memory.
        for hd in [64usize, 128, 256] {
            for bf16 in [false, true] {
                let name = format!("attn_split_{hd}{}", super::kernels::kv_suffix(bf16));
                funcs[name.as_str()]
                    .set_attribute(
                        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        super::kernels::attn_tiled_smem(hd) as i32,
                    )
                    .map_err(|e| anyhow!("{name}: shared memory opt-in: {e:?}"))?;
            }
        }
        let attn_tiled = std::env::var("LILY_CUDA_ATTN_TILED")
            .map(|v| v != "0")
            .unwrap_or(true);
        let decode_tc = std::env::var("LILY_CUDA_DECODE_TC")
            .map(|v| v != "0")
            .unwrap_or(true);
        let gemv_tc_min_tiles = std::env::var("LILY_CUDA_GEMV_TC_MIN_TILES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256usize);
        Ok(Gpu {
            decode_tc,
            gemv_tc_min_tiles: std::sync::atomic::AtomicUsize::new(gemv_tc_min_tiles),
            ctx,
            stream,
            sms,
            name,
            funcs,
            _modules: modules,
            attn_tiled,
            pdl: std::sync::atomic::AtomicBool::new(
                std::env::var("LILY_CUDA_PDL").map(|v| v != "0").unwrap_or(true),
            ),
        })
    }

    pub fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .with_context(|| format!("kernel {name} not loaded"))
    }

    /// Launches decode kernel `name` on the stream, as a programmatic dependent launch when PDL
    /// is on (the kernels in gemv/gdn/attention/moe/sample.cu all wait with
    /// `griddepcontrol.wait` before reading their inputs).
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self.func(name)?;
        launch_ex(&self.stream, f, name, grid, block, smem, args, self.pdl())
    }

    /// Whether decode kernels are launched with programmatic dependent launch.
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// See `gemv_tc_min_tiles` (tests: 0 puts every 4-bit set on the tensor-core GEMV).
    pub fn set_gemv_tc_min_tiles(&self, tiles: usize) {
        self.gemv_tc_min_tiles
            .store(tiles, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn gemv_tc_min_tiles(&self) -> usize {
        self.gemv_tc_min_tiles
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns programmatic dependent launch of the decode kernels on or off (graphs captured
    /// before keep what they were captured with).
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, std::sync::atomic::Ordering::Relaxed)
    }

    /// An event recorded on the stream now (timing marks of the decode and prefill profiles).
    pub fn record_event(&self) -> Result<cudarc::driver::CudaEvent> {
        let ev = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| anyhow!("{e:?}"))?;
        ev.record(&self.stream).map_err(|e| anyhow!("{e:?}"))?;
        Ok(ev)
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA error during the forward pass: {e:?}"))
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| anyhow!("cuMemGetInfo: {e:?}"))
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(|e| {
            anyhow!(
                "upload of {} bytes failed: {e:?}",
                std::mem::size_of_val(data)
            )
        })
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| anyhow!("device allocation of {n} elements failed: {e:?}"))
    }
}

/// Launches kernel `f` (named `name` for errors) on `stream` with a 1-D block: the one launch
/// routine of the backend (decode wrappers and the prefill module alike).
pub fn launch_on(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
) -> Result<()> {
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::P(p) => b.arg(p),
            Arg::I(i) => b.arg(i),
            Arg::F(x) => b.arg(x),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: every kernel's argument list is built by its Rust wrapper (kernels.rs, prefill.rs)
    // to match the `extern "C"` signature; pointers are live device allocations owned by the
    // backend that outlive the stream work.
    unsafe { b.launch(cfg) }.map_err(|e| anyhow!("launching {name}: {e:?}"))?;
    Ok(())
}

/// Like [`launch_on`], through `cuLaunchKernelEx`; with `pdl` the launch carries
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, so the kernel may start while the
/// previous kernel of the stream is still running (once all of its blocks have executed
/// `griddepcontrol.launch_dependents` or exited). The kernel must then execute
/// `griddepcontrol.wait` before reading anything the previous kernels write (and before writing
/// anything they read). Under stream capture the graph edge becomes a programmatic one.
#[allow(clippy::too_many_arguments)]
pub fn launch_ex(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
    pdl: bool,
) -> Result<()> {
    use std::ffi::c_void;
    // Argument values at stable addresses for the duration of the call.
    let vals: Vec<Arg> = args.to_vec();
    let mut params: Vec<*mut c_void> = vals
        .iter()
        .map(|a| match a {
            Arg::P(p) => p as *const u64 as *mut c_void,
            Arg::I(i) => i as *const i32 as *mut c_void,
            Arg::F(x) => x as *const f32 as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute is valid plain data; the union member we set is the one the
    // attribute id selects.
    let mut attrs: [sys::CUlaunchAttribute; 1] = unsafe { std::mem::zeroed() };
    let mut n_attrs = 0usize;
    if pdl {
        attrs[n_attrs].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
        n_attrs += 1;
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: if n_attrs > 0 {
            attrs.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
        numAttrs: n_attrs as u32,
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| anyhow!("launching {name}: {e:?}"))?;
    // SAFETY: the argument list is built by the kernel's Rust wrapper (kernels.rs) to match its
    // `extern "C"` signature; `params` points into `vals`, both alive until the call returns
    // (the driver copies the values at launch); pointers are live device allocations owned by the
    // backend that outlive the stream work.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| anyhow!("launching {name}: {e:?}"))?;
    Ok(())
}

/// Raw device address of a slice (event tracking is off, so nothing is recorded).
pub fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}
