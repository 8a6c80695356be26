//! Sequence memory on the device: attention KV caches in pages mapped as sequences grow, Gated
//! DeltaNet conv rings and recurrent states in a pool of slots, both drawn from one budget (the
//! configured fraction of the device less everything else on it). A sequence reserves the
//! address range of its max-seq up front (address space, not memory), so its KV layout stays the
//! contiguous `[position][kv_dim]` the kernels and captured graphs read.
//!
//! Pages below a sequence's length are never written again (KV rows are appended), so a clone
//! maps the same physical pages and copies only the partly filled last one.

use super::budget::Ledger;
use super::vmm::{granularity, AddressRange, PhysPage};
use crate::backend::SequenceMemoryReport;
use anyhow::{anyhow, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::{Arc, Mutex, MutexGuard};

/// Everything sequences hold on the device, and the budget they draw on.
pub struct SequenceMemory {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Share of the device's total memory that weights, scratch and sequences may use.
    fraction: f64,
    /// A cap on the budget (tests).
    cap: Option<usize>,
    slot_floats: usize,
    ledger: Mutex<Ledger<PhysPage, CudaSlice<f32>>>,
}

impl SequenceMemory {
    pub fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, slot_floats: usize, fraction: f64, cap: Option<usize>) -> Result<Arc<Self>> {
        let page = granularity(&ctx)?;
        let ledger = Mutex::new(Ledger::new(page, slot_floats * 4));
        Ok(Arc::new(SequenceMemory { ctx, stream, fraction, cap, slot_floats, ledger }))
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger<PhysPage, CudaSlice<f32>>> {
        // A panic while holding the lock leaves plain counters behind; keep going with them.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn page_bytes(&self) -> usize {
        self.ledger().page_bytes()
    }

    /// The budget now: `fraction` of the device less what is on it besides sequence memory.
    fn limit(&self, l: &Ledger<PhysPage, CudaSlice<f32>>) -> usize {
        let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
        let others = (total - free).saturating_sub(l.held());
        let limit = ((total as f64 * self.fraction) as usize).saturating_sub(others);
        self.cap.map_or(limit, |c| limit.min(c))
    }

    /// The least one sequence holds: its state slot and the first page of each of its
    /// `kv_regions` KV regions.
    pub fn sequence_floor_bytes(&self, kv_regions: usize) -> usize {
        self.slot_floats * 4 + kv_regions * self.page_bytes()
    }

    pub fn report(&self) -> SequenceMemoryReport {
        let l = self.ledger();
        SequenceMemoryReport {
            budget_bytes: self.limit(&l) as u64,
            in_use_bytes: l.in_use() as u64,
            reserved_bytes: l.promised() as u64,
            cached_bytes: l.cached() as u64,
            page_bytes: l.page_bytes() as u64,
        }
    }

    /// A zeroed state slot.
    fn take_slot(&self) -> Result<CudaSlice<f32>> {
        let mut slot = {
            let mut l = self.ledger();
            let limit = self.limit(&l);
            l.take_slot(limit, || {
                // SAFETY: zeroed below, before any use.
                unsafe { self.stream.alloc::<f32>(self.slot_floats) }.map_err(|e| anyhow!("device allocation of a sequence state slot: {e:?}"))
            })?
        };
        // Stream-ordered: runs after whatever the slot's previous owner queued.
        self.stream.memset_zeros(&mut slot).map_err(|e| anyhow!("device memset: {e:?}"))?;
        Ok(slot)
    }

    fn take_pages(&self, n: usize, from_promise: usize) -> Result<Vec<PhysPage>> {
        let mut l = self.ledger();
        let (limit, bytes) = (self.limit(&l), l.page_bytes());
        l.take_pages(n, from_promise, limit, || PhysPage::create(&self.ctx, bytes))
    }

    fn promise(&self, bytes: usize) -> Result<()> {
        let mut l = self.ledger();
        let limit = self.limit(&l);
        l.promise(bytes, limit)
    }
}

/// One sequence's Gated DeltaNet conv rings and recurrent states: a slot of the pool, returned
/// to it when dropped (reuse is ordered on the stream, so no synchronisation is needed).
pub struct StateSlot {
    buf: Option<CudaSlice<f32>>,
    mem: Arc<SequenceMemory>,
}

impl StateSlot {
    pub fn take(mem: &Arc<SequenceMemory>) -> Result<Self> {
        Ok(StateSlot { buf: Some(mem.take_slot()?), mem: mem.clone() })
    }

    pub fn buf(&self) -> &CudaSlice<f32> {
        self.buf.as_ref().expect("present until dropped")
    }

    /// A slot holding a copy of this one.
    pub fn try_clone(&self) -> Result<Self> {
        let mut s = StateSlot::take(&self.mem)?;
        let dst = s.buf.as_mut().expect("just taken");
        self.mem.stream.memcpy_dtod(self.buf(), dst).map_err(|e| anyhow!("device copy failed: {e:?}"))?;
        Ok(s)
    }

    pub fn bytes(&self) -> usize {
        self.buf().len() * 4
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.mem.ledger().give_slot(b);
        }
    }
}

