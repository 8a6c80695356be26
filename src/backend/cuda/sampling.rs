//! Token choice on the device (kernels/sample.cu), the CUDA side of `engine::sampling`: greedy
//! argmax, or sampling with penalties, temperature, top-k, min-p and top-p and a seeded draw.
//! Both write the next token and position into the step buffer, so the next decode step can be
//! queued before the host reads anything.

use super::device::{ptr, Arg, Gpu};
use super::registry::{Kernel, SAMPLE};
use crate::engine::sampling::{SamplerSnapshot, SamplingParams};
use crate::backend::mask_words;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaSlice;

const ARGMAX_NEXT: Kernel = Kernel::dependent(&SAMPLE, "argmax_next");
const SAMPLE_PREP: Kernel = Kernel::dependent(&SAMPLE, "sample_prep");
const SAMPLE_SELECT: Kernel = Kernel::dependent(&SAMPLE, "sample_select");
const SAMPLE_DRAW: Kernel = Kernel::dependent(&SAMPLE, "sample_draw");
const SAMPLE_SMALL_K: Kernel = Kernel::dependent(&SAMPLE, "sample_small_k");

/// The largest top-k `sample_small_k` takes (SAMPLE_SMALL_K in kernels/sample.cu): each block
/// lists its top-k largest values, the row's last block chooses among the lists.
pub const SMALL_K: usize = 64;

/// Blocks of `argmax_next` per row at most (each reduces a slice; the last one to finish merges;
/// ARGMAX_MAX_BLOCKS in kernels/sample.cu).
pub const ARGMAX_BLOCKS: u32 = 64;

/// Blocks per row of the token-choice kernels: 64 for a lone row, fewer as rows are added so a
/// batch's rows fill about one wave instead of several. The choice does not depend on it (maxima,
/// exact integer histograms and masses, ties by index), so neither does any row's token.
pub fn blocks_per_row(rows: usize) -> u32 {
    (256 / rows.max(1)).clamp(8, ARGMAX_BLOCKS as usize) as u32
}

/// Floats of `argmax_next`'s scratch: per-block (value, index) partials and the block ticket.
pub const ARGMAX_SCRATCH: usize = 2 * ARGMAX_BLOCKS as usize + 1;

/// Device argmax (ties -> lowest id) of `n` logits into the step buffer (next token, position +
/// 1), for `rows` rows of logits and step buffers back to back. `part`: [`ARGMAX_SCRATCH`] floats
/// per row whose last word (the ticket) is zero; the kernel leaves it zero again.
pub fn argmax_next(gpu: &Gpu, logits: u64, n: usize, step: u64, part: u64, rows: usize) -> Result<()> {
    gpu.launch(ARGMAX_NEXT, (blocks_per_row(rows), rows as u32, 1), 1024, 0, &[Arg::P(logits), Arg::I(n as i32), Arg::P(step), Arg::P(part)])
}

/// Holds the stream for `us` microseconds (one block of `argmax_next` spinning): the profiler
/// queues a whole step behind it so its events time the kernels, not the host's launch rate.
pub fn spin_us(gpu: &Gpu, us: u32) -> Result<()> {
    let args = [Arg::P(0), Arg::I(-(us.min(i32::MAX as u32) as i32)), Arg::P(0), Arg::P(0)];
    gpu.launch(ARGMAX_NEXT, (1, 1, 1), 32, 0, &args)
}

/// Mirrors `struct SampleParams` in kernels/sample.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
    pub top_k: i32,
    /// The counts are applied (some penalty is set).
    pub penalties: i32,
    pub seed: u64,
}

// SAFETY: plain-old-data with the C layout of `struct SampleParams`.
unsafe impl cudarc::driver::DeviceRepr for SampleParams {}
unsafe impl cudarc::driver::ValidAsZeroBits for SampleParams {}

impl SampleParams {
    pub fn new(snap: &SamplerSnapshot) -> Self {
        let p = &snap.params;
        SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            repetition: p.repetition_penalty,
            top_k: p.top_k.min(i32::MAX as usize) as i32,
            penalties: p.has_penalties() as i32,
            seed: snap.seed,
        }
    }
}

/// How the next token is chosen on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenChoice {
    /// `argmax_next`: plain greedy (no penalties), one kernel.
    Argmax,
    /// `sample_prep` + `sample_select` x 8 + `sample_draw`: everything else.
    Sample,
    /// `sample_small_k`: the same token in one launch, for a temperature above 0 and a top-k of
    /// at most [`SMALL_K`] (the chat settings).
    SampleSmallK,
}

pub fn select(snap: &SamplerSnapshot) -> TokenChoice {
    if snap.params.is_plain_greedy() {
        TokenChoice::Argmax
    } else if small_k(&snap.params) {
        TokenChoice::SampleSmallK
    } else {
        TokenChoice::Sample
    }
}

