//! The decode timeline (`LILY_CUDA_TIMELINE=1`): where a decode step's time goes while it runs as
//! a CUDA graph, kernel by kernel, with the launch gaps and the programmatic-dependent overlap of
//! real runs (the phase profile, `LILY_CUDA_PROFILE=1`, launches directly with an event after
//! every phase, which adds both).
//!
//! With the option every kernel module is compiled with `LILY_TIMELINE` defined: thread 0 of
//! block 0 of each decode kernel takes a stamp of `%globaltimer` when it may read its inputs (in
//! `pdl_wait` for the programmatic dependents, i.e. when the previous kernel completed; at entry
//! for the kernels launched in order) into one buffer shared by all modules (kernels/common.cuh
//! `tl_stamp`). The host logs the stamping launches in order, with the phase marks of the forward
//! (`Probe::at`) between them; a captured graph keeps the log of its capture and adds it again at
//! every replay. At the end (the backend's drop) the stamps are paired with the log, and the time
//! from one stamp to the next within a graph step is the kernel's: from its predecessor's end to
//! its own. Report: per phase (the profile's names) and per kernel, in microseconds per step.

use super::device::Gpu;
use super::registry::Kernel;
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::{Arc, Mutex};

/// Stamps the buffer holds; later stamps are counted and dropped.
const CAPACITY: usize = 1 << 18;

/// One entry of the launch log.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A stamping kernel and its grid (x, y).
    Kernel { name: &'static str, grid: (u32, u32) },
    /// The end of a phase of the forward (`Point::Phase`): the kernels since the previous mark.
    Phase(&'static str),
}

/// What the log holds in order: entries of direct launches (`None`) and of graph replays (the
/// replay's number).
#[derive(Default)]
struct Log {
    entries: Vec<(Option<u32>, Entry)>,
    /// While a graph is captured: its entries (nothing runs).
    capture: Option<Vec<Entry>>,
    replays: u32,
}

/// The device buffer of stamps and the host's log of launches.
pub struct Timeline {
    buf: CudaSlice<u64>,
    log: Mutex<Log>,
}

impl Timeline {
    /// The buffer, with its header written: no stamps, [`CAPACITY`].
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let mut header = vec![0u64; 2 + 2 * CAPACITY];
        header[1] = CAPACITY as u64;
        let buf = stream.clone_htod(&header).map_err(|e| anyhow!("timeline buffer: {e:?}"))?;
        Ok(Timeline { buf, log: Mutex::new(Log::default()) })
    }

    /// The buffer's device address (what each module's `lily_timeline` is set to).
    pub fn address(&self, stream: &Arc<CudaStream>) -> u64 {
        let (p, _sync) = self.buf.device_ptr(stream);
        p
    }

    fn push(&self, e: Entry) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = log.capture.as_mut() {
            c.push(e);
        } else if log.entries.len() < 4 * CAPACITY {
            log.entries.push((None, e));
        }
    }

    /// A launch of `k` with `grid` (only stamping kernels are logged).
    pub fn launched(&self, k: Kernel, grid: (u32, u32, u32)) {
        if k.stamps {
            self.push(Entry::Kernel { name: k.name, grid: (grid.0, grid.1) });
        }
    }

    /// The end of phase `name` of a forward.
    pub fn phase(&self, name: &'static str) {
        self.push(Entry::Phase(name));
    }

    /// From now on launches go into a graph being captured.
    pub fn begin_capture(&self) {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).capture = Some(Vec::new());
    }

    /// The captured graph's entries.
    pub fn end_capture(&self) -> Vec<Entry> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).capture.take().unwrap_or_default()
    }

    /// A replay of a graph whose capture logged `entries`.
    pub fn replayed(&self, entries: &[Entry]) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let n = log.replays;
        log.replays += 1;
        if log.entries.len() < 4 * CAPACITY {
            log.entries.extend(entries.iter().map(|e| (Some(n), e.clone())));
        }
    }

    /// Reads the stamps (synchronises) and prints the report to stderr.
    pub fn report(&self, gpu: &Gpu) -> Result<()> {
        gpu.sync()?;
        let raw = gpu.stream.clone_dtoh(&self.buf).map_err(|e| anyhow!("timeline readback: {e:?}"))?;
        let taken = raw[0] as usize;
        let stamps: Vec<(u64, (u32, u32))> = (0..taken.min(CAPACITY))
            .map(|i| (raw[2 + 2 * i], (raw[3 + 2 * i] as u32, (raw[3 + 2 * i] >> 32) as u32)))
            .collect();
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let r = summarise(&log.entries, &stamps);
        if r.steps == 0 {
            eprintln!("lily: CUDA timeline: no graph step recorded ({taken} stamps)");
            return Ok(());
        }
        eprint!("{}", r.render(taken));
        Ok(())
    }
}

