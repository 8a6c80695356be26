//! The interface every compute backend implements (CPU reference today, CUDA next), and the
//! per-sequence state it advances.
//!
//! A backend owns the weights; a [`Sequence`] owns one conversation's caches (attention KV,
//! Gated DeltaNet conv + recurrent state). Sequences are values the caller keeps, clones and
//! drops, which is what a prefix cache needs: the recurrent state cannot be truncated, so a
//! cached prefix is a clone of the sequence taken at that length.

pub mod cpu;
pub mod cuda;

use crate::checkpoint::ModelConfig;
use anyhow::Result;
use std::any::Any;

/// Backend-specific caches of one sequence.
pub trait SequenceState: Any + Send + Sync {
    /// A deep copy of the state of a sequence of `len` tokens (prefix-cache snapshots, forks).
    /// Fails, rather than panics, when the copy cannot be allocated ([`MemoryFull`] when the
    /// sequence memory budget is the reason).
    fn try_clone_state(&self, len: usize) -> Result<Box<dyn SequenceState>>;
    /// Bytes of host or device memory held by this state. Memory shared with clones is divided
    /// among them (each of k holders counts 1/k), so the states' figures add up to what they
    /// hold together; a figure can grow when a sharer goes.
    fn memory_bytes(&self) -> usize;
    /// The most [`SequenceState::memory_bytes`] can report for this state while it does not
    /// grow: what it holds with nothing shared (the prefix cache's cheap check that an entry
    /// fits). States that share nothing: their memory_bytes.
    fn memory_bound(&self) -> usize {
        self.memory_bytes()
    }
    /// Makes sure the state can grow to `tokens` tokens later without running out of memory
    /// (a reservation against the backend's budget; [`MemoryFull`] when it does not fit).
    /// Backends whose sequences draw on no budget accept any reservation.
    fn reserve(&mut self, _tokens: usize) -> Result<()> {
        Ok(())
    }
    /// A copy of the state of a sequence of `len` tokens in host memory (the prefix cache's host
    /// tier), which [`Backend::restore_sequence`] of the same backend turns back into a sequence.
    /// Backends that keep sequences in host memory already store a plain copy.
    fn to_host(&self, len: usize) -> Result<Box<dyn Any + Send + Sync>> {
        Ok(Box::new(self.try_clone_state(len)?))
    }
    /// [`SequenceState::to_host`] started beside the backend's queued work: the copy runs while
    /// the backend computes, and [`PendingHostCopy::finish`] waits for it. The state must have no
    /// work of its own pending (a prefix-cache snapshot: every backend call that writes a sequence
    /// has finished by the time it returns), and it must stay alive until the copy is finished.
    /// Backends without queued work copy at once.
    fn start_to_host(&self, len: usize) -> Result<Box<dyn PendingHostCopy>> {
        Ok(Box::new(CopiedToHost(self.to_host(len)?)))
    }
    /// Host bytes [`SequenceState::to_host`] takes for a sequence of `len` tokens: all of its
    /// state, shared or not.
    fn host_bytes(&self, _len: usize) -> usize {
        self.memory_bytes()
    }
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A host copy under way ([`SequenceState::start_to_host`]).
pub trait PendingHostCopy: Send {
    /// Whether the copy is done (finish would not wait).
    fn is_done(&self) -> bool {
        true
    }
    /// Waits for the copy; then it is what [`SequenceState::to_host`] returns.
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send + Sync>>;
}

/// A host copy made at once.
struct CopiedToHost(Box<dyn Any + Send + Sync>);

impl PendingHostCopy for CopiedToHost {
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send + Sync>> {
        Ok(self.0)
    }
}

/// One sequence: its length so far, its capacity, and the backend's caches for it.
pub struct Sequence {
    len: usize,
    max_seq: usize,
    state: Box<dyn SequenceState>,
}

impl Sequence {
    pub fn new(max_seq: usize, state: Box<dyn SequenceState>) -> Self {
        Sequence { len: 0, max_seq, state }
    }
    /// Tokens already processed (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }
    pub fn memory_bytes(&self) -> usize {
        self.state.memory_bytes()
    }
    pub fn memory_bound(&self) -> usize {
        self.state.memory_bound()
    }
    /// Reserves room for the sequence to reach `tokens` tokens (at most max-seq), so growing to
    /// that length cannot fail for memory; [`MemoryFull`] when the budget cannot hold it now.
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.state.reserve(tokens.min(self.max_seq))
    }
    /// Called by backends after they appended `n` tokens.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }
    pub fn state<T: 'static>(&self) -> &T {
        self.state.as_any().downcast_ref::<T>().expect("sequence belongs to another backend")
    }
    pub fn state_mut<T: 'static>(&mut self) -> &mut T {
        self.state.as_any_mut().downcast_mut::<T>().expect("sequence belongs to another backend")
    }
    /// Checks that `n` more tokens fit.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.max_seq {
            anyhow::bail!("sequence of {} tokens + {} new exceeds max-seq {}", self.len, n, self.max_seq);
        }
        Ok(())
    }
}