/// The KV caches of one sequence: `regions` (K and V of every attention layer) of
/// `region_bytes` each in one reserved range, each region's pages mapped in order as the
/// sequence grows (every region holds the same number).
pub struct KvSpace {
    mem: Arc<SequenceMemory>,
    range: Option<AddressRange>,
    regions: usize,
    region_bytes: usize,
    row_bytes: usize,
    page_bytes: usize,
    /// Mapped pages per region, shared with clones.
    pages: Vec<Vec<Arc<PhysPage>>>,
    /// Pages reserved against the budget and not yet drawn.
    promised_pages: usize,
}

impl KvSpace {
    /// Address space for `regions` regions of `max_rows` rows of `row_bytes`; no memory yet.
    pub fn new(mem: &Arc<SequenceMemory>, regions: usize, max_rows: usize, row_bytes: usize) -> Result<Self> {
        let page_bytes = mem.page_bytes();
        let region_bytes = (max_rows * row_bytes).div_ceil(page_bytes) * page_bytes;
        let range = if regions > 0 && region_bytes > 0 {
            Some(AddressRange::reserve(&mem.ctx, regions * region_bytes, page_bytes)?)
        } else {
            None
        };
        Ok(KvSpace { mem: mem.clone(), range, regions, region_bytes, row_bytes, page_bytes, pages: vec![Vec::new(); regions], promised_pages: 0 })
    }

    /// Device address of region `r` (row 0).
    pub fn region(&self, r: usize) -> u64 {
        self.range.as_ref().map_or(0, |a| a.base()) + (r * self.region_bytes) as u64
    }

    /// Pages each region needs to hold `rows` rows.
    fn pages_for(&self, rows: usize) -> usize {
        (rows * self.row_bytes).div_ceil(self.page_bytes).min(self.region_bytes / self.page_bytes)
    }

    fn mapped_per_region(&self) -> usize {
        self.pages.iter().map(Vec::len).min().unwrap_or(0)
    }

    /// This space's share of the pages it maps: a page mapped by k spaces (a sequence and its
    /// snapshots) counts 1/k in each, so the shares of all spaces add up to the memory they hold.
    pub fn held_bytes(&self) -> usize {
        self.pages.iter().flatten().map(|p| self.page_bytes / Arc::strong_count(p)).sum()
    }

    /// Reserves pages for `rows` rows in every region ([`crate::backend::MemoryFull`] when the
    /// budget cannot hold them).
    pub fn reserve(&mut self, rows: usize) -> Result<()> {
        let want = self.pages_for(rows) * self.regions;
        let have = self.pages.iter().map(Vec::len).sum::<usize>() + self.promised_pages;
        if want > have {
            self.mem.promise((want - have) * self.page_bytes)?;
            self.promised_pages += want - have;
        }
        Ok(())
    }