/// Per-phase and per-kernel time of the graph steps.
#[derive(Debug, Default, PartialEq)]
pub struct Summary {
    pub steps: usize,
    /// Nanoseconds from each step's first stamp to its last, summed.
    pub span_ns: u64,
    /// (phase, ns, kernels) in first-seen order.
    pub phases: Vec<(&'static str, u64, usize)>,
    /// (phase, kernel, ns, launches) in first-seen order.
    pub kernels: Vec<(&'static str, &'static str, u64, usize)>,
    /// Log entries whose stamp's grid differed (the pairing is off from the first of them).
    pub mismatches: usize,
}

/// Pairs the log's kernel entries with the stamps in order and sums, for each kernel of a graph
/// step but the step's last, the time to the next stamp of the same step, under the phase whose
/// mark follows it.
pub fn summarise(entries: &[(Option<u32>, Entry)], stamps: &[(u64, (u32, u32))]) -> Summary {
    let mut s = Summary::default();
    // Each kernel entry's stamp index and phase (the next phase mark of its run of entries).
    let mut kernels: Vec<(Option<u32>, &'static str, usize, &'static str)> = Vec::new();
    let mut pending: Vec<usize> = Vec::new();
    let mut next = 0usize;
    for (step, e) in entries {
        match e {
            Entry::Kernel { name, grid } => {
                if next >= stamps.len() {
                    break;
                }
                if stamps[next].1 != *grid {
                    s.mismatches += 1;
                }
                pending.push(kernels.len());
                kernels.push((*step, name, next, "(no phase)"));
                next += 1;
            }
            Entry::Phase(p) => {
                for i in pending.drain(..) {
                    kernels[i].3 = p;
                }
            }
        }
    }
    let mut step_span: Option<(u32, u64, u64)> = None;
    let close = |span: Option<(u32, u64, u64)>, s: &mut Summary| {
        if let Some((_, a, b)) = span {
            s.steps += 1;
            s.span_ns += b - a;
        }
    };
    for (i, &(step, name, si, phase)) in kernels.iter().enumerate() {
        let Some(n) = step else { continue };
        let t = stamps[si].0;
        match step_span {
            Some((m, a, _)) if m == n => step_span = Some((n, a, t)),
            prev => {
                close(prev, &mut s);
                step_span = Some((n, t, t));
            }
        }
        let Some(&(next_step, _, nsi, _)) = kernels.get(i + 1) else { continue };
        if next_step != step {
            continue;
        }
        let ns = stamps[nsi].0.saturating_sub(t);
        match s.phases.iter_mut().find(|(p, _, _)| *p == phase) {
            Some(e) => {
                e.1 += ns;
                e.2 += 1;
            }
            None => s.phases.push((phase, ns, 1)),
        }
        match s.kernels.iter_mut().find(|(p, k, _, _)| *p == phase && *k == name) {
            Some(e) => {
                e.2 += ns;
                e.3 += 1;
            }
            None => s.kernels.push((phase, name, ns, 1)),
        }
    }
    close(step_span, &mut s);
    s
}

impl Summary {
    /// The report's text.
    pub fn render(&self, taken: usize) -> String {
        let steps = self.steps.max(1) as f64;
        let us = |ns: u64| ns as f64 / 1000.0 / steps;
        let mut out = format!(
            "lily: CUDA timeline over {} graph steps: {:.1} us/step from the first kernel's stamp to the last's ({} stamps{})\n",
            self.steps,
            us(self.span_ns),
            taken,
            if self.mismatches > 0 { format!(", {} grids did not match the log: the pairing is off", self.mismatches) } else { String::new() }
        );
        for &(phase, ns, n) in &self.phases {
            out += &format!("  {phase:<14} {:>8.1} us/step {:>5.1}%  {:>5.1} kernels/step\n", us(ns), 100.0 * ns as f64 / self.span_ns.max(1) as f64, n as f64 / steps);
            for &(p, k, kns, kn) in &self.kernels {
                if p == phase {
                    out += &format!("      {k:<26} {:>8.1} us/step  {:>5.1} us/launch\n", us(kns), kns as f64 / 1000.0 / kn as f64);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(name: &'static str, x: u32) -> Entry {
        Entry::Kernel { name, grid: (x, 1) }
    }

    #[test]
    fn steps_are_paired_with_their_stamps_and_phases() {
        // A direct launch (prefill), then two replays of a step of three kernels in two phases.
        let step = [k("a", 1), Entry::Phase("p"), k("b", 2), k("c", 3), Entry::Phase("q")];
        let mut entries = vec![(None, k("pre", 9)), (None, Entry::Phase("prefill"))];
        for n in 0..2 {
            entries.extend(step.iter().map(|e| (Some(n), e.clone())));
        }
        let t = |ns: u64, x: u32| (ns, (x, 1));
        let stamps = [t(0, 9), t(1000, 1), t(1300, 2), t(1700, 3), t(5000, 1), t(5400, 2), t(5900, 3)];
        let s = summarise(&entries, &stamps);
        assert_eq!(s.steps, 2);
        assert_eq!(s.mismatches, 0);
        // Step spans 700 + 900; a: 300 + 400 under p; b: 400 + 500 under q; c is each step's last.
        assert_eq!(s.span_ns, 1600);
        assert_eq!(s.phases, vec![("p", 700, 2), ("q", 900, 2)]);
        assert_eq!(s.kernels, vec![("p", "a", 700, 2), ("q", "b", 900, 2)]);
        assert!(s.render(7).contains("over 2 graph steps: 0.8 us/step"));
    }

    #[test]
    fn a_grid_that_differs_from_the_log_is_reported() {
        let entries = vec![(Some(0), k("a", 1)), (Some(0), k("b", 2)), (Some(0), Entry::Phase("p"))];
        let s = summarise(&entries, &[(0, (1, 1)), (10, (5, 1))]);
        assert_eq!(s.mismatches, 1);
        assert!(s.render(2).contains("did not match"));
        // Fewer stamps than logged kernels: the rest are left out.
        let s = summarise(&entries, &[(0, (1, 1))]);
        assert_eq!((s.steps, s.span_ns, s.kernels.len()), (1, 0, 0));
    }
}
