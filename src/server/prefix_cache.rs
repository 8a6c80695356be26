//! Prefix cache: snapshots of sequences (KV + Gated DeltaNet state) keyed by the exact tokens
//! they hold. The recurrent state cannot be truncated, so an entry can only serve prompts that
//! strictly extend its tokens: a new prompt resumes from the longest cached entry whose tokens
//! are a proper prefix of it (at least one token is always left to prefill, which yields the
//! logits). `prompt_cache_key` is a preference among valid candidates, never a substitute for
//! token equality. Entries are bounded by a byte budget and evicted least-recently-used; an
//! entry's size is read from the item whenever it counts (on the GPU a snapshot shares KV pages
//! with other sequences, so what it holds changes as they come and go). With a host tier, an
//! entry pushed out of the device moves to host memory (bounded by its own budget, least
//! recently used across both tiers going first) and a hit on it is copied back.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// Where an entry's item is: in the backend's own memory (a sequence ready to copy), or moved to
/// host memory (the host tier: copied back on a hit instead of being recomputed).
#[derive(Debug)]
pub enum Stored<T, H> {
    Device(T),
    Host(H),
}

impl<T, H> Stored<T, H> {
    pub fn as_ref(&self) -> Stored<&T, &H> {
        match self {
            Stored::Device(t) => Stored::Device(t),
            Stored::Host(h) => Stored::Host(h),
        }
    }
}

#[derive(Debug)]
struct Entry<T, H> {
    tokens: Vec<u32>,
    item: Stored<T, H>,
    key: Option<String>,
    last_used: u64,
    /// The most device memory the item can come to hold ([`PrefixCache::with_bound`]), read
    /// when it was stored; 0 in the host tier or without a bound.
    bound: usize,
}

/// The host tier: where entries the device budget pushes out go, while they fit its budget.
#[derive(Debug)]
pub struct HostTier<T, H> {
    pub budget: usize,
    /// Copies an item to host memory.
    pub spill: fn(&T) -> anyhow::Result<H>,
    /// Host bytes the copy of an item will take (known before it is made).
    pub spill_bytes: fn(&T) -> usize,
    /// Host bytes a copy holds.
    pub size: fn(&H) -> usize,
}

#[derive(Debug)]
pub struct PrefixCache<T, H = ()> {
    entries: Vec<Entry<T, H>>,
    budget: usize,
    /// What an item holds now, in bytes.
    size: fn(&T) -> usize,
    /// The most an item can come to hold ([`PrefixCache::with_bound`]).
    bound: Option<fn(&T) -> usize>,
    host: Option<HostTier<T, H>>,
    clock: u64,
    pub lookups: u64,
    pub hits: u64,
    /// Hits served from the host tier.
    pub host_hits: u64,
    /// Entries moved to the host tier, and the milliseconds their copies took (waited for).
    pub spills: u64,
    pub spill_ms: u64,
    /// Host bytes promised to entries taken out to move (`take_lru_to_move`) until they settle.
    moving_bytes: usize,
}

/// A device-tier entry taken out of the cache while its host copy is made beside the backend's
/// work ([`PrefixCache::take_lru_to_move`], [`PrefixCache::settle_moved`]).
pub struct Leaving<T> {
    pub item: T,
    tokens: Vec<u32>,
    key: Option<String>,
    last_used: u64,
    host_bytes: usize,
}

impl<T, H> PrefixCache<T, H> {
    pub fn new(budget_bytes: usize, size: fn(&T) -> usize) -> Self {
        PrefixCache { entries: Vec::new(), budget: budget_bytes, size, bound: None, host: None, clock: 0, lookups: 0, hits: 0, host_hits: 0, spills: 0, spill_ms: 0, moving_bytes: 0 }
    }

    /// `bound(item)`: the most `size(item)` can ever report for an item once stored (what it
    /// holds with nothing shared). Reading every entry's size walks what each shares (on the GPU,
    /// every KV page), so with hundreds of entries each insert would pay for it; with a bound,
    /// an insert whose entries' bounds leave room for it reads no size.
    pub fn with_bound(mut self, bound: fn(&T) -> usize) -> Self {
        self.bound = Some(bound);
        self
    }