impl Sequence {
    /// A snapshot that continues independently (an error when its state cannot be allocated).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Sequence { len: self.len, max_seq: self.max_seq, state: self.state.try_clone_state(self.len)? })
    }

    /// A copy in host memory ([`Backend::restore_sequence`] brings it back).
    pub fn to_host(&self) -> Result<HostSequence> {
        Ok(HostSequence { len: self.len, max_seq: self.max_seq, bytes: self.state.host_bytes(self.len), data: self.state.to_host(self.len)? })
    }

    /// [`Sequence::to_host`] started beside the backend's queued work
    /// ([`SequenceState::start_to_host`]: the sequence must have no work pending and must stay
    /// alive until [`HostSequenceCopy::finish`]).
    pub fn start_to_host(&self) -> Result<HostSequenceCopy> {
        Ok(HostSequenceCopy { len: self.len, max_seq: self.max_seq, bytes: self.state.host_bytes(self.len), pending: self.state.start_to_host(self.len)? })
    }

    /// Host bytes [`Sequence::to_host`] takes.
    pub fn host_bytes(&self) -> usize {
        self.state.host_bytes(self.len)
    }
}

/// A [`HostSequence`] being copied ([`Sequence::start_to_host`]).
pub struct HostSequenceCopy {
    len: usize,
    max_seq: usize,
    bytes: usize,
    pending: Box<dyn PendingHostCopy>,
}

impl HostSequenceCopy {
    /// Whether the copy is done ([`HostSequenceCopy::finish`] would not wait).
    pub fn is_done(&self) -> bool {
        self.pending.is_done()
    }
    /// Waits for the copy.
    pub fn finish(self) -> Result<HostSequence> {
        Ok(HostSequence { len: self.len, max_seq: self.max_seq, bytes: self.bytes, data: self.pending.finish()? })
    }
}

/// A sequence's caches copied to host memory by [`Sequence::to_host`]: what the prefix cache
/// keeps of a snapshot it moved out of the backend's memory.
pub struct HostSequence {
    pub len: usize,
    pub max_seq: usize,
    /// Host memory the copy holds.
    pub bytes: usize,
    /// The backend's own form of the copy.
    pub data: Box<dyn Any + Send + Sync>,
}

impl HostSequence {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The sequence memory budget is exhausted: the work asked for did not start and the sequence is
/// unchanged. It fits once other sequences or cached snapshots free memory (the caller waits or
/// evicts, then retries). Reaches callers inside `anyhow::Error` (`downcast_ref`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryFull {
    pub needed_bytes: usize,
    pub available_bytes: usize,
}

impl std::fmt::Display for MemoryFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(f, "sequence memory is full: {:.1} MiB needed, {:.1} MiB available", mib(self.needed_bytes), mib(self.available_bytes))
    }
}

impl std::error::Error for MemoryFull {}

