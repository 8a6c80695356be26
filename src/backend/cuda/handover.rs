//! The decode hand-over microbenchmark (`lily-bench --handover`; kernels/handover.cu): what one
//! dependent hand-over between two decode phases costs as a programmatic-dependent kernel
//! boundary in a CUDA graph (how the decode steps run) against a readiness counter inside one
//! persistent kernel (the plan of issue 18, docs/cuda.md "Toward a persistent decode kernel"),
//! with and without the next phase's weights prefetched into L2 before the wait, at the bytes a
//! decode phase streams. A chain of GEMV phases, each reading the previous phase's output: every
//! way of running it must give the same bits (checked: [`HandoverBench::run`] returns a digest).

use super::device::{ptr, Arg, Gpu};
use super::registry::{Kernel, HANDOVER};
use super::{capture, StepGraph};
use anyhow::{anyhow, bail, Result};
use crate::engine::contract::token_digest;
use cudarc::driver::CudaSlice;
use half::bf16;
use rayon::prelude::*;

const HO_GEMV: Kernel = Kernel::dependent(&HANDOVER, "ho_gemv");
const HO_PERSIST: Kernel = Kernel::ordered(&HANDOVER, "ho_persist");
/// kernels/handover.cu's block size and widest row.
const HO_THREADS: u32 = 256;
const HO_MAX_COLS: usize = 4096;

/// The chain: `phases` GEMVs of `rows` x `cols` bf16 weights over `blocks` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chain {
    pub rows: usize,
    pub cols: usize,
    pub phases: usize,
    pub blocks: usize,
    /// Each block reads the rows of one other block (a local hand-over) instead of every row.
    pub neighbour: bool,
}

impl Chain {
    /// Weight bytes one phase streams.
    pub fn phase_bytes(&self) -> usize {
        self.rows * self.cols * 2
    }

    fn check(&self) -> Result<()> {
        if self.cols == 0 || !self.cols.is_multiple_of(256) || self.cols > HO_MAX_COLS {
            bail!("hand-over chain: {} columns (a multiple of 256, at most {HO_MAX_COLS})", self.cols);
        }
        if self.blocks == 0 || self.rows < 2 * self.blocks || self.phases == 0 {
            bail!("hand-over chain: {} rows over {} blocks, {} phases (at least two rows per block)", self.rows, self.blocks, self.phases);
        }
        Ok(())
    }
}

/// How the chain runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// One programmatic-dependent launch per phase, all in one CUDA graph.
    Launches { prefetch: bool },
    /// One persistent launch whose phases wait on flags in global memory (`wait` false: they do
    /// not wait, the streaming floor of the same loads; its digest is not the chain's).
    Persistent { prefetch: bool, wait: bool },
}

impl Way {
    pub fn label(&self) -> String {
        let pf = |p: bool| if p { "+prefetch" } else { "" };
        match self {
            Way::Launches { prefetch } => format!("launches{}", pf(*prefetch)),
            Way::Persistent { prefetch, wait: true } => format!("persistent{}", pf(*prefetch)),
            Way::Persistent { prefetch, wait: false } => format!("no-wait{}", pf(*prefetch)),
        }
    }
}

/// One way's measurement.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// Wall time per phase over the timed graph launches (each launch is the whole chain).
    pub us_per_phase: f64,
    /// The chain's weight bytes over that time.
    pub tb_per_s: f64,
    /// The last phase's output bits through the contract's token digest (FNV-1a).
    pub digest: u64,
}

/// A chain's device buffers (weights, activations, flags), run any way.
pub struct HandoverBench<'a> {
    gpu: &'a Gpu,
    chain: Chain,
    w: CudaSlice<u16>,
    acts: CudaSlice<f32>,
    flags: CudaSlice<u32>,
}

/// The flag words of a chain: per phase one per block and the count, then the failure word.
fn flag_words(c: &Chain) -> usize {
    c.phases * (c.blocks + 1) + 1
}

/// A deterministic value in [-1, 1) for index `i` of stream `seed` (the synthetic checkpoints'
/// counter-based words).
fn unit(seed: u64, i: u64) -> f32 {
    ((crate::synth::gen::word(seed, i) >> 40) as f32) / ((1u64 << 23) as f32) - 1.0
}