    /// Maps pages until every region holds `rows` rows: drawn from the reservation first, then
    /// from the free budget; all or none ([`crate::backend::MemoryFull`]).
    pub fn grow(&mut self, rows: usize) -> Result<()> {
        let want = self.pages_for(rows);
        let missing: usize = self.pages.iter().map(|p| want.saturating_sub(p.len())).sum();
        if missing == 0 {
            return Ok(());
        }
        let from_promise = missing.min(self.promised_pages);
        let mut fresh = self.mem.take_pages(missing, from_promise * self.page_bytes)?;
        self.promised_pages -= from_promise;
        let range = self.range.as_ref().expect("regions with pages have a range");
        for r in 0..self.regions {
            while self.pages[r].len() < want {
                let page = fresh.pop().expect("one page per missing slot");
                let off = r * self.region_bytes + self.pages[r].len() * self.page_bytes;
                if let Err(e) = range.map(off, &page, self.page_bytes) {
                    let mut l = self.mem.ledger();
                    l.give_page(page);
                    fresh.into_iter().for_each(|p| l.give_page(p));
                    return Err(e);
                }
                self.pages[r].push(Arc::new(page));
            }
        }
        Ok(())
    }

    /// A space holding the first `rows` rows of this one: full pages shared, the partly filled
    /// last page of each region copied.
    pub fn try_clone(&self, rows: usize) -> Result<Self> {
        let range = match &self.range {
            Some(_) => Some(AddressRange::reserve(&self.mem.ctx, self.regions * self.region_bytes, self.page_bytes)?),
            None => None,
        };
        let mut c = KvSpace {
            mem: self.mem.clone(),
            range,
            regions: self.regions,
            region_bytes: self.region_bytes,
            row_bytes: self.row_bytes,
            page_bytes: self.page_bytes,
            pages: vec![Vec::new(); self.regions],
            promised_pages: 0,
        };
        let Some(dst) = c.range.as_ref() else { return Ok(c) };
        let used = rows * self.row_bytes;
        let full = (used / self.page_bytes).min(self.mapped_per_region());
        for r in 0..self.regions {
            let run: Vec<&PhysPage> = self.pages[r][..full].iter().map(|p| p.as_ref()).collect();
            dst.map_run(r * self.region_bytes, &run, self.page_bytes)?;
            c.pages[r].extend(self.pages[r][..full].iter().cloned());
        }
        let partial = used.saturating_sub(full * self.page_bytes);
        if partial > 0 {
            c.grow(rows)?;
            for r in 0..self.regions {
                let off = (r * self.region_bytes + full * self.page_bytes) as u64;
                // SAFETY: both ranges are mapped over these `partial` bytes (this space holds
                // `rows` rows; the clone grew to them above).
                unsafe { cudarc::driver::result::memcpy_dtod_async(c.region(0) + off, self.region(0) + off, partial, self.mem.stream.cu_stream()) }
                    .map_err(|e| anyhow!("device copy failed: {e:?}"))?;
            }
        }
        Ok(c)
    }
}

impl Drop for KvSpace {
    fn drop(&mut self) {
        if self.promised_pages > 0 {
            self.mem.ledger().unpromise(self.promised_pages * self.page_bytes);
        }
        let Some(range) = self.range.as_ref() else { return };
        if self.pages.iter().all(Vec::is_empty) {
            return;
        }
        // Unmapping needs the stream done with these addresses.
        let _ = self.mem.stream.synchronize();
        let mut freed = Vec::new();
        for (r, pages) in self.pages.iter_mut().enumerate() {
            for (i, page) in pages.drain(..).enumerate() {
                range.unmap(r * self.region_bytes + i * self.page_bytes, self.page_bytes);
                freed.extend(Arc::into_inner(page));
            }
        }
        let mut l = self.mem.ledger();
        freed.into_iter().for_each(|p| l.give_page(p));
    }
}