/// Whether `e` is (or wraps) [`MemoryFull`].
pub fn is_memory_full(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<MemoryFull>().is_some())
}

/// The device memory sequences draw on ([`Backend::sequence_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SequenceMemoryReport {
    /// What sequences may hold in all: the configured fraction of the device less everything
    /// else on it (weights, scratch, other processes), measured now.
    pub budget_bytes: u64,
    /// Held by live sequences and snapshots (KV pages and state slots).
    pub in_use_bytes: u64,
    /// Reserved by sequences for growth and not yet drawn.
    pub reserved_bytes: u64,
    /// Freed pages and slots kept allocated for reuse.
    pub cached_bytes: u64,
    /// KV page size.
    pub page_bytes: u64,
}

/// Which logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (prefill of a prefix whose continuation is known).
    None,
    /// Only the last position's (the usual prefill/decode case).
    Last,
    /// Every position's, row-major `[tokens, vocab]` (teacher-forced evaluation).
    All,
}

/// `LILY_KV_BF16=1` / `=0`: new sequences keep their attention KV cache in bf16 / f32 (the CUDA
/// backend stores bf16; the CPU reference rounds K and V to bf16 when it appends them, so both
/// compute the same thing). Unset: the backend's `default` (CUDA bf16, CPU f32).
pub fn kv_bf16_from_env(default: bool) -> bool {
    match std::env::var("LILY_KV_BF16").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => default,
    }
}

/// A compute backend for the qwen3_5_moe model.
pub trait Backend: Send {
    /// Short name for logs ("cpu", "cuda").
    fn name(&self) -> &'static str;
    fn config(&self) -> &ModelConfig;
    /// A fresh, empty sequence that can hold `max_seq` tokens.
    fn new_sequence(&self, max_seq: usize) -> Result<Sequence>;
    /// A sequence continuing from a host copy this backend wrote ([`Sequence::to_host`]);
    /// [`MemoryFull`] when its memory does not fit now. Backends that keep sequences in host
    /// memory copy the stored state back.
    fn restore_sequence(&self, host: &HostSequence) -> Result<Sequence> {
        let Some(state) = host.data.downcast_ref::<Box<dyn SequenceState>>() else {
            anyhow::bail!("the host copy of a sequence came from another backend");
        };
        Ok(Sequence { len: host.len, max_seq: host.max_seq, state: state.try_clone_state(host.len)? })
    }
    /// Runs `tokens` through the model at the sequence's current position, appending them to
    /// its caches. Returns the requested logits (f32, `vocab_size` per row).
    fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>>;

    /// Feeds a piece of prompt to each of several sequences, with no logits: what `forward`
    /// with [`LogitsWanted::None`] does per piece. Returns one result per piece, in order; a
    /// piece that fails (a token outside the vocabulary, no room) leaves its sequence as it was
    /// and does not stop the others. A sequence may appear only once.
    ///
    /// The default feeds the pieces one after the other (the CPU reference); the CUDA backend runs
    /// them through one forward, so their projections and experts read the weights once.
    fn prefill_pieces(&mut self, pieces: &mut [PrefillPiece]) -> Vec<Result<()>> {
        pieces.iter_mut().map(|p| self.forward(p.seq, p.tokens, LogitsWanted::None).map(|_| ())).collect()
    }

    /// Device memory in use and the device's total, in bytes (`None` for the host backend).
    /// "In use" is the whole device's (cuMemGetInfo), i.e. ours on a dedicated GPU.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }

    /// The budget sequences draw on and its use (`None`: sequences live in host memory with no
    /// budget of their own).
    fn sequence_memory(&self) -> Option<SequenceMemoryReport> {
        None
    }

    /// The prefix cache's host tier by default: 0 where sequences live in host memory already.
    fn default_host_tier_bytes(&self) -> usize {
        0
    }

    /// Host copies of sequences ([`Sequence::to_host`]) will take up to `bytes`: a backend whose
    /// copies need memory prepared ahead (pinned pages) prepares it now.
    fn prepare_host_copies(&self, _bytes: usize) {}