/// Weight `i` of the chain (bf16).
fn weight(i: u64) -> bf16 {
    bf16::from_f32(unit(1, i))
}

impl<'a> HandoverBench<'a> {
    /// The chain's buffers; its grid may change later ([`HandoverBench::set_grid`]).
    pub fn new(gpu: &'a Gpu, chain: Chain) -> Result<Self> {
        chain.check()?;
        let n = chain.phases * chain.rows * chain.cols;
        let w: Vec<u16> = (0..n as u64).into_par_iter().map(|i| weight(i).to_bits()).collect();
        let mut acts = vec![0f32; (chain.phases + 1) * chain.rows];
        for (i, a) in acts.iter_mut().take(chain.rows).enumerate() {
            *a = unit(2, i as u64);
        }
        let (w, acts) = (gpu.upload(&w)?, gpu.upload(&acts)?);
        let flags = gpu.zeros::<u32>(flag_words(&chain))?;
        Ok(HandoverBench { gpu, chain, w, acts, flags })
    }

    /// The same phases over another grid.
    pub fn set_grid(&mut self, blocks: usize, neighbour: bool) -> Result<()> {
        let c = Chain { blocks, neighbour, ..self.chain };
        c.check()?;
        if flag_words(&c) > self.flags.len() {
            self.flags = self.gpu.zeros::<u32>(flag_words(&c))?;
        }
        self.chain = c;
        Ok(())
    }

    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// The graph of one run of the chain `way`'s way (every way's with the flags' memset, so
    /// their times differ only by how the phases hand over).
    fn graph(&self, way: Way) -> Result<StepGraph> {
        let (gpu, c) = (self.gpu, self.chain);
        let (w, acts, flags) = (ptr(&self.w, &gpu.stream), ptr(&self.acts, &gpu.stream), ptr(&self.flags, &gpu.stream));
        let grid = (c.blocks as u32, 1, 1);
        capture(gpu, || {
            gpu.zero(flags, flag_words(&c) * 4)?;
            self.enqueue(way, w, acts, flags, grid)
        })
    }

    fn enqueue(&self, way: Way, w: u64, acts: u64, flags: u64, grid: (u32, u32, u32)) -> Result<()> {
        let (gpu, c) = (self.gpu, self.chain);
        match way {
            Way::Launches { prefetch } => {
                for p in 0..c.phases {
                    let args = [
                        Arg::P(w + (p * c.rows * c.cols * 2) as u64),
                        Arg::I(c.rows as i32),
                        Arg::I(c.cols as i32),
                        Arg::P(acts + (p * c.rows * 4) as u64),
                        Arg::P(acts + ((p + 1) * c.rows * 4) as u64),
                        Arg::I(c.neighbour as i32),
                        Arg::I(prefetch as i32),
                    ];
                    gpu.launch(HO_GEMV, grid, HO_THREADS, 0, &args)?;
                }
                Ok(())
            }
            Way::Persistent { prefetch, wait } => {
                let args = [
                    Arg::P(w),
                    Arg::I(c.phases as i32),
                    Arg::I(c.rows as i32),
                    Arg::I(c.cols as i32),
                    Arg::P(acts),
                    Arg::P(flags),
                    Arg::I(c.neighbour as i32),
                    Arg::I(prefetch as i32),
                    Arg::I(wait as i32),
                ];
                gpu.launch(HO_PERSIST, grid, HO_THREADS, 0, &args)
            }
        }
    }

    /// Most blocks of the persistent kernel resident at once: more would deadlock.
    pub fn resident_blocks(gpu: &Gpu) -> Result<usize> {
        let f = gpu.function(HO_PERSIST, 0)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(HO_THREADS, 0, None)
            .map_err(|e| anyhow!("occupancy of ho_persist: {e:?}"))?;
        Ok(per_sm as usize * gpu.sms as usize)
    }

