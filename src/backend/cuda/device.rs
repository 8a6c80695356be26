//! The device and its stream: probing for a usable GPU, memory helpers, and the one launch path
//! (every kernel through the registry, as a programmatic dependent where it waits for its
//! predecessor).

use super::nvrtc::nvrtc_available;
use super::registry::{Kernel, Registry};
use super::timeline::Timeline;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// One kernel argument (raw device pointers keep launches free of borrow juggling; all buffers
/// outlive the stream work because the backend owns them and synchronises before freeing).
#[derive(Clone, Debug)]
pub enum Arg {
    P(u64),
    I(i32),
    F(f32),
    /// A struct passed by value, as 8-byte words (the kernel's parameter may be shorter). Boxed,
    /// so the other arguments of every launch stay 16 bytes.
    S(Box<[u64; ARG_STRUCT_WORDS]>),
}

/// Most 8-byte words of a struct argument ([`Arg::S`]).
pub const ARG_STRUCT_WORDS: usize = 64;

/// Entries of a segment table ([`segment_table`]).
pub const TABLE_SEGS: usize = 16;

/// A segment table passed by value (the prefill's `ConvSegs`, `ScanSegs` and `AttnSegs`): `P`
/// arrays of [`TABLE_SEGS`] pointers, then `I` arrays of as many i32 (two per word), segment i at
/// index i of each; up to [`TABLE_SEGS`] segments, the rest ignored.
pub fn segment_table<const P: usize, const I: usize>(segs: impl Iterator<Item = ([u64; P], [i32; I])>) -> Arg {
    const { assert!(TABLE_SEGS * (8 * P + 4 * I) <= ARG_STRUCT_WORDS * 8) };
    let mut w = [0u64; ARG_STRUCT_WORDS];
    for (i, (ptrs, ints)) in segs.take(TABLE_SEGS).enumerate() {
        for (a, p) in ptrs.into_iter().enumerate() {
            w[a * TABLE_SEGS + i] = p;
        }
        let half = 32 * (i % 2);
        for (a, v) in ints.into_iter().enumerate() {
            w[P * TABLE_SEGS + a * TABLE_SEGS / 2 + i / 2] |= (v as u32 as u64) << half;
        }
    }
    Arg::S(Box::new(w))
}

/// True when the CUDA driver library can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library by its standard names.
    unsafe { sys::is_culib_present() }
}

/// The device, its stream and its kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub sms: u32,
    pub name: String,
    kernels: Registry,
    /// Launch kernels that wait for their predecessor as programmatic dependents: their weight
    /// loads (issued before the wait) then overlap the previous kernel's tail. Results are the
    /// same either way.
    pdl: bool,
    /// The decode timeline's buffer and launch log (`LILY_CUDA_TIMELINE=1`).
    timeline: Option<Arc<Timeline>>,
}

