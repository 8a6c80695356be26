//! The accounting of sequence memory: KV pages and Gated DeltaNet state slots drawn from one
//! byte budget, freed ones kept for reuse, and promises (a sequence's reservation of room it
//! will grow into). Generic over what a page and a slot are, so the rules are tested on the host.

use crate::backend::MemoryFull;
use anyhow::Result;

pub struct Ledger<P, S> {
    page_bytes: usize,
    slot_bytes: usize,
    /// Bytes allocated from the driver: in use plus cached (free lists).
    held: usize,
    /// Bytes sequences reserved and have not drawn yet.
    promised: usize,
    free_pages: Vec<P>,
    free_slots: Vec<S>,
}

impl<P, S> Ledger<P, S> {
    pub fn new(page_bytes: usize, slot_bytes: usize) -> Self {
        Ledger { page_bytes, slot_bytes, held: 0, promised: 0, free_pages: Vec::new(), free_slots: Vec::new() }
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Allocated and kept for reuse.
    pub fn cached(&self) -> usize {
        self.free_pages.len() * self.page_bytes + self.free_slots.len() * self.slot_bytes
    }

    /// Allocated (in use or cached).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Held by live sequences.
    pub fn in_use(&self) -> usize {
        self.held - self.cached()
    }

    pub fn promised(&self) -> usize {
        self.promised
    }

    /// Bytes of `limit` neither in use nor promised.
    pub fn available(&self, limit: usize) -> usize {
        limit.saturating_sub(self.in_use() + self.promised)
    }

    fn fits(&self, bytes: usize, limit: usize) -> Result<()> {
        let available = self.available(limit);
        if bytes > available {
            return Err(MemoryFull { needed_bytes: bytes, available_bytes: available }.into());
        }
        Ok(())
    }

    /// Reserves `bytes` of the budget for a sequence to draw later (all or nothing).
    pub fn promise(&mut self, bytes: usize, limit: usize) -> Result<()> {
        self.fits(bytes, limit)?;
        self.promised += bytes;
        Ok(())
    }

    /// Returns an unused reservation.
    pub fn unpromise(&mut self, bytes: usize) {
        debug_assert!(bytes <= self.promised);
        self.promised -= bytes.min(self.promised);
    }

    /// Makes room under `limit` for `bytes` more held bytes by freeing cached items, slots
    /// before pages when a page is wanted and the other way round.
    fn make_room(&mut self, bytes: usize, limit: usize, want_page: bool) {
        while self.held + bytes > limit {
            let freed = if want_page {
                self.free_slots.pop().map(|_| self.slot_bytes).or_else(|| self.free_pages.pop().map(|_| self.page_bytes))
            } else {
                self.free_pages.pop().map(|_| self.page_bytes).or_else(|| self.free_slots.pop().map(|_| self.slot_bytes))
            };
            match freed {
                Some(b) => self.held -= b,
                None => return,
            }
        }
    }

    /// Takes `n` pages, `from_promise` bytes of them out of the caller's reservation and the
    /// rest out of the free budget: all of them, or none and an error ([`MemoryFull`] when the
    /// budget is the reason). `create` allocates a page when none is cached.
    pub fn take_pages(&mut self, n: usize, from_promise: usize, limit: usize, mut create: impl FnMut() -> Result<P>) -> Result<Vec<P>> {
        let bytes = n * self.page_bytes;
        let from_promise = from_promise.min(bytes).min(self.promised);
        self.fits(bytes - from_promise, limit)?;
        self.promised -= from_promise;
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            if let Some(p) = self.free_pages.pop() {
                got.push(p);
                continue;
            }
            self.make_room(self.page_bytes, limit, true);
            match create() {
                Ok(p) => {
                    self.held += self.page_bytes;
                    got.push(p);
                }
                Err(e) => {
                    self.free_pages.extend(got);
                    self.promised += from_promise;
                    return Err(e);
                }
            }
        }
        Ok(got)
    }

