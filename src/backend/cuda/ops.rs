//! Row-wise and elementwise operations of the layers (kernels/ops.cu), the CUDA side of
//! `cpu/ops.rs`. The decode step fuses its norms into the GEMVs (qmatmul.rs); these serve T tokens.

use super::device::{Arg, Gpu};
use super::registry::{Kernel, OPS};
use anyhow::{bail, Result};

const PF_RMSNORM: Kernel = Kernel::ordered(&OPS, "pf_rmsnorm");
const PF_SWIGLU: Kernel = Kernel::ordered(&OPS, "pf_swiglu");

/// Threads of the prefill's row norms, one block per row (NORM_THREADS in kernels/common.cuh), and
/// the float4s each keeps in registers (NORM_V).
pub const NORM_THREADS: u32 = 128;
pub const NORM_V: usize = 4;

/// `out[r] = x[r] / rms(x[r]) * gain` for `rows` rows of `n` values (a multiple of 4); with
/// `staged`, the same values in bf16 there too ([`super::qmatmul::Gemm::stage_target`]); with
/// `wg`, also as [`super::moe::stage_wg`] would stage them for the wgmma expert kernels.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(gpu: &Gpu, x: u64, gain: u64, out: u64, rows: usize, n: usize, eps: f32, staged: Option<u64>, wg: Option<u64>) -> Result<()> {
    if !n.is_multiple_of(4) {
        bail!("the prefill RMSNorm takes rows of whole float4s, not {n} values");
    }
    if wg.is_some() && !n.is_multiple_of(64) {
        bail!("the wgmma staging takes whole 64-column groups, not {n} columns");
    }
    let args = [Arg::P(x), Arg::P(gain), Arg::P(out), Arg::I(rows as i32), Arg::I(n as i32), Arg::F(eps), Arg::P(staged.unwrap_or(0)), Arg::P(wg.unwrap_or(0))];
    gpu.launch(PF_RMSNORM, (rows as u32, 1, 1), NORM_THREADS, 0, &args)
}

/// `g = silu(g) * u` over `n` values, or with `staged` those values only as bf16 there
/// ([`super::qmatmul::Gemm::stage_input`]: the next cuBLAS GEMM's operand; `n` even).
pub fn swiglu(gpu: &Gpu, g: u64, u: u64, n: usize, staged: Option<u64>) -> Result<()> {
    if staged.is_some() && !n.is_multiple_of(2) {
        bail!("the staged SwiGLU writes bf16 pairs: {n} values is odd");
    }
    let threads = if staged.is_some() { n / 2 } else { n };
    gpu.launch(PF_SWIGLU, (threads.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::P(g), Arg::P(u), Arg::I(n as i32), Arg::P(staged.unwrap_or(0))])
}