/// Whether `sample_small_k` takes a row with these parameters.
pub fn small_k(p: &SamplingParams) -> bool {
    p.temperature > 0.0 && (1..=SMALL_K).contains(&p.top_k)
}

/// Blocks of the sampling kernels (each takes a slice of the vocabulary).
const SAMPLE_BLOCKS: u32 = 64;
/// Histogram bins of a radix-select pass (SAMPLE_BINS).
const SAMPLE_BINS: usize = 256;
/// Radix-select passes: 4 for top-k, 4 for top-p.
const SELECT_PASSES: i32 = 8;
/// u64 words of `struct SampleRow`.
const ROW_WORDS: usize = 6;
/// Candidates listed per row (SAMPLE_CAND), 8 bytes each (`struct SampleCand`).
const SAMPLE_CAND: usize = 2048;

/// Device state of sampling `rows` sequences (one for the single-sequence decode): per row its
/// parameters, the counts of its generated tokens (penalties), its token mask and whether it
/// applies, the penalised logits and the passes' partials, rows back to back.
pub struct SampleScratch {
    pub rows: usize,
    pub params: CudaSlice<SampleParams>,
    pub counts: CudaSlice<i32>,
    masked: CudaSlice<i32>,
    mask: CudaSlice<u32>,
    z: CudaSlice<f32>,
    hist: CudaSlice<u64>,
    row: CudaSlice<u64>,
    part: CudaSlice<f32>,
    cand: CudaSlice<u64>,
}

impl SampleScratch {
    pub fn new(gpu: &Gpu, vocab: usize, rows: usize) -> Result<Self> {
        Ok(SampleScratch {
            rows,
            params: gpu.zeros(rows)?,
            counts: gpu.zeros(rows * vocab)?,
            masked: gpu.zeros(rows)?,
            mask: gpu.zeros(rows * mask_words(vocab))?,
            z: gpu.zeros(rows * vocab)?,
            hist: gpu.zeros(rows * SAMPLE_BLOCKS as usize * SAMPLE_BINS)?,
            row: gpu.zeros(rows * ROW_WORDS)?,
            part: gpu.zeros(rows * 2 * SAMPLE_BLOCKS as usize)?,
            cand: gpu.zeros(rows * SAMPLE_CAND)?,
        })
    }

    /// Loads the sampling state of one request per row (at most `rows`): parameters, seed and the
    /// counts of its tokens so far (uploaded only for rows with penalties: the kernels read and
    /// write the counts of no other row).
    pub fn load(&mut self, gpu: &Gpu, snaps: &[&SamplerSnapshot]) -> Result<()> {
        if snaps.len() > self.rows {
            bail!("{} sampling rows for a scratch of {}", snaps.len(), self.rows);
        }
        let st = &gpu.stream;
        let vocab = self.counts.len() / self.rows;
        for (r, snap) in snaps.iter().enumerate() {
            if !snap.params.has_penalties() {
                continue;
            }
            let mut counts = vec![0i32; vocab];
            for &(t, n) in &snap.counts {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c = n.min(i32::MAX as u32) as i32;
                }
            }
            let mut dst = self.counts.slice_mut(r * vocab..(r + 1) * vocab);
            st.memcpy_htod(&counts, &mut dst).map_err(|e| anyhow!("sampling state upload: {e:?}"))?;
        }
        let params: Vec<SampleParams> = snaps.iter().map(|s| SampleParams::new(s)).collect();
        let mut dst = self.params.slice_mut(0..params.len());
        st.memcpy_htod(&params, &mut dst).map_err(|e| anyhow!("sampling state upload: {e:?}"))
    }

    /// Sets which of the first `flags.len()` rows draw only from their allowed tokens
    /// (`StepHooks::mask`), and with `masks` (`mask_words(vocab)` words per row) those tokens.
    pub fn load_masks(&mut self, gpu: &Gpu, flags: &[i32], masks: Option<&[u32]>) -> Result<()> {
        let st = &gpu.stream;
        if flags.len() > self.rows || masks.is_some_and(|m| m.len() > self.mask.len()) {
            bail!("{} masked sampling rows for a scratch of {}", flags.len(), self.rows);
        }
        let mut dst = self.masked.slice_mut(0..flags.len());
        st.memcpy_htod(flags, &mut dst).map_err(|e| anyhow!("token mask upload: {e:?}"))?;
        if let Some(m) = masks {
            let mut dst = self.mask.slice_mut(0..m.len());
            st.memcpy_htod(m, &mut dst).map_err(|e| anyhow!("token mask upload: {e:?}"))?;
        }
        Ok(())
    }
}