    /// Entries the device budget pushes out move to `tier` instead of being dropped.
    pub fn with_host_tier(mut self, tier: HostTier<T, H>) -> Self {
        self.host = Some(tier).filter(|t| t.budget > 0);
        self
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in the host tier.
    pub fn host_len(&self) -> usize {
        self.entries.iter().filter(|e| matches!(e.item, Stored::Host(_))).count()
    }

    /// Bytes the device-tier entries hold.
    pub fn memory_bytes(&self) -> usize {
        self.entries.iter().map(|e| self.device_bytes(e)).sum()
    }

    /// Bytes the host-tier entries hold.
    pub fn host_memory_bytes(&self) -> usize {
        self.entries.iter().map(|e| self.host_bytes(e)).sum()
    }

    fn device_bytes(&self, e: &Entry<T, H>) -> usize {
        match &e.item {
            Stored::Device(t) => (self.size)(t),
            Stored::Host(_) => 0,
        }
    }

    fn host_bytes(&self, e: &Entry<T, H>) -> usize {
        match (&e.item, &self.host) {
            (Stored::Host(h), Some(tier)) => (tier.size)(h),
            _ => 0,
        }
    }

    /// Best entry for `prompt`: its item (the caller copies it to resume from it) and the
    /// number of tokens it covers.
    pub fn lookup(&mut self, prompt: &[u32], key: Option<&str>) -> Option<(Stored<&T, &H>, usize)> {
        self.lookups += 1;
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.tokens.is_empty() && e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            // The longest match wins; the request's prompt_cache_key only breaks ties.
            .max_by_key(|(_, e)| (e.tokens.len(), key.is_some() && e.key.as_deref() == key, e.last_used))
            .map(|(i, _)| i)?;
        self.clock += 1;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        self.hits += 1;
        if matches!(e.item, Stored::Host(_)) {
            self.host_hits += 1;
        }
        Some((e.item.as_ref(), e.tokens.len()))
    }

    /// Stores `item` holding exactly `tokens`. Replaces an entry with the same tokens; evicts
    /// least-recently-used entries to stay within the budget; an item larger than the whole
    /// budget goes straight to the host tier (or is not stored without one).
    pub fn insert(&mut self, tokens: Vec<u32>, item: T, key: Option<String>) {
        if tokens.is_empty() {
            return;
        }
        self.entries.retain(|e| e.tokens != tokens);
        let bytes = (self.size)(&item);
        if bytes > self.budget {
            self.clock += 1;
            if let Some(host) = self.spill(&item, self.clock) {
                self.spills += 1;
                self.entries.push(Entry { tokens, item: Stored::Host(host), key, last_used: self.clock, bound: 0 });
            }
            return;
        }
        // Without room by the bounds, the sizes as they are now (sharers may have gone).
        let bounded: Option<usize> = self.bound.map(|_| self.entries.iter().map(|e| e.bound).sum());
        if !bounded.is_some_and(|b| b + bytes <= self.budget) {
            let mut used = self.memory_bytes();
            while used + bytes > self.budget {
                match self.evict_lru() {
                    Some(freed) => used = used.saturating_sub(freed),
                    None => break,
                }
            }
        }
        self.clock += 1;
        let bound = self.bound.map_or(0, |f| f(&item).max(bytes));
        self.entries.push(Entry { tokens, item: Stored::Device(item), key, last_used: self.clock, bound });
    }

    /// A copy (`copy`) of the item of the longest cached prefix of `prompt`, and that prefix's
    /// length, as [`PrefixCache::lookup`] finds it. While the copy fails for want of memory
    /// (`is_full`), other device-tier entries are evicted, least recently used first; `None`
    /// when nothing matches, the error when the copy fails otherwise or nothing else is left to
    /// evict.
    pub fn copy_longest<R>(&mut self, prompt: &[u32], key: Option<&str>, mut copy: impl FnMut(Stored<&T, &H>) -> anyhow::Result<R>, is_full: impl Fn(&anyhow::Error) -> bool) -> Option<anyhow::Result<(R, usize)>> {
        let n = self.lookup(prompt, key)?.1;
        let stamp = self.clock;
        loop {
            let hit = self.entries.iter().find(|e| e.last_used == stamp).expect("the hit is never evicted here");
            match copy(hit.item.as_ref()) {
                Ok(r) => return Some(Ok((r, n))),
                Err(e) if is_full(&e) && self.evict_device(Some(stamp)).is_some() => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Frees the device memory of the least-recently-used device-tier entry (for a request or a
    /// newer entry): it moves to the host tier when there is one and it fits, else it is
    /// dropped. Returns the device bytes it held; `None` when no entry is on the device.
    pub fn evict_lru(&mut self) -> Option<usize> {
        self.evict_device(None)
    }

    fn evict_device(&mut self, keep: Option<u64>) -> Option<usize> {
        let i = self.entries.iter().enumerate().filter(|(_, e)| matches!(e.item, Stored::Device(_)) && Some(e.last_used) != keep).min_by_key(|(_, e)| e.last_used).map(|(i, _)| i)?;
        let e = self.entries.swap_remove(i);
        let freed = self.device_bytes(&e);
        let Stored::Device(item) = e.item else { unreachable!("chosen among device entries") };
        if let Some(host) = self.spill(&item, e.last_used) {
            self.spills += 1;
            self.entries.push(Entry { tokens: e.tokens, item: Stored::Host(host), key: e.key, last_used: e.last_used, bound: 0 });
        }
        Some(freed)
    }

    /// A host copy of `item` (last used at `stamp`) once the host tier has room for it: older
    /// host entries are dropped for it, never newer ones. `None` when it does not fit or the
    /// copy fails (it is logged; the entry is then recomputed if ever needed).
    fn spill(&mut self, item: &T, stamp: u64) -> Option<H> {
        let tier = self.host.as_ref()?;
        let (need, spill) = ((tier.spill_bytes)(item), tier.spill);
        if !self.host_room(need, stamp) {
            return None;
        }
        self.timed_copy(|| spill(item))
    }

    /// Makes room in the host tier for `need` bytes of an entry last used at `stamp` by dropping
    /// older host entries (never newer ones); whether it fits.
    fn host_room(&mut self, need: usize, stamp: u64) -> bool {
        let Some(budget) = self.host.as_ref().map(|t| t.budget) else { return false };
        if need > budget {
            return false;
        }
        while self.host_memory_bytes() + self.moving_bytes + need > budget {
            let oldest = self.entries.iter().enumerate().filter(|(_, e)| matches!(e.item, Stored::Host(_))).min_by_key(|(_, e)| e.last_used).map(|(i, e)| (i, e.last_used));
            match oldest {
                Some((i, used)) if used < stamp => drop(self.entries.swap_remove(i)),
                _ => return false,
            }
        }
        true
    }

    /// Runs a host copy, counting the time it takes; a failed one is logged and dropped.
    fn timed_copy(&mut self, copy: impl FnOnce() -> anyhow::Result<H>) -> Option<H> {
        let t0 = std::time::Instant::now();
        let copy = copy();
        self.spill_ms += t0.elapsed().as_millis() as u64;
        match copy {
            Ok(h) => Some(h),
            Err(e) => {
                eprintln!("lily: prefix-cache entry dropped (moving it to host memory failed: {e:#})");
                None
            }
        }
    }

    /// Takes the least-recently-used device-tier entry out of the cache to move it to the host
    /// tier while the backend works (the caller starts the copy, then hands it to
    /// [`PrefixCache::settle_moved`]); its room in the host tier is kept for it meanwhile. `None`
    /// without a host tier, without device entries, or when the host tier cannot take the entry
    /// (it then stays: eviction drops it when its memory is needed).
    pub fn take_lru_to_move(&mut self) -> Option<Leaving<T>> {
        let spill_bytes = self.host.as_ref()?.spill_bytes;
        let (i, stamp) = self.entries.iter().enumerate().filter(|(_, e)| matches!(e.item, Stored::Device(_))).min_by_key(|(_, e)| e.last_used).map(|(i, e)| (i, e.last_used))?;
        let Stored::Device(item) = &self.entries[i].item else { unreachable!("chosen among device entries") };
        let need = spill_bytes(item);
        if !self.host_room(need, stamp) {
            return None;
        }
        // host_room may have dropped host entries: find the entry again by its stamp.
        let i = self.entries.iter().position(|e| e.last_used == stamp && matches!(e.item, Stored::Device(_)))?;
        let e = self.entries.swap_remove(i);
        let Stored::Device(item) = e.item else { unreachable!("found among device entries") };
        self.moving_bytes += need;
        Some(Leaving { item, tokens: e.tokens, key: e.key, last_used: e.last_used, host_bytes: need })
    }

    /// Brings an entry taken by [`PrefixCache::take_lru_to_move`] back as a host-tier entry once
    /// `copy` (waiting for its host copy) returns it; a failed copy drops the entry. Returns the
    /// device item, for the caller to free when the backend is idle.
    pub fn settle_moved(&mut self, leaving: Leaving<T>, copy: impl FnOnce() -> anyhow::Result<H>) -> T {
        let Leaving { item, tokens, key, last_used, host_bytes } = leaving;
        self.moving_bytes -= host_bytes;
        if let Some(host) = self.timed_copy(copy) {
            self.spills += 1;
            // An entry inserted meanwhile with the same tokens is newer.
            if !self.entries.iter().any(|e| e.tokens == tokens) {
                self.entries.push(Entry { tokens, item: Stored::Host(host), key, last_used, bound: 0 });
            }
        }
        item
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Whether an entry holds exactly `tokens`.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Whether entries are kept at all (a device budget or a host tier).
    pub fn enabled(&self) -> bool {
        self.budget > 0 || self.host.is_some()
    }
}

/// Where a prefill of `prompt` stops to snapshot its sequence, the first position after `fed`
/// among: the start of each chat message (a `boundary` token such as `<|im_start|>`: the
/// conversation so far, which the next turn's prompt repeats even when the template re-renders
/// what comes after, e.g. without the earlier reasoning), every `every` tokens (0: never; long
/// shared documents), and `last` (prompt length - 1: an exact repeat of the prompt). A snapshot at
/// position p holds the first p tokens.
pub fn next_checkpoint(prompt: &[u32], fed: usize, last: usize, boundary: Option<u32>, every: usize) -> usize {
    let mut stop = last;
    if every > 0 {
        stop = stop.min((fed / every + 1) * every);
    }
    if let Some(b) = boundary {
        if let Some(i) = prompt[fed + 1..stop.min(prompt.len())].iter().position(|&t| t == b) {
            stop = fed + 1 + i;
        }
    }
    stop
}

/// The last prompts a server saw (their tokens' hashes, at most `cap`, oldest forgotten first).
/// A prompt that goes in with its first token takes no exact-repeat snapshot (its state before
/// the last token is never formed); one seen before is likely to come again, so its snapshot is
/// worth the decode step of the last token that forming it costs.
pub struct RecentPrompts {
    order: VecDeque<u64>,
    seen: HashMap<u64, usize>,
    cap: usize,
}

impl RecentPrompts {
    pub fn new(cap: usize) -> Self {
        RecentPrompts { order: Default::default(), seen: Default::default(), cap }
    }

    /// Records `prompt`; returns whether it was among the recent prompts already.
    pub fn seen_again(&mut self, prompt: &[u32]) -> bool {
        if self.cap == 0 {
            return false;
        }
        let mut h = DefaultHasher::new();
        prompt.hash(&mut h);
        let key = h.finish();
        let again = self.seen.contains_key(&key);
        *self.seen.entry(key).or_insert(0) += 1;
        self.order.push_back(key);
        if self.order.len() > self.cap {
            let old = self.order.pop_front().expect("longer than its cap");
            if let Some(n) = self.seen.get_mut(&old) {
                *n -= 1;
                if *n == 0 {
                    self.seen.remove(&old);
                }
            }
        }
        again
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test items: a name and the bytes it holds.
    type Item = (&'static str, usize);

    /// A cache whose host copies are the items themselves.
    type Cache = PrefixCache<Item, Item>;

    fn cache(budget: usize) -> Cache {
        PrefixCache::new(budget, |t| t.1)
    }

    /// `name` of a device-tier item, `host:name` of a host-tier one.
    fn name(item: Stored<&Item, &Item>) -> String {
        match item {
            Stored::Device(t) => t.0.to_string(),
            Stored::Host(h) => format!("host:{}", h.0),
        }
    }

    /// `lookup` with the item's name copied out.
    fn find(c: &mut Cache, prompt: &[u32], key: Option<&str>) -> Option<(String, usize)> {
        c.lookup(prompt, key).map(|(t, n)| (name(t), n))
    }

    fn s(name: &str, n: usize) -> Option<(String, usize)> {
        Some((name.to_string(), n))
    }

    #[test]
    fn longest_strict_prefix_and_key_preference() {
        let mut c = cache(100);
        c.insert(vec![1, 2], ("a", 10), None);
        c.insert(vec![1, 2, 3, 4], ("b", 10), None);
        c.insert(vec![1, 2, 3], ("k", 10), Some("conv".into()));
        assert_eq!(find(&mut c, &[1, 2, 3, 4, 5], None), s("b", 4));
        // The key never outranks a longer match (a keyed short entry would re-prefill more).
        assert_eq!(find(&mut c, &[1, 2, 3, 4, 5], Some("conv")), s("b", 4));
        // Exact length is not a hit (one token must remain); the shorter prefix is.
        assert_eq!(find(&mut c, &[1, 2, 3, 4], None), s("k", 3));
        // A key never bypasses token equality.
        assert_eq!(find(&mut c, &[9, 9, 9, 9, 9], Some("conv")), None);
        assert_eq!(c.lookups, 4);
        assert_eq!(c.hits, 3);
    }

    #[test]
    fn a_keyed_short_entry_does_not_beat_a_long_match() {
        // The audit's case: a keyed 4-token entry against a 446-token match of the same prompt.
        let long: Vec<u32> = (0..446).collect();
        let mut c = cache(100);
        c.insert(long.clone(), ("long", 10), None);
        c.insert(long[..4].to_vec(), ("keyed", 10), Some("user-7".into()));
        let prompt: Vec<u32> = (0..500).collect();
        assert_eq!(find(&mut c, &prompt, Some("user-7")), s("long", 446));
    }

    #[test]
    fn checkpoints_at_message_starts_every_n_tokens_and_before_the_last_token() {
        const B: u32 = 7;
        let prompt = [B, 1, 2, B, 3, 4, 5, 6, B, 8, 9, 10, 11, 12];
        let last = prompt.len() - 1;
        let stops = |every| {
            let (mut fed, mut out) = (0, vec![]);
            while fed < last {
                fed = next_checkpoint(&prompt, fed, last, Some(B), every);
                out.push(fed);
            }
            out
        };
        // The leading boundary holds nothing: the first stop is the second message's start.
        assert_eq!(stops(0), vec![3, 8, 13]);
        assert_eq!(stops(5), vec![3, 5, 8, 10, 13]);
        assert_eq!(next_checkpoint(&prompt, 0, last, None, 0), last);
        assert_eq!(next_checkpoint(&prompt, 9, last, None, 4), 12);
    }

    #[test]
    fn a_hit_copy_evicts_other_entries_while_memory_is_full() {
        let mut c = cache(100);
        c.insert(vec![1], ("old", 10), None);
        c.insert(vec![2], ("older-used", 10), None);
        c.insert(vec![3, 4], ("hit", 10), None);
        assert!(c.lookup(&[2, 0], None).is_some()); // "old" is now the least recently used
        let full = |e: &anyhow::Error| e.to_string() == "full";
        // The copy succeeds once two entries are gone: they go in LRU order, the hit stays.
        let mut tries = 0;
        let r = c.copy_longest(&[3, 4, 5], None, |item| { tries += 1; if tries < 3 { anyhow::bail!("full") } Ok(name(item)) }, full);
        assert_eq!(r.map(|r| r.unwrap()), s("hit", 2));
        assert_eq!((c.len(), find(&mut c, &[3, 4, 0], None)), (1, s("hit", 2)));
        // With nothing else to evict the error stands; an error of another kind evicts nothing.
        c.insert(vec![7], ("other", 10), None);
        let r = c.copy_longest(&[3, 4, 5], None, |_| -> anyhow::Result<()> { anyhow::bail!("broken") }, full);
        assert_eq!(r.map(|r| r.unwrap_err().to_string()), Some("broken".into()));
        assert_eq!(c.len(), 2);
        let r = c.copy_longest(&[3, 4, 5], None, |_| -> anyhow::Result<()> { anyhow::bail!("full") }, full);
        assert_eq!(r.map(|r| r.unwrap_err().to_string()), Some("full".into()));
        assert_eq!((c.len(), c.contains(&[3, 4])), (1, true));
        assert!(c.copy_longest(&[9, 9], None, |item| Ok(name(item)), full).is_none());
    }

    #[test]
    fn sizes_are_read_from_the_items_when_they_count() {
        use std::cell::Cell;
        use std::rc::Rc;
        let mut c: PrefixCache<Rc<Cell<usize>>> = PrefixCache::new(100, |s| s.get());
        let size = Rc::new(Cell::new(30));
        c.insert(vec![1], size.clone(), None);
        c.insert(vec![2], Rc::new(Cell::new(30)), None);
        assert_eq!(c.memory_bytes(), 60);
        // A sharer went: the first entry now holds more, and the budget sees it.
        size.set(60);
        assert_eq!(c.memory_bytes(), 90);
        c.insert(vec![3], Rc::new(Cell::new(20)), None);
        assert_eq!((c.len(), c.contains(&[1])), (2, false));
    }

    #[test]
    fn an_insert_within_the_bounds_reads_no_size() {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        static READS: AtomicUsize = AtomicUsize::new(0);
        // Items (size now, the most it can come to): sizes are counted as they are read.
        let mut c: PrefixCache<(usize, usize)> = PrefixCache::new(100, |t: &(usize, usize)| {
            READS.fetch_add(1, Relaxed);
            t.0
        })
        .with_bound(|t: &(usize, usize)| t.1);
        c.insert(vec![1], (20, 30), None);
        c.insert(vec![2], (20, 30), None);
        c.insert(vec![3], (20, 30), None);
        // Bounds 90 + 10: room; only the new items' own sizes were read.
        c.insert(vec![4], (10, 10), None);
        assert_eq!((READS.load(Relaxed), c.len()), (4, 4));
        // Bounds 100 + 20 are over the budget, the sizes (70 + 20) are not: nothing is evicted.
        c.insert(vec![5], (20, 20), None);
        assert_eq!(c.len(), 5);
        assert!(READS.load(Relaxed) > 5, "the sizes were read");
        // Sizes 90 + 20: the least recently used goes, as without a bound.
        c.insert(vec![6], (20, 20), None);
        assert_eq!((c.len(), c.contains(&[1]), c.contains(&[6])), (5, false, true));
        assert!(c.memory_bytes() <= 100);
    }

    #[test]
    fn lru_eviction_within_budget() {
        let mut c = cache(25);
        c.insert(vec![1], ("1", 10), None);
        c.insert(vec![2], ("2", 10), None);
        assert!(c.lookup(&[1, 0], None).is_some()); // touch 1
        c.insert(vec![3], ("3", 10), None); // evicts 2
        assert!(c.lookup(&[2, 0], None).is_none());
        assert!(c.lookup(&[1, 0], None).is_some());
        assert!(c.lookup(&[3, 0], None).is_some());
        assert!(c.memory_bytes() <= 25);
        c.insert(vec![4], ("big", 26), None); // larger than the budget: not stored
        assert_eq!(c.len(), 2);
        c.insert(vec![3], ("3b", 10), None); // same tokens: replaced
        assert_eq!(find(&mut c, &[3, 0], None), s("3b", 1));
        // Eviction on demand takes the least recently used first.
        assert_eq!(c.evict_lru(), Some(10));
        assert!(c.lookup(&[1, 0], None).is_none() && c.lookup(&[3, 0], None).is_some());
        assert!(c.evict_lru().is_some() && c.evict_lru().is_none());
    }

    fn tiered(budget: usize, host_budget: usize) -> Cache {
        let tier = HostTier { budget: host_budget, spill: |t: &Item| Ok(*t), spill_bytes: |t| t.1, size: |h| h.1 };
        cache(budget).with_host_tier(tier)
    }

    #[test]
    fn entries_pushed_off_the_device_move_to_the_host_tier_and_hit_there() {
        let mut c = tiered(20, 25);
        c.insert(vec![1], ("a", 10), None);
        c.insert(vec![1, 2], ("b", 10), None);
        c.insert(vec![1, 2, 3], ("c", 10), None); // a moves to the host
        assert_eq!((c.memory_bytes(), c.host_memory_bytes(), c.host_len(), c.spills), (20, 10, 1, 1));
        assert_eq!(find(&mut c, &[1, 9], None), s("host:a", 1));
        assert_eq!(find(&mut c, &[1, 2, 3, 4], None), s("c", 3), "the longest match wins whatever its tier");
        assert_eq!((c.hits, c.host_hits), (2, 1));
        // a was used after b: b moves next, and the host tier (25) then holds both.
        c.insert(vec![5], ("d", 10), None);
        assert_eq!(find(&mut c, &[1, 2, 9], None), s("host:b", 2));
        assert_eq!(c.host_memory_bytes(), 20);
        // More than the host tier holds: host entries used before the one moving make room
        // (c moves, a goes), never one used after it.
        c.insert(vec![6], ("e", 10), None);
        assert_eq!(find(&mut c, &[1, 9], None), None);
        assert_eq!(find(&mut c, &[1, 2, 3, 9], None), s("host:c", 3));
        assert!(c.contains(&[1, 2]));
        // A copy that finds memory full pushes other device entries out, never the hit; d, used
        // before everything on the host, is dropped rather than moved.
        let mut full = 2;
        let r = c.copy_longest(&[6, 1], None, |item| { full -= 1; if full > 0 { anyhow::bail!("full") } Ok(name(item)) }, |e| e.to_string() == "full");
        assert_eq!(r.map(|r| r.unwrap()), Some(("e".to_string(), 1)));
        assert_eq!((find(&mut c, &[5, 1], None), c.len(), c.host_len()), (None, 3, 2));
    }

    #[test]
    fn an_entry_moved_beside_the_work_lands_in_the_host_tier_and_keeps_its_room() {
        // Device budget 30, host 25: a (10) and b (10) on the device, c (12) already on the host.
        let mut c = tiered(30, 25);
        c.insert(vec![3], ("c", 12), None);
        c.evict_lru();
        c.insert(vec![1], ("a", 10), None);
        c.insert(vec![2], ("b", 10), None);
        assert_eq!((c.memory_bytes(), c.host_memory_bytes()), (20, 12));
        // The oldest device entry leaves; the host tier keeps 10 bytes for it, so a second
        // move (b) needs c's room: c is older, so it goes.
        let a = c.take_lru_to_move().expect("a host tier with room");
        assert_eq!((a.item.0, c.memory_bytes(), c.len()), ("a", 10, 2));
        let b = c.take_lru_to_move().expect("room after dropping the older host entry");
        assert_eq!((b.item.0, c.host_memory_bytes(), c.len()), ("b", 0, 0));
        assert!(c.take_lru_to_move().is_none(), "no device entry left");
        let freed = c.settle_moved(a, || Ok(("a", 10)));
        assert_eq!(freed.0, "a");
        // A failed copy drops its entry.
        c.settle_moved(b, || anyhow::bail!("copy failed"));
        assert_eq!((c.len(), c.host_len(), c.host_memory_bytes(), c.spills), (1, 1, 10, 2));
        assert_eq!(find(&mut c, &[1, 5], None), s("host:a", 1));
        assert!(find(&mut c, &[2, 5], None).is_none());
    }

    #[test]
    fn nothing_moves_without_a_host_tier_or_room_in_it() {
        let mut c = cache(30);
        c.insert(vec![1], ("a", 10), None);
        assert!(c.take_lru_to_move().is_none());
        let mut c = tiered(30, 5);
        c.insert(vec![1], ("a", 10), None);
        assert!(c.take_lru_to_move().is_none());
        assert_eq!((c.len(), c.memory_bytes()), (1, 10), "the entry stays on the device");
    }

    #[test]
    fn a_host_tier_that_cannot_take_an_entry_drops_it() {
        let mut c = tiered(20, 15);
        c.insert(vec![1], ("a", 10), None);
        c.insert(vec![2], ("b", 10), None);
        c.insert(vec![3], ("c", 10), None);
        assert_eq!(find(&mut c, &[1, 0], None), s("host:a", 1));
        // b is older than a (a was just used): b is dropped rather than a.
        c.insert(vec![4], ("d", 10), None);
        assert_eq!((find(&mut c, &[2, 0], None), c.host_len()), (None, 1));
        // A failed copy loses only that entry.
        let mut c: Cache = cache(10).with_host_tier(HostTier { budget: 100, spill: |_| anyhow::bail!("no pinned memory"), spill_bytes: |t| t.1, size: |h| h.1 });
        c.insert(vec![1], ("a", 10), None);
        c.insert(vec![2], ("b", 10), None);
        assert_eq!((c.len(), c.host_len(), c.spills), (1, 0, 0));
        // An entry larger than the device budget goes straight to the host tier.
        let mut c = tiered(0, 100);
        assert!(c.enabled());
        c.insert(vec![1], ("a", 10), None);
        assert_eq!((find(&mut c, &[1, 0], None), c.memory_bytes(), c.spills), (s("host:a", 1), 0, 1));
        // An empty host budget is no tier.
        let mut c = tiered(10, 0);
        c.insert(vec![1], ("a", 10), None);
        c.insert(vec![2], ("b", 10), None);
        assert_eq!((c.len(), c.host_len()), (1, 0));
        assert!(!tiered(0, 0).enabled());
    }

    #[test]
    fn recent_prompts_know_a_prompt_seen_again_until_it_is_forgotten() {
        let mut r = RecentPrompts::new(2);
        assert!(!r.seen_again(&[1, 2, 3]));
        assert!(r.seen_again(&[1, 2, 3]));
        assert!(!r.seen_again(&[1, 2]));
        assert!(r.seen_again(&[1, 2]));
        // [1, 2, 3] was last seen two prompts ago: forgotten with a cap of 2.
        assert!(!r.seen_again(&[1, 2, 3]));
        assert!(r.seen_again(&[1, 2, 3]));
        // Each sighting counts: [1, 2]'s two are both older than the last two prompts now.
        assert!(!r.seen_again(&[9]));
        assert!(!r.seen_again(&[1, 2]));
        let mut off = RecentPrompts::new(0);
        assert!(!off.seen_again(&[1]) && !off.seen_again(&[1]));
    }
}
