//! Per-sequence device state: the step buffer (token id, position), the Gated DeltaNet conv rings
//! and recurrent states (f32, or f16 with `CudaOptions::gdn_state_f16`; one slot of the state
//! pool), and the attention KV caches
//! (`[position][kv_heads * head_dim]`, f32 or bf16 per sequence, in pages mapped as the sequence
//! grows; seqmem.rs). A sequence can be copied to pinned host memory and restored from it
//! (hostmem.rs; the prefix cache's host tier).

use super::device::{ptr, Gpu};
use super::hostmem::{HostCopy, PinnedPool};
use super::seqmem::{KvSpace, MappedRegions, SequenceMemory, StateSlot};
use crate::backend::{PendingHostCopy, SequenceState};
use crate::checkpoint::{LayerKind, ModelConfig};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use std::any::Any;
use std::sync::Arc;

/// Where one layer's state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSlot {
    /// Offsets (f32 elements) of the conv ring `[K][conv_dim]` (slot = position mod K) and the
    /// recurrent state `[nv][dk][dv]` in the sequence's state slot.
    Gdn { ring: usize, state: usize },
    /// The K cache is KV region `2 * a`, the V cache region `2 * a + 1`.
    Attn { a: usize },
}

/// KV regions of a sequence with these layers: a K and a V region per attention layer.
pub fn kv_regions(layers: &[LayerSlot]) -> usize {
    2 * layers.iter().filter(|l| matches!(l, LayerSlot::Attn { .. })).count()
}

/// Each layer's place in a sequence's state slot and KV space, and the slot's size in f32s
/// (an f16 recurrent state takes half the words). Offsets are multiples of 64 f32 words
/// (256-byte aligned, as the kernels' vector loads need).
pub fn layout(cfg: &ModelConfig, gdn_state_f16: bool) -> (Vec<LayerSlot>, usize) {
    let ring = (cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim()).next_multiple_of(64);
    let entries = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
    let state = (if gdn_state_f16 { entries.div_ceil(2) } else { entries }).next_multiple_of(64);
    let (mut floats, mut attn) = (0, 0);
    let slots = cfg
        .layer_types
        .iter()
        .map(|k| match k {
            LayerKind::LinearAttention => {
                let s = LayerSlot::Gdn { ring: floats, state: floats + ring };
                floats += ring + state;
                s
            }
            LayerKind::FullAttention => {
                attn += 1;
                LayerSlot::Attn { a: attn - 1 }
            }
        })
        .collect();
    (slots, floats.max(64))
}

pub struct CudaSequence {
    pub stream: Arc<CudaStream>,
    /// `[token, position]` of the step being computed (i32).
    pub step: CudaSlice<i32>,
    layers: Vec<LayerSlot>,
    slot: StateSlot,
    kv: KvSpace,
    pub max_seq: usize,
    /// KV cache elements are bf16 (the `_bf16` attention kernels) instead of f32.
    pub kv_bf16: bool,
    /// The GDN recurrent states are f16 (the `_f16` GDN kernels) instead of f32.
    pub gdn_state_f16: bool,
}

/// Bytes per KV cache element.
pub fn kv_elem_bytes(kv_bf16: bool) -> usize {
    if kv_bf16 {
        2
    } else {
        4
    }
}

impl CudaSequence {
    /// A fresh sequence: a zeroed state slot and the KV address space of `max_seq` tokens, with
    /// no KV memory yet ([`crate::backend::MemoryFull`] when the slot does not fit the budget).
    pub fn new(gpu: &Gpu, mem: &Arc<SequenceMemory>, cfg: &ModelConfig, max_seq: usize, kv_bf16: bool, gdn_state_f16: bool) -> Result<Self> {
        if max_seq == 0 {
            bail!("max-seq must be positive");
        }
        if max_seq > i32::MAX as usize / cfg.kv_dim().max(1) {
            bail!("max-seq {max_seq} is too large for the CUDA backend's 32-bit positions");
        }
        let (layers, slot_words) = layout(cfg, gdn_state_f16);
        let regions = kv_regions(&layers);
        let slot = StateSlot::take(mem)?;
        if slot.bytes() != 4 * slot_words {
            bail!("the sequence memory's state slots ({} bytes) do not hold this layout ({} bytes)", slot.bytes(), 4 * slot_words);
        }
        Ok(CudaSequence {
            stream: gpu.stream.clone(),
            step: gpu.zeros(2)?,
            kv: KvSpace::new(mem, regions, max_seq, cfg.kv_dim() * kv_elem_bytes(kv_bf16))?,
            slot,
            layers,
            max_seq,
            kv_bf16,
            gdn_state_f16,
        })
    }