    /// The most sequences one decode step should take: the backend's own row limit, and how many
    /// sequences its memory holds at their smallest (the server's default `--max-batch`).
    fn batch_capacity(&self) -> usize {
        DEFAULT_BATCH_CAPACITY
    }

    /// Readies the backend for a server's running batch of up to `max_batch` rows before the
    /// first request, so the first requests do not pay for it (library loading, scratch growth,
    /// captured steps). Returns what it did, for the log (`None`: nothing to do).
    fn warm_up(&mut self, _max_batch: usize) -> Result<Option<String>> {
        Ok(None)
    }

    /// Whether sequences created from now on keep their attention KV cache in bf16.
    fn kv_bf16(&self) -> bool {
        false
    }

    /// Chooses the KV cache element type of sequences created from now on (existing sequences
    /// keep theirs): `true` stores K and V rounded to bf16. Backends without a KV cache of their
    /// own (scripted test backends) ignore it.
    fn set_kv_bf16(&mut self, _bf16: bool) {}

    /// Greedy decoding without handing logits to the caller: feeds `first_token` at the
    /// sequence's current position, then produces up to `steps` tokens, each the argmax (ties ->
    /// lowest id) of the previous step's logits, handing each to `on_token.token` in order, which
    /// returns false to stop. Returns the number of tokens produced (handed to `on_token`).
    ///
    /// The sequence then holds `first_token` and every produced token except the last one
    /// (`steps` tokens when nothing stopped early; `check_room(steps)` must hold). When
    /// `on_token` stops early, a pipelining backend (CUDA: step N+1 is already queued when token
    /// N is read) may also have fed that last token, but only after [`TokenSink::queue_ahead`]
    /// said yes for that step; `seq.len()` tells.
    ///
    /// The default runs `forward` + host argmax per step (CPU backend); the CUDA backend keeps
    /// the token on the device and reads it back asynchronously.
    fn decode_greedy(
        &mut self,
        seq: &mut Sequence,
        first_token: u32,
        steps: usize,
        on_token: &mut dyn TokenSink,
    ) -> Result<usize> {
        seq.check_room(steps)?;
        let mut cur = first_token;
        for i in 0..steps {
            let logits = self.forward(seq, &[cur], LogitsWanted::Last)?;
            cur = crate::engine::sampling::argmax(&logits);
            if !on_token.token(cur) {
                return Ok(i + 1);
            }
        }
        Ok(steps)
    }

    /// Sampled decoding without handing logits to the caller, continuing `snap` (parameters,
    /// seed, penalty counts; `Sampler::snapshot`): feeds `first_token`, then produces up to
    /// `steps` tokens, each drawn from the previous step's logits, calling `on_token` as
    /// [`Backend::decode_greedy`] does, with the same sequence-length rules. The same snapshot
    /// gives the same tokens on one backend; backends draw with different random streams, each
    /// keyed by (seed, position), so a continuation split across calls or rows of a batch gives
    /// the tokens of one uninterrupted call.
    ///
    /// The default runs `forward` + `SamplerSnapshot::sample_at` per step (CPU backend); the CUDA backend
    /// samples on the device and keeps two steps in flight.
    fn decode_sampled(
        &mut self,
        seq: &mut Sequence,
        first_token: u32,
        steps: usize,
        snap: &crate::engine::sampling::SamplerSnapshot,
        on_token: &mut dyn TokenSink,
    ) -> Result<usize> {
        seq.check_room(steps)?;
        let mut snap = snap.clone();
        let mut cur = first_token;
        for i in 0..steps {
            let at = seq.len();
            let mut logits = self.forward(seq, &[cur], LogitsWanted::Last)?;
            cur = snap.sample_at(&mut logits, at);
            snap.observe(cur);
            if !on_token.token(cur) {
                return Ok(i + 1);
            }
        }
        Ok(steps)
    }

