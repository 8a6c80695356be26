//! Token choice on the device (kernels/sample.cu): greedy argmax that writes the next token and
//! position into the step buffer, so the next decode step can be queued before the host reads it.

use super::device::{Arg, Gpu};
use super::registry::{Kernel, SAMPLE};
use anyhow::Result;

const ARGMAX_NEXT: Kernel = Kernel::dependent(&SAMPLE, "argmax_next");

/// Blocks of `argmax_next` (each reduces a slice; the last one to finish merges).
pub const ARGMAX_BLOCKS: u32 = 64;

/// Floats of `argmax_next`'s scratch: per-block (value, index) partials and the block ticket.
pub const ARGMAX_SCRATCH: usize = 2 * ARGMAX_BLOCKS as usize + 1;

/// Device argmax (ties -> lowest id) of `n` logits into the step buffer (next token, position +
/// 1). `part`: [`ARGMAX_SCRATCH`] floats whose last word (the ticket) is zero; the kernel leaves
/// it zero again.
pub fn argmax_next(gpu: &Gpu, logits: u64, n: usize, step: u64, part: u64) -> Result<()> {
    gpu.launch(ARGMAX_NEXT, (ARGMAX_BLOCKS, 1, 1), 1024, 0, &[Arg::P(logits), Arg::I(n as i32), Arg::P(step), Arg::P(part)])
}

/// Holds the stream for `us` microseconds (one block of `argmax_next` spinning): the profiler
/// queues a whole step behind it so its events time the kernels, not the host's launch rate.
pub fn spin_us(gpu: &Gpu, us: u32) -> Result<()> {
    let args = [Arg::P(0), Arg::I(-(us.min(i32::MAX as u32) as i32)), Arg::P(0), Arg::P(0)];
    gpu.launch(ARGMAX_NEXT, (1, 1, 1), 32, 0, &args)
}