    /// The two state addresses of layer `li`: (conv ring, recurrent state) or (K cache, V cache).
    pub fn layer_ptrs(&self, li: usize) -> (u64, u64) {
        match self.layers[li] {
            LayerSlot::Gdn { ring, state } => {
                let base = ptr(self.slot.buf(), &self.stream);
                (base + 4 * ring as u64, base + 4 * state as u64)
            }
            LayerSlot::Attn { a } => (self.kv.region(2 * a), self.kv.region(2 * a + 1)),
        }
    }

    pub fn layer_slot(&self, li: usize) -> LayerSlot {
        self.layers[li]
    }

    /// Refuses this sequence where the backend keeps GDN states in the other element type
    /// (`f16`): a batched step or a prefill launches the backend's instances of the GDN kernels.
    pub fn check_gdn_state(&self, f16: bool) -> Result<()> {
        let name = |f16: bool| if f16 { "f16" } else { "f32" };
        if self.gdn_state_f16 != f16 {
            bail!("a sequence with {} GDN states given to a backend that keeps them in {}", name(self.gdn_state_f16), name(f16));
        }
        Ok(())
    }

    /// What a captured decode step bakes in of this sequence: its step buffer's and every layer's
    /// state addresses, the KV and GDN state element types and max-seq (the split count). Decode
    /// graphs are keyed by it, so a sequence that takes over a finished one's slot, KV address
    /// space and step buffer (as a server's next request does) replays its graph instead of
    /// capturing one.
    pub fn binding(&self) -> Vec<u64> {
        let mut b = vec![ptr(&self.step, &self.stream), self.kv_bf16 as u64, self.gdn_state_f16 as u64, self.max_seq as u64];
        for li in 0..self.layers.len() {
            let (p, q) = self.layer_ptrs(li);
            b.extend([p, q]);
        }
        b
    }

    /// Maps KV pages so positions `0..tokens` can be written; all or none
    /// ([`crate::backend::MemoryFull`]; the sequence is unchanged then).
    pub fn grow(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.max_seq {
            bail!("{tokens} tokens exceed the sequence's max-seq {}", self.max_seq);
        }
        self.kv.grow(tokens)
    }

    fn try_clone(&self, len: usize) -> Result<Self> {
        let step = self.stream.clone_dtod(&self.step).map_err(|e| anyhow!("device copy failed: {e:?}"))?;
        let c = CudaSequence {
            stream: self.stream.clone(),
            step,
            layers: self.layers.clone(),
            slot: self.slot.try_clone()?,
            kv: self.kv.try_clone(len)?,
            max_seq: self.max_seq,
            kv_bf16: self.kv_bf16,
            gdn_state_f16: self.gdn_state_f16,
        };
        // No synchronisation: the slot copy is queued on the stream every later use of either
        // sequence (and of a slot or page either gives back) is ordered on, and the copies to
        // the host tier wait for an event recorded after it.
        Ok(c)
    }
}

/// A CudaHostState whose copies are queued; its event follows them.
pub struct PendingCudaHost {
    state: Option<CudaHostState>,
    done: CudaEvent,
    /// A held sequence's pages mapped for the copy: unmapped after `done` (field order: dropped
    /// after Drop::drop waited).
    _mapped: Option<MappedRegions>,
}

impl PendingCudaHost {
    fn wait(mut self) -> Result<CudaHostState> {
        self.done.synchronize().map_err(|e| anyhow!("device-to-host copy: {e:?}"))?;
        Ok(self.state.take().expect("a pending copy is waited for once"))
    }
}

impl PendingHostCopy for PendingCudaHost {
    fn is_done(&self) -> bool {
        self.done.is_complete()
    }
    fn finish(self: Box<Self>) -> Result<Box<dyn Any + Send + Sync>> {
        Ok(Box::new((*self).wait()?))
    }
}