    /// Feeds `feed` (one token or more: the rest of a prompt, or the sequence's last token) and
    /// decodes after it: the first token is chosen from the last fed position's logits, then each
    /// next one from the previous token's, up to `steps` in all, greedy (`snap` None: the argmax,
    /// ties to the lowest id) or drawn as [`Backend::decode_sampled`] draws them; tokens go to
    /// `on_token` with the same stopping and sequence-length rules as
    /// [`Backend::decode_greedy`] (`steps` 0 feeds nothing). So a prompt's first token comes from
    /// its prefill's last row instead of a decode step of its own (the whole step's weights
    /// read for one token).
    ///
    /// The default is `forward` with the last row's logits and the host's choice, then
    /// `decode_greedy` / `decode_sampled` ([`decode_after_forward`]); the CUDA backend chooses
    /// the first token on the device from its prefill's last row and keeps the steps pipelined.
    fn decode_after(&mut self, seq: &mut Sequence, feed: &[u32], steps: usize, snap: Option<&crate::engine::sampling::SamplerSnapshot>, on_token: &mut dyn TokenSink) -> Result<usize> {
        decode_after_forward(self, seq, feed, steps, snap, on_token)
    }

    /// Decodes several sequences together: each step feeds one token of every unfinished row
    /// (its `first_token`, then its previous output) and produces the row's next token with its
    /// own sampling, restricted to the tokens `hooks.mask` allows where it constrains the row,
    /// calling `hooks.token(row index, token)` in row order; `token` returning false finishes
    /// that row, as does reaching its `max_tokens`. The other rows go on. Returns the tokens
    /// produced per row.
    ///
    /// Each row's sequence then holds its `first_token` and every produced token except the
    /// last. A row that `token` stopped may also hold that last token, where the backend had
    /// queued the next step before reading it (CUDA, only after [`StepHooks::queue_ahead`] said
    /// yes for that step), as with a pipelined [`Backend::decode_sampled`]; `seq.len()` tells.
    /// A row's tokens do not depend on which other rows share its steps (batch invariance); a
    /// backend may compute them differently from its single-sequence decode (CUDA: bf16
    /// tensor-core GEMMs here, f32-exact GEMVs there). Fails before any step when a row is
    /// invalid (room, token, or a backend limit on rows).
    ///
    /// The default runs the rows one after the other through `forward` and the host sampler
    /// (the CPU reference).
    fn decode_batch(&mut self, rows: &mut [BatchRow], hooks: &mut dyn StepHooks) -> Result<Vec<usize>> {
        let vocab = self.config().vocab_size;
        check_batch(vocab, rows)?;
        let mut samplers: Vec<_> = rows.iter().map(|r| r.sampler.clone()).collect();
        let mut cur: Vec<u32> = rows.iter().map(|r| r.first_token).collect();
        let mut produced = vec![0usize; rows.len()];
        let mut live: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].max_tokens > 0).collect();
        let mut allowed = vec![0u32; mask_words(vocab)];
        while !live.is_empty() {
            hooks.beside_steps();
            let mut next = Vec::with_capacity(live.len());
            for &i in &live {
                let at = rows[i].seq.len();
                let masked = hooks.mask(i, &mut allowed)?;
                let mut logits = self.forward(rows[i].seq, &[cur[i]], LogitsWanted::Last)?;
                if masked {
                    apply_mask(&mut logits, &allowed);
                }
                cur[i] = samplers[i].sample_at(&mut logits, at);
                samplers[i].observe(cur[i]);
                produced[i] += 1;
                if hooks.token(i, cur[i]) && produced[i] < rows[i].max_tokens {
                    next.push(i);
                }
            }
            live = next;
        }
        Ok(produced)
    }
}

