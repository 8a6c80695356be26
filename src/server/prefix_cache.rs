//! Prefix cache: snapshots of sequences (KV + Gated DeltaNet state) keyed by the exact tokens
//! they hold. The recurrent state cannot be truncated, so an entry can only serve prompts that
//! strictly extend its tokens: a new prompt resumes from the longest cached entry whose tokens
//! are a proper prefix of it (at least one token is always left to prefill, which yields the
//! logits). `prompt_cache_key` is a preference among valid candidates, never a substitute for
//! token equality. Entries are bounded by a byte budget and evicted least-recently-used; an
//! entry's size is read from the item whenever it counts (on the GPU a snapshot shares KV pages
//! with other sequences, so what it holds changes as they come and go).

#[derive(Debug)]
struct Entry<T> {
    tokens: Vec<u32>,
    item: T,
    key: Option<String>,
    last_used: u64,
}

#[derive(Debug)]
pub struct PrefixCache<T> {
    entries: Vec<Entry<T>>,
    budget: usize,
    /// What an item holds now, in bytes.
    size: fn(&T) -> usize,
    clock: u64,
    pub lookups: u64,
    pub hits: u64,
}

impl<T> PrefixCache<T> {
    pub fn new(budget_bytes: usize, size: fn(&T) -> usize) -> Self {
        PrefixCache { entries: Vec::new(), budget: budget_bytes, size, clock: 0, lookups: 0, hits: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn memory_bytes(&self) -> usize {
        self.entries.iter().map(|e| (self.size)(&e.item)).sum()
    }

    /// Best entry for `prompt`: its item (the caller copies it to resume from it) and the
    /// number of tokens it covers.
    pub fn lookup(&mut self, prompt: &[u32], key: Option<&str>) -> Option<(&T, usize)> {
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
        Some((&e.item, e.tokens.len()))
    }

    /// Stores `item` holding exactly `tokens`. Replaces an entry with the same tokens; evicts
    /// least-recently-used entries to stay within the budget; an item larger than the whole
    /// budget is not stored.
    pub fn insert(&mut self, tokens: Vec<u32>, item: T, key: Option<String>) {
        let bytes = (self.size)(&item);
        if tokens.is_empty() || bytes > self.budget {
            return;
        }
        self.entries.retain(|e| e.tokens != tokens);
        let mut used = self.memory_bytes();
        while used + bytes > self.budget {
            match self.evict_lru() {
                Some(freed) => used = used.saturating_sub(freed),
                None => break,
            }
        }
        self.clock += 1;
        self.entries.push(Entry { tokens, item, key, last_used: self.clock });
    }

    /// A copy (`copy`) of the item of the longest cached prefix of `prompt`, and that prefix's
    /// length, as [`PrefixCache::lookup`] finds it. While the copy fails for want of memory
    /// (`is_full`), other entries are evicted, least recently used first; `None` when nothing
    /// matches, the error when the copy fails otherwise or nothing else is left to evict.
    pub fn copy_longest<R>(&mut self, prompt: &[u32], key: Option<&str>, mut copy: impl FnMut(&T) -> anyhow::Result<R>, is_full: impl Fn(&anyhow::Error) -> bool) -> Option<anyhow::Result<(R, usize)>> {
        let n = self.lookup(prompt, key)?.1;
        // The hit is now the most recently used entry, so LRU eviction takes it last.
        let stamp = self.clock;
        loop {
            let hit = self.entries.iter().find(|e| e.last_used == stamp).expect("the hit is kept while others remain");
            match copy(&hit.item) {
                Ok(r) => return Some(Ok((r, n))),
                Err(e) if is_full(&e) && self.entries.len() > 1 => {
                    self.evict_lru();
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Drops the least-recently-used entry (to free its memory for a request) and returns what
    /// it held; `None` when empty.
    pub fn evict_lru(&mut self) -> Option<usize> {
        let i = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i)?;
        let e = self.entries.swap_remove(i);
        Some((self.size)(&e.item))
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Whether an entry holds exactly `tokens`.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// The byte budget (0: nothing is cached).
    pub fn budget(&self) -> usize {
        self.budget
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Test items: a name and the bytes it holds.
    type Item = (&'static str, usize);

    fn cache(budget: usize) -> PrefixCache<Item> {
        PrefixCache::new(budget, |t| t.1)
    }

    /// `lookup` with the item's name copied out.
    fn find(c: &mut PrefixCache<Item>, prompt: &[u32], key: Option<&str>) -> Option<(&'static str, usize)> {
        c.lookup(prompt, key).map(|(t, n)| (t.0, n))
    }

    #[test]
    fn longest_strict_prefix_and_key_preference() {
        let mut c = cache(100);
        c.insert(vec![1, 2], ("a", 10), None);
        c.insert(vec![1, 2, 3, 4], ("b", 10), None);
        c.insert(vec![1, 2, 3], ("k", 10), Some("conv".into()));
        assert_eq!(find(&mut c, &[1, 2, 3, 4, 5], None), Some(("b", 4)));
        // The key never outranks a longer match (a keyed short entry would re-prefill more).
        assert_eq!(find(&mut c, &[1, 2, 3, 4, 5], Some("conv")), Some(("b", 4)));
        // Exact length is not a hit (one token must remain); the shorter prefix is.
        assert_eq!(find(&mut c, &[1, 2, 3, 4], None), Some(("k", 3)));
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
        assert_eq!(find(&mut c, &prompt, Some("user-7")), Some(("long", 446)));
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
        let r = c.copy_longest(&[3, 4, 5], None, |item| { tries += 1; if tries < 3 { anyhow::bail!("full") } Ok(item.0) }, full);
        assert_eq!(r.map(|r| r.unwrap()), Some(("hit", 2)));
        assert_eq!((c.len(), find(&mut c, &[3, 4, 0], None)), (1, Some(("hit", 2))));
        // With nothing else to evict the error stands; an error of another kind evicts nothing.
        c.insert(vec![7], ("other", 10), None);
        let r = c.copy_longest(&[3, 4, 5], None, |_| -> anyhow::Result<()> { anyhow::bail!("broken") }, full);
        assert_eq!(r.map(|r| r.unwrap_err().to_string()), Some("broken".into()));
        assert_eq!(c.len(), 2);
        let r = c.copy_longest(&[3, 4, 5], None, |_| -> anyhow::Result<()> { anyhow::bail!("full") }, full);
        assert_eq!(r.map(|r| r.unwrap_err().to_string()), Some("full".into()));
        assert_eq!((c.len(), c.contains(&[3, 4])), (1, true));
        assert!(c.copy_longest(&[9, 9], None, |item| Ok(item.0), full).is_none());
    }

    #[test]
    fn sizes_are_read_from_the_items_when_they_count() {
        use std::cell::Cell;
        use std::rc::Rc;
        let mut c = PrefixCache::new(100, |s: &Rc<Cell<usize>>| s.get());
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
        assert_eq!(find(&mut c, &[3, 0], None), Some(("3b", 1)));
        // Eviction on demand takes the least recently used first.
        assert_eq!(c.evict_lru(), Some(10));
        assert!(c.lookup(&[1, 0], None).is_none() && c.lookup(&[3, 0], None).is_some());
        assert!(c.evict_lru().is_some() && c.evict_lru().is_none());
    }
}