impl Gpu {
    /// Opens GPU `device` (an index among the visible ones) and checks it is Hopper (sm_90); kernels load on first use
    /// ([`Gpu::load_all`] loads them now). Errors are one line.
    pub fn open(device: usize, pdl: bool) -> Result<Self> {
        if !driver_available() {
            bail!("no NVIDIA driver found (libcuda.so could not be loaded)");
        }
        let count = CudaContext::device_count()
            .map_err(|e| anyhow!("CUDA driver present but not usable: {e:?}"))?;
        if count < 1 {
            bail!("the NVIDIA driver reports no GPU");
        }
        if device >= count as usize {
            bail!("GPU {device} was asked for, but the NVIDIA driver reports {count} GPU(s) (numbered from 0 among CUDA_VISIBLE_DEVICES)");
        }
        let ctx = CudaContext::new(device)
            .map_err(|e| anyhow!("cannot create a CUDA context on GPU {device}: {e:?}"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| anyhow!("cannot query GPU {device}: {e:?}"))?;
        if cc != (9, 0) {
            bail!("GPU {device} ({name}) has compute capability {}.{}; the CUDA backend needs Hopper (sm_90: H100/H200)", cc.0, cc.1);
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
        Ok(Gpu { kernels: Registry::new(ctx.clone()), ctx, stream, sms, name, pdl, timeline: None })
    }

    /// Turns on the decode timeline (timeline.rs): before any kernel module loads, since every
    /// module is then compiled with its stamps.
    pub fn enable_timeline(&mut self) -> Result<()> {
        let t = Timeline::new(&self.stream)?;
        self.kernels.set_timeline(t.address(&self.stream), self.stream.clone());
        self.timeline = Some(Arc::new(t));
        Ok(())
    }

    /// The decode timeline, when on.
    pub fn timeline(&self) -> Option<&Arc<Timeline>> {
        self.timeline.as_ref()
    }

    /// Compiles and loads every kernel module now (start-up: NVRTC errors surface here, and no
    /// module loads during a graph capture).
    pub fn load_all(&self) -> Result<()> {
        self.kernels.load_all()
    }

    /// The loaded function of `k`, opted in to `smem` bytes of dynamic shared memory as its
    /// launches will be (occupancy queries).
    pub fn function(&self, k: Kernel, smem: u32) -> Result<CudaFunction> {
        self.kernels.function(k, smem)
    }

    /// Launches `k` on the stream (1-D blocks), as a programmatic dependent when PDL is on and the
    /// kernel waits for its predecessor.
    pub fn launch(&self, k: Kernel, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        self.launch_cluster(k, grid, block, smem, args, 1)
    }

    /// [`Gpu::launch`] in thread block clusters of `cluster` consecutive blocks along x (1: none;
    /// the grid's x a multiple of it, at most 8).
    pub fn launch_cluster(&self, k: Kernel, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg], cluster: u32) -> Result<()> {
        if cluster == 0 || cluster > 8 || !grid.0.is_multiple_of(cluster) {
            bail!("{}: clusters of {cluster} blocks do not tile a grid of {} blocks along x", k.name, grid.0);
        }
        let f = self.kernels.function(k, smem)?;
        launch_ex(&self.stream, &f, k.name, grid, block, smem, args, self.pdl && k.waits, cluster)?;
        if let Some(t) = &self.timeline {
            t.launched(k, grid);
        }
        Ok(())
    }

    /// Device-to-device copies on this stream by the SMs ([`DeviceCopy`]).
    pub fn device_copy(&self) -> Result<DeviceCopy> {
        Ok(DeviceCopy { f: self.kernels.function(COPY_WORDS16, 0)?, stream: self.stream.clone(), sms: self.sms })
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

    /// Zeroes `bytes` bytes at device address `p` (stream-ordered).
    pub fn zero(&self, p: u64, bytes: usize) -> Result<()> {
        self.fill(p, 0, bytes)
    }

    /// Sets `bytes` bytes at device address `p` to `byte` (stream-ordered).
    pub fn fill(&self, p: u64, byte: u8, bytes: usize) -> Result<()> {
        // SAFETY: callers pass the address and length of a live allocation they own.
        unsafe { cudarc::driver::result::memset_d8_async(p, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("device memset: {e:?}"))
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

/// Launches `f` (named `name` for errors) with a 1-D block through `cuLaunchKernelEx`: the one
/// launch routine of the backend. With `pdl` the launch carries
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, so the kernel may start while the
/// previous kernel of the stream is still running (once all of its blocks have executed
/// `griddepcontrol.launch_dependents` or exited). The kernel must then execute
/// `griddepcontrol.wait` before reading anything the previous kernels write (and before writing
/// anything they read). Under stream capture the graph edge becomes a programmatic one.
#[allow(clippy::too_many_arguments)]
fn launch_ex(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
    pdl: bool,
    cluster: u32,
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
            Arg::S(w) => w.as_ptr() as *mut c_void,
        })
        .collect();
    // SAFETY: an all-zero attribute is valid plain data; the union member we set is the one the
    // attribute id selects.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n_attrs = 0usize;
    if pdl {
        attrs[n_attrs].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
        n_attrs += 1;
    }
    if cluster > 1 {
        attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n_attrs].value.clusterDim.x = cluster;
        attrs[n_attrs].value.clusterDim.y = 1;
        attrs[n_attrs].value.clusterDim.z = 1;
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
    // SAFETY: the argument list is built by the kernel's launcher (one per op family) to match its
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

/// Device-to-device copies on the SMs (`copy_words16`) in a stream's order: the sequence
/// memory's snapshot copies, which on a copy engine would queue behind the long device-to-host
/// copies of the prefix cache's host tier on another stream.
pub struct DeviceCopy {
    f: CudaFunction,
    stream: Arc<CudaStream>,
    sms: u32,
}

const COPY_WORDS16: Kernel = Kernel::ordered(&super::registry::OPS, "copy_words16");

impl DeviceCopy {
    /// Queues `dst[..bytes] = src[..bytes]` on the stream: by the kernel where both addresses
    /// and the length are whole 16-byte words, else by the driver's copy.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if !(dst | src | bytes as u64).is_multiple_of(16) {
            // SAFETY: the caller passes live device ranges of `bytes` bytes.
            return unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(|e| anyhow!("device copy failed: {e:?}"));
        }
        let words = bytes / 16;
        let blocks = words.div_ceil(256).min(self.sms as usize * 8) as u32;
        // The count is an 8-byte parameter, passed as P passes addresses.
        let args = [Arg::P(src), Arg::P(dst), Arg::P(words as u64)];
        launch_ex(&self.stream, &self.f, COPY_WORDS16.name, (blocks, 1, 1), 256, 0, &args, false, 1)
    }
}

/// Raw device address of a slice (event tracking is off, so nothing is recorded).
pub fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}