/// [`Backend::decode_after`] through `forward`: the feed with its last row's logits, the first
/// token chosen on the host (the argmax, or `snap`'s draw keyed by the last fed position, as
/// `decode_sampled` keys its draws), then `decode_greedy` / `decode_sampled` from that token.
pub fn decode_after_forward<B: Backend + ?Sized>(
    b: &mut B,
    seq: &mut Sequence,
    feed: &[u32],
    steps: usize,
    snap: Option<&crate::engine::sampling::SamplerSnapshot>,
    on_token: &mut dyn TokenSink,
) -> Result<usize> {
    let Some((&last, rest)) = feed.split_last() else {
        anyhow::bail!("decode_after called with no tokens");
    };
    if steps == 0 {
        return Ok(0);
    }
    let decode = |b: &mut B, seq: &mut Sequence, first: u32, steps: usize, snap: Option<&crate::engine::sampling::SamplerSnapshot>, on_token: &mut dyn TokenSink| match snap {
        None => b.decode_greedy(seq, first, steps, on_token),
        Some(s) => b.decode_sampled(seq, first, steps, s, on_token),
    };
    if rest.is_empty() {
        return decode(b, seq, last, steps, snap, on_token);
    }
    seq.check_room(rest.len() + steps)?;
    let at = seq.len() + rest.len();
    let mut logits = b.forward(seq, feed, LogitsWanted::Last)?;
    let (first, snap) = match snap {
        None => (crate::engine::sampling::argmax(&logits), None),
        Some(s) => {
            let mut s = s.clone();
            let t = s.sample_at(&mut logits, at);
            s.observe(t);
            (t, Some(s))
        }
    };
    if !on_token.token(first) || steps == 1 {
        return Ok(1);
    }
    Ok(1 + decode(b, seq, first, steps - 1, snap.as_ref(), on_token)?)
}

/// What a batched decode ([`Backend::decode_batch`]) asks its caller between steps. A closure
/// `FnMut(row, token) -> bool` is the hooks of rows that are never constrained.
pub trait StepHooks {
    /// Row `row` produced `token`; false finishes the row.
    fn token(&mut self, row: usize, token: u32) -> bool;

    /// Fills `allowed` ([`mask_words`] words) with the tokens row `row` may draw next, bit
    /// `t % 32` of word `t / 32`, and returns true; or returns false when the row is not
    /// constrained at this step (`allowed` is then not read). Asked before every step of every
    /// row still decoding. The token is drawn with the row's sampling from the allowed tokens
    /// only, as if every other logit were -inf.
    fn mask(&mut self, _row: usize, _allowed: &mut [u32]) -> Result<bool> {
        Ok(false)
    }

    /// Asked by a backend that can queue steps ahead, once per step after it is queued and
    /// before its tokens go to `token`: whether it may queue the next step now, before those
    /// tokens are read (two steps in flight; it queues ahead only right after a yes). Yes
    /// promises that `mask` constrains no row at the next step (it is asked before this step's
    /// tokens are handed over), and accepts that a row `token` stops at this step then holds
    /// this step's token too (the queued step fed it; its output for the row is dropped). After
    /// a no, or where it was not asked, a row `token` stops holds every token but its last. No
    /// by default: hooks whose masks follow the tokens, or that may stop a row at this step to
    /// resume it later, must say no.
    fn queue_ahead(&mut self) -> bool {
        false
    }

    /// Called once per step while the device has that step queued, before its tokens are read:
    /// host work done here (the server's prefix-cache moves) runs while the device computes
    /// instead of between calls. It must not touch the rows of the call. Nothing by default.
    fn beside_steps(&mut self) {}
}

/// What a single-sequence decode ([`Backend::decode_greedy`], [`Backend::decode_sampled`])
/// hands its tokens to.
pub trait TokenSink {
    /// The next token; false stops the decode.
    fn token(&mut self, token: u32) -> bool;

    /// Asked by a backend that can queue steps ahead, once per step after it is queued and
    /// before its token goes to `token`: whether it may queue the next step now, before that
    /// token is read. Yes accepts that a decode `token` stops at this step holds this step's
    /// token too (the queued step fed it); after a no, a stop leaves the sequence holding every
    /// token but its last, so the caller can resume it later with that token. Yes by default.
    fn queue_ahead(&mut self) -> bool {
        true
    }
}