    /// Takes a state slot out of the free budget (cached or made by `create`).
    pub fn take_slot(&mut self, limit: usize, create: impl FnOnce() -> Result<S>) -> Result<S> {
        self.fits(self.slot_bytes, limit)?;
        if let Some(s) = self.free_slots.pop() {
            return Ok(s);
        }
        self.make_room(self.slot_bytes, limit, false);
        let s = create()?;
        self.held += self.slot_bytes;
        Ok(s)
    }

    pub fn give_page(&mut self, p: P) {
        self.free_pages.push(p);
    }

    pub fn give_slot(&mut self, s: S) {
        self.free_slots.push(s);
    }

    /// Frees every cached page and slot (returns the bytes freed).
    pub fn trim(&mut self) -> usize {
        let freed = self.cached();
        self.free_pages.clear();
        self.free_slots.clear();
        self.held -= freed;
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> Ledger<u32, u32> {
        Ledger::new(2, 10)
    }

    fn full(e: anyhow::Error) -> MemoryFull {
        e.downcast::<MemoryFull>().expect("a MemoryFull error")
    }

    #[test]
    fn pages_and_slots_share_one_budget() {
        let mut l = ledger();
        let mut next = 0;
        let slot = l.take_slot(20, || Ok(7)).unwrap();
        assert_eq!((slot, l.in_use(), l.available(20)), (7, 10, 10));
        let pages = l.take_pages(5, 0, 20, || { next += 1; Ok(next) }).unwrap();
        assert_eq!(pages, vec![1, 2, 3, 4, 5]);
        assert_eq!(l.available(20), 0);
        let e = full(l.take_pages(1, 0, 20, || Ok(99)).unwrap_err());
        assert_eq!((e.needed_bytes, e.available_bytes), (2, 0));
        assert!(l.take_slot(20, || Ok(8)).is_err());
        // A freed slot is cached, and its budget is available again.
        l.give_slot(slot);
        assert_eq!((l.in_use(), l.cached(), l.available(20)), (10, 10, 10));
    }

    #[test]
    fn all_or_nothing_when_the_budget_is_short() {
        let mut l = ledger();
        let mut made = 0;
        assert!(l.take_pages(6, 0, 10, || { made += 1; Ok(made) }).is_err());
        assert_eq!((made, l.held()), (0, 0), "nothing was allocated for a request that cannot fit");
        // A failing allocation gives back what it took.
        let mut calls = 0;
        let r = l.take_pages(3, 0, 10, || {
            calls += 1;
            if calls == 3 { anyhow::bail!("driver out of memory") } else { Ok(calls) }
        });
        assert!(r.is_err());
        assert_eq!((l.in_use(), l.cached()), (0, 4));
    }

    #[test]
    fn promises_hold_room_for_their_owner() {
        let mut l = ledger();
        l.promise(6, 10).unwrap();
        assert_eq!(l.available(10), 4);
        // Someone else cannot take the promised room...
        assert!(l.take_pages(3, 0, 10, || Ok(0)).is_err());
        // ...its owner can, and the promise shrinks by what it drew.
        let p = l.take_pages(3, 6, 10, || Ok(1)).unwrap();
        assert_eq!((p.len(), l.promised(), l.available(10)), (3, 0, 4));
        assert!(l.promise(6, 10).is_err());
        l.promise(4, 10).unwrap();
        l.unpromise(4);
        assert_eq!(l.available(10), 4);
    }

    #[test]
    fn cached_items_of_the_other_kind_make_room() {
        let mut l = ledger();
        let s = l.take_slot(12, || Ok(1)).unwrap();
        l.give_slot(s);
        assert_eq!((l.held(), l.cached()), (10, 10));
        // 6 pages (12 bytes) fit the budget only once the cached slot is freed.
        let mut made = 0;
        l.take_pages(6, 0, 12, || { made += 1; Ok(made) }).unwrap();
        assert_eq!((made, l.held(), l.cached()), (6, 12, 0));
        for p in 1..=6 {
            l.give_page(p);
        }
        // A slot wanted now reuses no page but frees cached ones for itself.
        l.take_slot(12, || Ok(2)).unwrap();
        assert_eq!((l.held(), l.in_use()), (12, 10));
        assert_eq!(l.trim(), 2);
        assert_eq!(l.held(), 10);
    }
}
