//! cuBLAS for the dense GEMMs of long prefills, loaded at run time like the driver.
//!
//! Why: at thousands of tokens the dense projections (GDN in/out, attention q/k/v/o, shared
//! expert) are compute-bound, and cuBLAS's bf16 tensor-core GEMMs run them several times faster
//! than our dequantising `pf_gemm_tc` (docs/cuda-prefill.md). The weights are dequantised once per
//! chunk into a bf16 scratch (same rounding as `pf_gemm_tc`'s tiles) and the library multiplies.
//! The routed experts stay on our grouped kernels: cuBLAS's grouped GEMM needs the per-expert
//! token counts on the host, i.e. a synchronisation inside every layer. Decode never calls this.
//!
//! Off with `LILY_CUDA_CUBLAS=0`; without libcublas the prefill keeps its own kernels (one
//! notice on stderr).

use anyhow::{anyhow, Result};
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::CudaStream;
use std::ffi::c_void;
use std::sync::Mutex;

/// One cuBLAS handle bound to the backend's stream.
pub struct Blas {
    handle: Mutex<Handle>,
}

/// The raw handle. cuBLAS handles may be used from any thread as long as calls do not overlap,
/// which the mutex guarantees.
struct Handle(sys::cublasHandle_t);
// SAFETY: see above; the handle is only touched under the mutex.
unsafe impl Send for Handle {}

impl Blas {
    /// Opens cuBLAS on `stream`, or `None` when it cannot be loaded (then the reason is printed).
    pub fn open(stream: &CudaStream) -> Option<Self> {
        match Self::try_open(stream) {
            Ok(b) => Some(b),
            Err(e) => {
                eprintln!("lily: prefill without cuBLAS ({e}); using the built-in GEMM kernels");
                None
            }
        }
    }

    fn try_open(stream: &CudaStream) -> Result<Self> {
        // SAFETY: only tries to dlopen the library by its standard names.
        if !unsafe { sys::is_culib_present() } {
            return Err(anyhow!("libcublas.so not found"));
        }
        let h = blas::create_handle().map_err(|e| anyhow!("cublasCreate: {e:?}"))?;
        // Owned from here on: an error below destroys the handle (Drop).
        let b = Blas {
            handle: Mutex::new(Handle(h)),
        };
        // SAFETY: `h` is a live handle and the stream outlives the backend that owns both.
        unsafe { blas::set_stream(h, stream.cu_stream() as _) }
            .map_err(|e| anyhow!("cublasSetStream: {e:?}"))?;
        Ok(b)
    }

    /// `y[t][0..rows] (+)= W · x[t]` for `t < ntok`: W `[rows][cols]` and x `[ntok][cols]` in
    /// bf16 (on the tensor cores, f32 accumulation), y f32 with row stride `ldy`, or bf16 with
    /// `y_bf16` (the f32 sums rounded once).
    ///
    /// Row-major `y[ntok][ldy] = x[ntok][cols] · W[rows][cols]ᵀ` is column-major
    /// `y'[rows][ntok] = Wᵀ' · x'` with W read transposed: m = rows, n = ntok, k = cols.
    pub fn gemm(
        &self,
        w: u64,
        x: u64,
        y: u64,
        (rows, cols, ntok, ldy): (usize, usize, usize, usize),
        accumulate: bool,
        y_bf16: bool,
    ) -> Result<()> {
        let (ab_type, compute) = (sys::cudaDataType::CUDA_R_16BF, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F);
        let int = |v: usize| i32::try_from(v).map_err(|_| anyhow!("GEMM dimension {v} too large"));
        let (m, n, k, ldc) = (int(rows)?, int(ntok)?, int(cols)?, int(ldy)?);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        let y_type = if y_bf16 { sys::cudaDataType::CUDA_R_16BF } else { sys::cudaDataType::CUDA_R_32F };
        // SAFETY: w, x, y are live device allocations of at least rows*cols, ntok*cols and
        // ntok*ldy elements (the callers size them so); alpha/beta are host scalars that outlive
        // the call (cuBLAS reads them before returning in host pointer mode).
        unsafe {
            blas::gemm_ex(
                h.0,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                ab_type,
                k,
                x as *const c_void,
                ab_type,
                k,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                y_type,
                ldc,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cublasGemmEx ({rows}x{cols} by {ntok} tokens): {e:?}"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let h = self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handle is live and dropped once.
        let _ = unsafe { blas::destroy_handle(h.0) };
    }
}