    /// Runs the chain `way`'s way `warmup` times, then `reps` times timed.
    pub fn run(&mut self, way: Way, warmup: usize, reps: usize) -> Result<Measured> {
        if matches!(way, Way::Persistent { .. }) {
            let resident = Self::resident_blocks(self.gpu)?;
            if self.chain.blocks > resident {
                bail!("{} blocks cannot all be resident (at most {resident}): the persistent chain would deadlock", self.chain.blocks);
            }
        }
        let g = self.graph(way)?;
        g.upload()?;
        for _ in 0..warmup {
            g.launch()?;
        }
        let t0 = self.gpu.record_event()?;
        for _ in 0..reps.max(1) {
            g.launch()?;
        }
        let t1 = self.gpu.record_event()?;
        self.gpu.sync()?;
        let ms = t0.elapsed_ms(&t1).map_err(|e| anyhow!("{e:?}"))? as f64;
        let c = self.chain;
        // The result checked is a run's over activations poisoned first (NaN), so a phase read
        // before it was written shows: every run computes the same values, and a read of the last
        // run's would pass.
        let acts = ptr(&self.acts, &self.gpu.stream) + (c.rows * 4) as u64;
        self.gpu.fill(acts, 0xff, c.phases * c.rows * 4)?;  // the activations past the first phase's input
        g.launch()?;
        let failed = self.gpu.stream.clone_dtoh(&self.flags.slice(flag_words(&c) - 1..flag_words(&c))).map_err(|e| anyhow!("{e:?}"))?;
        if failed[0] != 0 {
            bail!("{}: a block polled a flag 2^22 times in vain (the hand-over protocol is broken)", way.label());
        }
        let bits: Vec<u32> = self.last_output()?.iter().map(|v| v.to_bits()).collect();
        let digest = token_digest(&bits);
        let us_per_phase = ms * 1e3 / (reps.max(1) * c.phases) as f64;
        Ok(Measured { us_per_phase, tb_per_s: c.phase_bytes() as f64 / (us_per_phase * 1e6), digest })
    }

    /// The chain on the host, in f64 (the reference the GPU test holds every way to).
    pub fn host_reference(chain: Chain) -> Vec<f32> {
        let mut x: Vec<f32> = (0..chain.rows as u64).map(|i| unit(2, i)).collect();
        let rng = |b: usize| (b * chain.rows / chain.blocks, (b + 1) * chain.rows / chain.blocks);
        let scale = (3.0 / chain.cols as f64).sqrt();
        for p in 0..chain.phases {
            let mut y = vec![0f32; chain.rows];
            for b in 0..chain.blocks {
                let (r0, r1) = rng(b);
                let (s0, n) = if chain.neighbour {
                    let (s0, s1) = rng((b + 1) % chain.blocks);
                    (s0, s1 - s0)
                } else {
                    (0, chain.rows)
                };
                for (r, yr) in y.iter_mut().enumerate().take(r1).skip(r0) {
                    let base = ((p * chain.rows + r) * chain.cols) as u64;
                    let dot: f64 = (0..chain.cols)
                        .map(|j| weight(base + j as u64).to_f64() * x[s0 + j % n] as f64)
                        .sum();
                    *yr = (dot * scale) as f32;
                }
            }
            x = y;
        }
        x
    }

    /// The last phase's output as the device left it.
    pub fn last_output(&self) -> Result<Vec<f32>> {
        let c = self.chain;
        self.gpu.stream.clone_dtoh(&self.acts.slice(c.phases * c.rows..)).map_err(|e| anyhow!("{e:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_in_range() {
        for i in 0..1000 {
            let v = unit(7, i);
            assert!((-1.0..1.0).contains(&v), "{v}");
        }
    }

    #[test]
    fn chains_are_checked() {
        let ok = Chain { rows: 1024, cols: 256, phases: 4, blocks: 132, neighbour: false };
        assert!(ok.check().is_ok());
        assert_eq!(ok.phase_bytes(), 512 * 1024);
        assert!(Chain { cols: 100, ..ok }.check().is_err());
        assert!(Chain { cols: 8192, ..ok }.check().is_err());
        assert!(Chain { rows: 200, ..ok }.check().is_err());
        assert!(Chain { phases: 0, ..ok }.check().is_err());
    }
}