/// u64 words of `sample_small_k`'s scratch per row (SAMPLE_SMALL_WORDS: the blocks' lists of 8-byte
/// candidates, then 16 bytes per block), in the select passes' histogram buffer.
const SMALL_WORDS: usize = SAMPLE_BLOCKS as usize * SMALL_K + 2 * SAMPLE_BLOCKS as usize;

/// Samples the next token from `n` logits as the loaded parameters say, into the step buffer, for
/// the first `rows` rows of logits, step buffers and scratch; with `small` by `sample_small_k`
/// (every row's parameters must pass [`small_k`]).
pub fn sample_next(gpu: &Gpu, logits: u64, n: usize, step: u64, s: &SampleScratch, rows: usize, small: bool) -> Result<()> {
    let st = &gpu.stream;
    let (prm, counts, z, hist, row, part) = (ptr(&s.params, st), ptr(&s.counts, st), ptr(&s.z, st), ptr(&s.hist, st), ptr(&s.row, st), ptr(&s.part, st));
    let (masked, mask, cand) = (ptr(&s.masked, st), ptr(&s.mask, st), ptr(&s.cand, st));
    let grid = (blocks_per_row(rows).min(SAMPLE_BLOCKS), rows as u32, 1);
    let ni = Arg::I(n as i32);
    let head = [Arg::P(logits), ni.clone(), Arg::P(prm), Arg::P(counts), Arg::P(masked), Arg::P(mask), Arg::I(mask_words(n) as i32), Arg::P(z), Arg::P(row)];
    if small {
        if s.hist.len() < rows * SMALL_WORDS {
            bail!("sampling scratch for {} rows, {rows} asked", s.rows);
        }
        let args: Vec<Arg> = head.into_iter().chain([Arg::P(hist), Arg::P(step)]).collect();
        return gpu.launch(SAMPLE_SMALL_K, grid, 1024, 0, &args);
    }
    let prep: Vec<Arg> = head.into_iter().chain([Arg::P(part)]).collect();
    gpu.launch(SAMPLE_PREP, grid, 1024, 0, &prep)?;
    for pass in 0..SELECT_PASSES {
        gpu.launch(SAMPLE_SELECT, grid, 1024, 0, &[Arg::P(z), ni.clone(), Arg::P(prm), Arg::P(row), Arg::P(hist), Arg::I(pass), Arg::P(cand)])?;
    }
    gpu.launch(SAMPLE_DRAW, grid, 1024, 0, &[Arg::P(z), ni, Arg::P(prm), Arg::P(row), Arg::P(counts), Arg::P(step), Arg::P(part), Arg::P(cand)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::SamplingParams;

    fn snap(params: SamplingParams) -> SamplerSnapshot {
        SamplerSnapshot { params, seed: 9, counts: vec![] }
    }

    #[test]
    fn greedy_without_penalties_stays_on_the_argmax_kernel() {
        assert_eq!(select(&snap(SamplingParams::greedy())), TokenChoice::Argmax);
        assert_eq!(select(&snap(SamplingParams { repetition_penalty: 1.1, ..Default::default() })), TokenChoice::Sample);
        let chat = SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() };
        assert_eq!(select(&snap(chat.clone())), TokenChoice::SampleSmallK);
        // Past SMALL_K, without top-k, or at temperature 0 (penalised argmax): the general kernels.
        assert_eq!(select(&snap(SamplingParams { top_k: SMALL_K + 1, ..chat.clone() })), TokenChoice::Sample);
        assert_eq!(select(&snap(SamplingParams { top_k: 0, ..chat.clone() })), TokenChoice::Sample);
        assert_eq!(select(&snap(SamplingParams { temperature: 0.0, repetition_penalty: 1.1, top_k: 20, ..Default::default() })), TokenChoice::Sample);
        assert_eq!(select(&snap(SamplingParams { top_k: SMALL_K, ..chat.clone() })), TokenChoice::SampleSmallK);
        // sample_small_k's lists and block records fit the select passes' histograms of a row.
        assert!(SMALL_WORDS <= SAMPLE_BLOCKS as usize * SAMPLE_BINS);
        let p = SampleParams::new(&snap(chat));
        assert_eq!((p.top_k, p.penalties, p.seed), (20, 0, 9));
        // The C struct: six floats, two ints, one u64.
        assert_eq!(std::mem::size_of::<SampleParams>(), 40);
    }

    #[test]
    fn batches_spread_fewer_blocks_per_row() {
        assert_eq!(blocks_per_row(1), 64);
        assert_eq!(blocks_per_row(4), 64);
        assert_eq!(blocks_per_row(16), 16);
        assert_eq!(blocks_per_row(64), 8);
        assert_eq!(blocks_per_row(128), 8);
    }
}