impl Drop for PendingCudaHost {
    /// The pinned chunks go back to their pool when the copy drops: not before the device is
    /// done writing them.
    fn drop(&mut self) {
        let _ = self.done.synchronize();
    }
}

/// A sequence's state slot and KV rows in pinned host memory (the prefix cache's host tier),
/// back to back: the slot, then each region's rows.
pub struct CudaHostState {
    copy: HostCopy,
    kv_bf16: bool,
    gdn_state_f16: bool,
    slot_bytes: usize,
    region_bytes: usize,
}

impl CudaSequence {
    /// Host bytes of a copy of a sequence of `len` tokens (whole pinned chunks).
    fn host_copy_bytes(&self, len: usize) -> usize {
        PinnedPool::rounded(self.slot.bytes() + self.kv.regions() * len * self.kv.row_bytes())
    }

    /// Queues the copy of a sequence of `len` tokens into pinned host memory on the sequence
    /// memory's copy stream, after the work the compute stream has queued so far and beside
    /// whatever it queues next, and an event after it.
    fn start_copy_to_host(&self, len: usize) -> Result<PendingCudaHost> {
        let (slot_bytes, region_bytes) = (self.slot.bytes(), len * self.kv.row_bytes());
        let mem = self.slot.memory();
        let st = mem.copy_stream();
        let mut copy = HostCopy::with_capacity(mem.pinned(), slot_bytes + self.kv.regions() * region_bytes)?;
        // After whatever the compute stream has queued so far (a snapshot's own copies among it),
        // so the sequence's state is complete whichever work the caller left pending.
        let queued_so_far = self.stream.record_event(None).map_err(|e| anyhow!("host copy event: {e:?}"))?;
        st.wait(&queued_so_far).map_err(|e| anyhow!("host copy event: {e:?}"))?;
        let (queued, mapped) = self.kv.read_regions_beside(|at| {
            copy.append_from_device(ptr(self.slot.buf(), &self.stream), slot_bytes, st)?;
            for r in 0..self.kv.regions() {
                copy.append_from_device(at(r), region_bytes, st)?;
            }
            Ok(())
        });
        let done = queued.and_then(|()| st.record_event(None).map_err(|e| anyhow!("host copy event: {e:?}")));
        match done {
            Ok(done) => Ok(PendingCudaHost { state: Some(CudaHostState { copy, kv_bf16: self.kv_bf16, gdn_state_f16: self.gdn_state_f16, slot_bytes, region_bytes }), done, _mapped: mapped }),
            Err(e) => {
                // Copies already queued read the mapping and write the pinned chunks.
                let _ = st.synchronize();
                Err(e)
            }
        }
    }

    fn copy_to_host(&self, len: usize) -> Result<CudaHostState> {
        self.start_copy_to_host(len)?.wait()
    }

    /// A sequence holding what `host` holds (`len` tokens), its KV pages mapped
    /// ([`crate::backend::MemoryFull`] when they do not fit now).
    pub fn from_host(gpu: &Gpu, mem: &Arc<SequenceMemory>, cfg: &ModelConfig, max_seq: usize, len: usize, host: &CudaHostState) -> Result<Self> {
        let mut seq = CudaSequence::new(gpu, mem, cfg, max_seq, host.kv_bf16, host.gdn_state_f16)?;
        if host.slot_bytes != seq.slot.bytes() || host.region_bytes != len * seq.kv.row_bytes() {
            bail!("the host copy of a sequence does not match this model's layout");
        }
        seq.grow(len)?;
        host.copy.read_to_device(0, ptr(seq.slot.buf(), &seq.stream), host.slot_bytes, &seq.stream)?;
        for r in 0..seq.kv.regions() {
            host.copy.read_to_device(host.slot_bytes + r * host.region_bytes, seq.kv.region(r), host.region_bytes, &seq.stream)?;
        }
        // The copy's chunks may be reused once this returns.
        seq.stream.synchronize().map_err(|e| anyhow!("{e:?}"))?;
        Ok(seq)
    }
}