/// A closure takes every token and lets the backend queue ahead.
impl<F: FnMut(u32) -> bool> TokenSink for F {
    fn token(&mut self, token: u32) -> bool {
        self(token)
    }
}

/// Closures never constrain their rows: the backend may queue steps ahead.
impl<F: FnMut(usize, u32) -> bool> StepHooks for F {
    fn token(&mut self, row: usize, token: u32) -> bool {
        self(row, token)
    }

    fn queue_ahead(&mut self) -> bool {
        true
    }
}

/// Words of a token bitmask over a vocabulary of `vocab` entries.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Sets the logits of the tokens `allowed` leaves out to -inf.
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (t, l) in logits.iter_mut().enumerate() {
        if allowed.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// [`Backend::batch_capacity`] of a backend whose sequences draw on no budget and whose steps
/// take any number of rows (the CPU reference runs them one after the other).
pub const DEFAULT_BATCH_CAPACITY: usize = 64;

/// Checks the rows of a batched decode: tokens in the vocabulary, room for every row's tokens,
/// valid sampling parameters.
pub fn check_batch(vocab: usize, rows: &[BatchRow]) -> Result<()> {
    for (i, r) in rows.iter().enumerate() {
        if r.first_token as usize >= vocab {
            anyhow::bail!("batch row {i}: token id {} is outside the vocabulary ({vocab} entries)", r.first_token);
        }
        r.seq.check_room(r.max_tokens).map_err(|e| anyhow::anyhow!("batch row {i}: {e}"))?;
        r.sampler.params.validate().map_err(|e| anyhow::anyhow!("batch row {i}: {e}"))?;
    }
    Ok(())
}

/// One sequence of a batched decode ([`Backend::decode_batch`]).
pub struct BatchRow<'a> {
    pub seq: &'a mut Sequence,
    /// Fed at the sequence's position by the first step.
    pub first_token: u32,
    /// The most tokens this row produces.
    pub max_tokens: usize,
    /// Its sampling: parameters, seed, counts so far (`Sampler::snapshot`).
    pub sampler: crate::engine::sampling::SamplerSnapshot,
}

/// A piece of prompt for one sequence of [`Backend::prefill_pieces`], fed at its position.
pub struct PrefillPiece<'a> {
    pub seq: &'a mut Sequence,
    pub tokens: &'a [u32],
}

/// The attention KV cache element type the user asked for (`--kv-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCache {
    F32,
    Bf16,
}

impl KvCache {
    /// Applies the choice to sequences the backend creates from now on.
    pub fn apply(self, backend: &mut dyn Backend) {
        backend.set_kv_bf16(self == KvCache::Bf16);
    }
}

/// Which backend the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// CUDA when a supported GPU is present, else the CPU (with a notice).
    Auto,
    Cuda,
    Cpu,
}

/// Opens the requested backend on a validated checkpoint (CUDA with the options of the
/// environment).
pub fn open_backend(kind: BackendKind, ck: &crate::checkpoint::Checkpoint) -> Result<Box<dyn Backend>> {
    open_backend_with(kind, ck, cuda::CudaOptions::from_env())
}

/// [`open_backend`] with the CUDA backend's options given (the CPU backend ignores them).
pub fn open_backend_with(kind: BackendKind, ck: &crate::checkpoint::Checkpoint, opts: cuda::CudaOptions) -> Result<Box<dyn Backend>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new(ck)?)),
        BackendKind::Auto => match cuda::unavailable_reason(opts.device) {
            None => Ok(Box::new(cuda::CudaBackend::with_options(ck, opts)?)),
            Some(why) => {
                eprintln!("lily: CUDA backend unavailable ({why}); using the CPU backend");
                Ok(Box::new(cpu::CpuBackend::new(ck)?))
            }
        },
        BackendKind::Cuda => match cuda::unavailable_reason(opts.device) {
            None => Ok(Box::new(cuda::CudaBackend::with_options(ck, opts)?)),
            Some(why) => anyhow::bail!("--backend cuda: {why}"),
        },
    }
}
