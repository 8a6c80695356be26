//! Sequence memory on the device: attention KV caches in pages mapped as sequences grow, Gated
//! DeltaNet conv rings and recurrent states in a pool of slots, both drawn from one budget (the
//! configured fraction of the device less everything else on it). A sequence reserves the
//! address range of its max-seq up front (address space, not memory), so its KV layout stays the
//! contiguous `[position][kv_dim]` the kernels and captured graphs read.
//!
//! Rows below a sequence's length are never written again (KV rows are appended), so a copy
//! shares the same physical pages, the partly filled last one included; it maps them only once it
//! continues, and then takes a page of its own for that last one (see [`KvSpace`]).

use super::budget::Ledger;
use super::device::{ptr, DeviceCopy};
use super::hostmem::PinnedPool;
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
    /// Pinned host chunks for copies of sequences moved out of the device.
    pinned: Arc<PinnedPool>,
    /// The stream those copies run on, beside the compute stream's queued work.
    copies: Arc<CudaStream>,
    /// Snapshot copies on the compute stream, by the SMs.
    dcopy: DeviceCopy,
}

/// A held space's pages mapped for reads queued on another stream
/// ([`KvSpace::read_regions_beside`]): unmapped when dropped, which must wait until those reads
/// are done. The space keeps the pages themselves.
pub struct MappedRegions {
    range: AddressRange,
    pieces: Vec<usize>,
    page_bytes: usize,
}

impl Drop for MappedRegions {
    fn drop(&mut self) {
        self.pieces.iter().for_each(|&off| self.range.unmap(off, self.page_bytes));
    }
}