impl SequenceState for CudaSequence {
    fn try_clone_state(&self, len: usize) -> Result<Box<dyn SequenceState>> {
        Ok(Box::new(self.try_clone(len)?))
    }
    fn memory_bytes(&self) -> usize {
        self.slot.bytes() + self.kv.held_bytes() + 8
    }
    fn memory_bound(&self) -> usize {
        self.slot.bytes() + self.kv.bound_bytes() + 8
    }
    fn to_host(&self, len: usize) -> Result<Box<dyn Any + Send + Sync>> {
        Ok(Box::new(self.copy_to_host(len)?))
    }
    fn start_to_host(&self, len: usize) -> Result<Box<dyn PendingHostCopy>> {
        Ok(Box::new(self.start_copy_to_host(len)?))
    }
    fn host_bytes(&self, len: usize) -> usize {
        self.host_copy_bytes(len)
    }
    fn reserve(&mut self, tokens: usize) -> Result<()> {
        self.kv.reserve(tokens.min(self.max_seq))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of device memory one sequence of `tokens` tokens holds (KV rounded up to whole
    /// pages of `page_bytes` per layer's K and V).
    fn sequence_bytes(cfg: &ModelConfig, tokens: usize, kv_bf16: bool, page_bytes: usize) -> usize {
        let attn_layers = cfg.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count();
        let kv = (tokens * cfg.kv_dim() * kv_elem_bytes(kv_bf16)).div_ceil(page_bytes) * page_bytes;
        layout(cfg, false).1 * 4 + 2 * attn_layers * kv
    }

    #[test]
    fn bf16_kv_halves_only_the_attention_cache() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let page = 2 << 20;
        let (f32_bytes, bf16_bytes) = (sequence_bytes(&cfg, 262_144, false, page), sequence_bytes(&cfg, 262_144, true, page));
        let attn_layers = cfg.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count();
        let kv_f32 = attn_layers * 2 * 262_144 * cfg.kv_dim() * 4;
        assert_eq!(f32_bytes - bf16_bytes, kv_f32 / 2);
        // 35B at 262,144 tokens: 10 attention layers x K and V x 512 x 4 bytes = 10.7 GB of f32 KV.
        assert_eq!(kv_f32, 10_737_418_240);
    }

    #[test]
    fn layout_puts_each_gdn_layer_in_the_slot_and_numbers_the_attention_layers() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let (slots, floats) = layout(&cfg, false);
        let (ring, state) = (cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim(), 32 * 128 * 128);
        let mut next = 0;
        let mut attn = 0;
        for s in &slots {
            match *s {
                LayerSlot::Gdn { ring: r, state: st } => {
                    assert_eq!((r, st), (next, next + ring), "back to back, no overlap");
                    assert!(r % 64 == 0 && st % 64 == 0);
                    next = st + state;
                }
                LayerSlot::Attn { a } => {
                    assert_eq!(a, attn);
                    attn += 1;
                }
            }
        }
        assert_eq!((attn, floats), (10, next));
        // 30 GDN layers x (128 KiB ring + 2 MiB state).
        assert_eq!(floats * 4, 30 * (128 << 10) + 30 * (2 << 20));
        // The f16 states: the same order, 1 MiB each, still 256-byte aligned.
        let (slots16, floats16) = layout(&cfg, true);
        assert_eq!(floats16 * 4, 30 * (128 << 10) + 30 * (1 << 20));
        for (a, b) in slots.iter().zip(&slots16) {
            match (*a, *b) {
                (LayerSlot::Gdn { .. }, LayerSlot::Gdn { ring, state }) => assert!(ring % 64 == 0 && state == ring + cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim()),
                (LayerSlot::Attn { a: x }, LayerSlot::Attn { a: y }) => assert_eq!(x, y),
                _ => panic!("the layer kinds differ"),
            }
        }
    }

    #[test]
    fn kv_memory_grows_a_page_per_cache_at_a_time() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let page = 2 << 20;
        // bf16 rows of 1 KiB: 2,048 tokens per page, 20 caches (K and V of 10 layers).
        let at = |t| sequence_bytes(&cfg, t, true, page);
        assert_eq!(at(1), at(2048));
        assert_eq!(at(2049) - at(2048), 20 * page);
        assert_eq!(at(262_144) - at(0), 20 * 128 * page);
    }
}
