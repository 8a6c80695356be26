//! Per-sequence device state: the step buffer (token id, position), Gated DeltaNet conv rings and
//! fp32 recurrent states, and the attention KV caches (`[max_seq][kv_heads * head_dim]`, f32 or
//! bf16 per sequence, allocated for the full max-seq up front so nothing allocates mid-request).

use super::device::Gpu;
use crate::backend::SequenceState;
use crate::checkpoint::{LayerKind, ModelConfig};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaSlice, CudaStream};
use std::any::Any;
use std::sync::Arc;

pub enum DevLayerState {
    /// conv ring `[K][conv_dim]` (slot = position mod K) and state `[nv][dk][dv]`.
    Gdn {
        ring: CudaSlice<f32>,
        state: CudaSlice<f32>,
    },
    /// K and V caches as raw bytes: f32 or bf16 elements (`CudaSequence::kv_bf16`); the kernels
    /// take raw pointers and are instantiated for both element types.
    Attn {
        k: CudaSlice<u8>,
        v: CudaSlice<u8>,
    },
}

pub struct CudaSequence {
    pub stream: Arc<CudaStream>,
    /// `[token, position]` of the step being computed (i32).
    pub step: CudaSlice<i32>,
    pub layers: Vec<DevLayerState>,
    pub max_seq: usize,
    /// KV cache elements are bf16 (the `_bf16` attention kernels) instead of f32.
    pub kv_bf16: bool,
    /// Unique per sequence (and per clone): decode graphs are keyed by it, since they bake in
    /// this sequence's device addresses.
    pub id: u64,
}

fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Bytes per KV cache element.
pub fn kv_elem_bytes(kv_bf16: bool) -> usize {
    if kv_bf16 {
        2
    } else {
        4
    }
}

/// Bytes of device memory one sequence of `max_seq` tokens needs.
pub fn sequence_bytes(cfg: &ModelConfig, max_seq: usize, kv_bf16: bool) -> usize {
    let gdn = (cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim()
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        * 4;
    let attn = 2 * max_seq * cfg.kv_dim() * kv_elem_bytes(kv_bf16);
    cfg.layer_types
        .iter()
        .map(|k| {
            if *k == LayerKind::LinearAttention {
                gdn
            } else {
                attn
            }
        })
        .sum::<usize>()
        + 8
}

impl CudaSequence {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, max_seq: usize, kv_bf16: bool) -> Result<Self> {
        if max_seq == 0 {
            bail!("max-seq must be positive");
        }
        if max_seq > i32::MAX as usize / cfg.kv_dim().max(1) {
            bail!("max-seq {max_seq} is too large for the CUDA backend's 32-bit positions");
        }
        let need = sequence_bytes(cfg, max_seq, kv_bf16);
        let (free, _) = gpu.mem_info()?;
        // Keep 256 MiB for the driver and transient allocations.
        if need + (256 << 20) > free {
            bail!(
                "not enough GPU memory for max-seq {max_seq}: the sequence needs {:.2} GiB, {:.2} GiB free",
                need as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
        }
        let mut layers = Vec::new();
        for kind in &cfg.layer_types {
            layers.push(match kind {
                LayerKind::LinearAttention => DevLayerState::Gdn {
                    ring: gpu.zeros(cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim())?,
                    state: gpu.zeros(
                        cfg.linear_num_value_heads
                            * cfg.linear_key_head_dim
                            * cfg.linear_value_head_dim,
                    )?,
                },
                LayerKind::FullAttention => DevLayerState::Attn {
                    k: gpu.zeros(max_seq * cfg.kv_dim() * kv_elem_bytes(kv_bf16))?,
                    v: gpu.zeros(max_seq * cfg.kv_dim() * kv_elem_bytes(kv_bf16))?,
                },
            });
        }
        Ok(CudaSequence {
            stream: gpu.stream.clone(),
            step: gpu.zeros(2)?,
            layers,
            max_seq,
            kv_bf16,
            id: next_id(),
        })
    }

    fn try_clone(&self) -> Result<Self> {
        fn c<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, s: &CudaSlice<T>) -> Result<CudaSlice<T>> {
            stream
                .clone_dtod(s)
                .map_err(|e| anyhow!("device copy failed: {e:?}"))
        }
        let st = &self.stream;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    DevLayerState::Gdn { ring, state } => DevLayerState::Gdn {
                        ring: c(st, ring)?,
                        state: c(st, state)?,
                    },
                    DevLayerState::Attn { k, v } => DevLayerState::Attn {
                        k: c(st, k)?,
                        v: c(st, v)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let step = self
            .stream
            .clone_dtod(&self.step)
            .map_err(|e| anyhow!("device copy failed: {e:?}"))?;
        self.stream.synchronize().map_err(|e| anyhow!("{e:?}"))?;
        Ok(CudaSequence {
            stream: self.stream.clone(),
            step,
            layers,
            max_seq: self.max_seq,
            kv_bf16: self.kv_bf16,
            id: next_id(),
        })
    }
}

impl SequenceState for CudaSequence {
    fn try_clone_state(&self) -> Result<Box<dyn SequenceState>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn memory_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                DevLayerState::Gdn { ring, state } => (ring.len() + state.len()) * 4,
                DevLayerState::Attn { k, v } => k.len() + v.len(),
            })
            .sum::<usize>()
            + 8
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

    #[test]
    fn bf16_kv_halves_only_the_attention_cache() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let (f32_bytes, bf16_bytes) = (sequence_bytes(&cfg, 262_144, false), sequence_bytes(&cfg, 262_144, true));
        let attn_layers = cfg.layer_types.iter().filter(|k| **k == LayerKind::FullAttention).count();
        let kv_f32 = attn_layers * 2 * 262_144 * cfg.kv_dim() * 4;
        assert_eq!(f32_bytes - bf16_bytes, kv_f32 / 2);
        // 35B at 262,144 tokens: 10 attention layers x K and V x 512 x 4 bytes = 10.7 GB of f32 KV.
        assert_eq!(kv_f32, 10_737_418_240);
    }
}