impl SequenceMemory {
    pub fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, dcopy: DeviceCopy, slot_floats: usize, fraction: f64, cap: Option<usize>) -> Result<Arc<Self>> {
        let page = granularity(&ctx)?;
        let ledger = Mutex::new(Ledger::new(page, slot_floats * 4));
        let pinned = PinnedPool::new(ctx.clone());
        let copies = ctx.new_stream().map_err(|e| anyhow!("cannot create a CUDA stream: {e:?}"))?;
        Ok(Arc::new(SequenceMemory { ctx, stream, fraction, cap, slot_floats, ledger, pinned, copies, dcopy }))
    }

    /// The stream of host copies (CudaSequence::start_copy_to_host).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copies
    }

    pub fn pinned(&self) -> &Arc<PinnedPool> {
        &self.pinned
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
        let st = &self.mem.stream;
        self.mem.dcopy.copy(ptr(dst, st), ptr(self.buf(), st), self.bytes())?;
        Ok(s)
    }

    pub fn bytes(&self) -> usize {
        self.buf().len() * 4
    }

    pub fn memory(&self) -> &Arc<SequenceMemory> {
        &self.mem
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
/// `region_bytes` each, each region's pages in order (every region holds the same number).
///
/// A space that runs maps them into one reserved range as the sequence grows. A copy (a
/// prefix-cache snapshot, a fork) is *held*: it shares every page that holds its rows, the
/// partly filled last one included (its source may go on appending rows there, past the copy's),
/// and maps nothing, so a snapshot costs no mapping, no copy and no page of its own. A held space
/// maps the pages on its first growth, i.e. when a copy actually continues: then each region's
/// partly filled last page is copied into a page of its own first (copy on write), since the
/// copy's next rows go where its source's (or another copy's) may already be.
pub struct KvSpace {
    mem: Arc<SequenceMemory>,
    mapping: Mapping,
    regions: usize,
    region_bytes: usize,
    row_bytes: usize,
    page_bytes: usize,
    /// Pages per region, full ones shared with copies.
    pages: Vec<Vec<Arc<PhysPage>>>,
    /// Pages reserved against the budget and not yet drawn.
    promised_pages: usize,
}

enum Mapping {
    /// Region r's pages back to back from `r * region_bytes` of the range (`None`: no regions).
    Whole(Option<AddressRange>),
    /// A copy of `rows` rows, nothing mapped; each region's last page is shared with the source
    /// (partly filled unless `rows` fill it).
    Held { rows: usize },
}

impl KvSpace {
    /// Address space for `regions` regions of `max_rows` rows of `row_bytes`; no memory yet.
    pub fn new(mem: &Arc<SequenceMemory>, regions: usize, max_rows: usize, row_bytes: usize) -> Result<Self> {
        let page_bytes = mem.page_bytes();
        let region_bytes = (max_rows * row_bytes).div_ceil(page_bytes) * page_bytes;
        let mut s = KvSpace { mem: mem.clone(), mapping: Mapping::Whole(None), regions, region_bytes, row_bytes, page_bytes, pages: vec![Vec::new(); regions], promised_pages: 0 };
        s.mapping = Mapping::Whole(s.reserve_range()?);
        Ok(s)
    }

    /// The address range of every region (`None` when there is nothing to map).
    fn reserve_range(&self) -> Result<Option<AddressRange>> {
        if self.regions == 0 || self.region_bytes == 0 {
            return Ok(None);
        }
        Ok(Some(AddressRange::reserve(&self.mem.ctx, self.regions * self.region_bytes, self.page_bytes)?))
    }

    /// Device address of region `r` (row 0). Only a space that runs has one: every path that
    /// launches work on a sequence grows it first, which maps a held space.
    pub fn region(&self, r: usize) -> u64 {
        match &self.mapping {
            Mapping::Whole(range) => range.as_ref().map_or(0, |a| a.base()) + (r * self.region_bytes) as u64,
            Mapping::Held { .. } => unreachable!("a held KV space is mapped by its first growth, before any use"),
        }
    }

    /// Pages each region needs to hold `rows` rows.
    fn pages_for(&self, rows: usize) -> usize {
        (rows * self.row_bytes).div_ceil(self.page_bytes).min(self.region_bytes / self.page_bytes)
    }

    fn mapped_per_region(&self) -> usize {
        self.pages.iter().map(Vec::len).min().unwrap_or(0)
    }

    /// Whether this is a copy whose shared pages are not mapped yet.
    fn is_held(&self) -> bool {
        matches!(self.mapping, Mapping::Held { .. })
    }

    /// This space's share of the pages it holds: a page held by k spaces (a sequence and its
    /// snapshots) counts 1/k in each, so the shares of all spaces add up to the memory they hold.
    pub fn held_bytes(&self) -> usize {
        self.pages.iter().flatten().map(|p| self.page_bytes / Arc::strong_count(p)).sum()
    }

    /// The most [`KvSpace::held_bytes`] can come to while the space does not grow: every page
    /// it holds, shared or not.
    pub fn bound_bytes(&self) -> usize {
        self.pages.iter().map(Vec::len).sum::<usize>() * self.page_bytes
    }

    /// Reserves pages for `rows` rows in every region ([`crate::backend::MemoryFull`] when the
    /// budget cannot hold them).
    pub fn reserve(&mut self, rows: usize) -> Result<()> {
        let want = self.pages_for(rows) * self.regions;
        // A held space's partly filled last pages are shared, and its first growth takes a page
        // of its own for each.
        let have = self.pages.iter().map(Vec::len).sum::<usize>() - self.shared_tail_pages() + self.promised_pages;
        if want > have {
            self.mem.promise((want - have) * self.page_bytes)?;
            self.promised_pages += want - have;
        }
        Ok(())
    }

    /// Maps pages until every region holds `rows` rows: drawn from the reservation first, then
    /// from the free budget; all or none ([`crate::backend::MemoryFull`]). A held space first
    /// maps the pages it holds.
    pub fn grow(&mut self, rows: usize) -> Result<()> {
        self.map_held()?;
        let want = self.pages_for(rows);
        let missing: usize = self.pages.iter().map(|p| want.saturating_sub(p.len())).sum();
        if missing == 0 {
            return Ok(());
        }
        let from_promise = missing.min(self.promised_pages);
        let mut fresh = self.mem.take_pages(missing, from_promise * self.page_bytes)?;
        self.promised_pages -= from_promise;
        let Mapping::Whole(Some(range)) = &self.mapping else { unreachable!("regions with pages have a range") };
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

    /// Bytes of each region's last page that a held space's rows fill, when they fill it only in
    /// part (0 for a space that runs, or whose rows end on a page boundary).
    fn held_partial_bytes(&self) -> usize {
        match self.mapping {
            Mapping::Held { rows } if self.mapped_per_region() > 0 => (rows * self.row_bytes) % self.page_bytes,
            _ => 0,
        }
    }

    /// The shared, partly filled last pages a held space replaces on its first growth.
    fn shared_tail_pages(&self) -> usize {
        if self.held_partial_bytes() > 0 {
            self.regions
        } else {
            0
        }
    }

    /// Turns a held space into one that runs: a page of its own for each region's partly filled
    /// last page (drawn from the reservation first, its rows copied from the shared page), then
    /// every page mapped in order into a range of its own; a no-op otherwise. All or nothing:
    /// on an error the space is still held.
    fn map_held(&mut self) -> Result<()> {
        if !self.is_held() {
            return Ok(());
        }
        let partial = self.held_partial_bytes();
        if partial > 0 {
            self.own_tail_pages(partial)?;
        }
        let range = self.map_all()?;
        self.mapping = Mapping::Whole(range);
        Ok(())
    }

    /// Copy on write: replaces each region's shared last page by a fresh one holding its first
    /// `partial` bytes. The shared pages are mapped for the copy in a small range of their own
    /// and the fresh ones in another, both unmapped once the copies are done.
    fn own_tail_pages(&mut self, partial: usize) -> Result<()> {
        let from_promise = self.regions.min(self.promised_pages);
        let fresh = self.mem.take_pages(self.regions, from_promise * self.page_bytes)?;
        let give_back = |fresh: Vec<PhysPage>| {
            let mut l = self.mem.ledger();
            fresh.into_iter().for_each(|p| l.give_page(p));
        };
        let shared: Vec<&PhysPage> = self.pages.iter().map(|p| p.last().expect("a held space with a partial page holds it").as_ref()).collect();
        let copied = (|| -> Result<()> {
            let src = self.page_run(&shared)?;
            let dst = match self.page_run(&fresh.iter().collect::<Vec<_>>()) {
                Ok(d) => d,
                Err(e) => {
                    self.unmap_page_run(&src);
                    return Err(e);
                }
            };
            let r = (0..self.regions).try_for_each(|r| self.mem.dcopy.copy(dst.base() + (r * self.page_bytes) as u64, src.base() + (r * self.page_bytes) as u64, partial));
            // The copies must be done before either range is unmapped.
            let _ = self.mem.stream.synchronize();
            self.unmap_page_run(&src);
            self.unmap_page_run(&dst);
            r
        })();
        if let Err(e) = copied {
            give_back(fresh);
            return Err(e);
        }
        self.promised_pages -= from_promise;
        let mut l = self.mem.ledger();
        for (region, page) in self.pages.iter_mut().zip(fresh) {
            let shared = std::mem::replace(region.last_mut().expect("checked above"), Arc::new(page));
            // The last holder of a page gives it back (the copies reading it are done).
            if let Some(p) = Arc::into_inner(shared) {
                l.give_page(p);
            }
        }
        Ok(())
    }

    /// A range with `pages` (one per region) mapped back to back; nothing stays mapped on failure.
    fn page_run(&self, pages: &[&PhysPage]) -> Result<AddressRange> {
        let range = AddressRange::reserve(&self.mem.ctx, pages.len() * self.page_bytes, self.page_bytes)?;
        range.map_run(0, pages, self.page_bytes)?;
        Ok(range)
    }

    /// A range of this space's own with every page it holds mapped in order (`None` when there
    /// is nothing to map); nothing stays mapped on failure.
    fn map_all(&self) -> Result<Option<AddressRange>> {
        let Some(range) = self.reserve_range()? else { return Ok(None) };
        for r in 0..self.regions {
            let run: Vec<&PhysPage> = self.pages[r].iter().map(|p| p.as_ref()).collect();
            if let Err(e) = range.map_run(r * self.region_bytes, &run, self.page_bytes) {
                self.unmap_regions(&range, r);
                return Err(e);
            }
        }
        Ok(Some(range))
    }

    /// Runs `f` with the device address of each region's row 0 (`f` queues reads of the rows
    /// this space holds, on any stream). A held space maps its pages into a range for the call;
    /// that mapping comes back with the result, to be dropped (unmapping the pages) only once
    /// those reads are done; on an error nothing stays mapped, so the caller first waits for its
    /// stream.
    pub fn read_regions_beside<R>(&self, f: impl FnOnce(&dyn Fn(usize) -> u64) -> Result<R>) -> (Result<R>, Option<MappedRegions>) {
        if !self.is_held() {
            return (f(&|r| self.region(r)), None);
        }
        let range = match self.map_all() {
            Ok(Some(range)) => range,
            Ok(None) => return (f(&|_| 0), None),
            Err(e) => return (Err(e), None),
        };
        let out = f(&|r| range.base() + (r * self.region_bytes) as u64);
        let pieces = (0..self.regions).flat_map(|r| (0..self.pages[r].len()).map(move |i| r * self.region_bytes + i * self.page_bytes)).collect();
        (out, Some(MappedRegions { range, pieces, page_bytes: self.page_bytes }))
    }

    pub fn regions(&self) -> usize {
        self.regions
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Unmaps a [`Self::page_run`] (after the stream is done with its pages).
    fn unmap_page_run(&self, run: &AddressRange) {
        (0..self.regions).for_each(|r| run.unmap(r * self.page_bytes, self.page_bytes));
    }

    /// Unmaps the pages of regions `0..regions` from `range` (after the stream is done with them).
    fn unmap_regions(&self, range: &AddressRange, regions: usize) {
        for (r, pages) in self.pages[..regions].iter().enumerate() {
            (0..pages.len()).for_each(|i| range.unmap(r * self.region_bytes + i * self.page_bytes, self.page_bytes));
        }
    }

    /// A held copy of the first `rows` rows of this space: every page holding them shared, none
    /// mapped, nothing copied. A held space can only be copied whole.
    pub fn try_clone(&self, rows: usize) -> Result<Self> {
        let keep = match self.mapping {
            Mapping::Whole(None) => 0,
            Mapping::Whole(Some(_)) => {
                let need = self.pages_for(rows);
                if need > self.mapped_per_region() {
                    anyhow::bail!("a KV space of {} pages per region copied at {rows} rows", self.mapped_per_region());
                }
                need
            }
            Mapping::Held { rows: held } => {
                if rows != held {
                    anyhow::bail!("a held KV space of {held} rows copied at {rows}");
                }
                self.mapped_per_region()
            }
        };
        Ok(KvSpace {
            mem: self.mem.clone(),
            mapping: Mapping::Held { rows },
            regions: self.regions,
            region_bytes: self.region_bytes,
            row_bytes: self.row_bytes,
            page_bytes: self.page_bytes,
            pages: self.pages.iter().map(|p| p[..keep.min(p.len())].to_vec()).collect(),
            promised_pages: 0,
        })
    }
}

impl Drop for KvSpace {
    fn drop(&mut self) {
        if self.promised_pages > 0 {
            self.mem.ledger().unpromise(self.promised_pages * self.page_bytes);
        }
        if self.pages.iter().all(Vec::is_empty) {
            return;
        }
        // Unmapping needs the stream done with these addresses.
        let _ = self.mem.stream.synchronize();
        // A held space maps nothing.
        if let Mapping::Whole(Some(range)) = std::mem::replace(&mut self.mapping, Mapping::Whole(None)) {
            self.unmap_regions(&range, self.regions);
        }
        let freed: Vec<PhysPage> = self.pages.iter_mut().flat_map(|p| p.drain(..)).filter_map(Arc::into_inner).collect();
        let mut l = self.mem.ledger();
        freed.into_iter().for_each(|p| l.give_page(p));
    }
}
