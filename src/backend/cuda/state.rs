//! Per-sequence device state: the step buffer (token id, position), Gated DeltaNet conv rings and
//! fp32 recurrent states, and the attention KV caches (f32, `[max_seq][kv_heads * head_dim]`,
//! allocated for the full max-seq up front so nothing allocates mid-request).

use super::context::Gpu;
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
    Attn {
        k: CudaSlice<f32>,
        v: CudaSlice<f32>,
    },
}

pub struct CudaSequence {
    pub stream: Arc<CudaStream>,
    /// `[token, position]` of the step being computed (i32).
    pub step: CudaSlice<i32>,
    pub layers: Vec<DevLayerState>,
    pub max_seq: usize,
    /// Unique per sequence (and per clone): decode graphs are keyed by it, since they bake in
    /// this sequence's device addresses.
    pub id: u64,
}

fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Bytes of device memory one sequence of `max_seq` tokens needs.
pub fn sequence_bytes(cfg: &ModelConfig, max_seq: usize) -> usize {
    let gdn = (cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim()
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        * 4;
    let attn = 2 * max_seq * cfg.kv_dim() * 4;
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
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, max_seq: usize) -> Result<Self> {
        if max_seq == 0 {
            bail!("max-seq must be positive");
        }
        if max_seq > i32::MAX as usize / cfg.kv_dim().max(1) {
            bail!("max-seq {max_seq} is too large for the CUDA backend's 32-bit positions");
        }
        let need = sequence_bytes(cfg, max_seq);
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
                    k: gpu.zeros(max_seq * cfg.kv_dim())?,
                    v: gpu.zeros(max_seq * cfg.kv_dim())?,
                },
            });
        }
        Ok(CudaSequence {
            stream: gpu.stream.clone(),
            step: gpu.zeros(2)?,
            layers,
            max_seq,
            id: next_id(),
        })
    }

    fn try_clone(&self) -> Result<Self> {
        let c = |s: &CudaSlice<f32>| {
            self.stream
                .clone_dtod(s)
                .map_err(|e| anyhow!("device copy failed: {e:?}"))
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    DevLayerState::Gdn { ring, state } => DevLayerState::Gdn {
                        ring: c(ring)?,
                        state: c(state)?,
                    },
                    DevLayerState::Attn { k, v } => DevLayerState::Attn { k: c(k)?, v: c(v)? },
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
            id: next_id(),
        })
    }
}

impl SequenceState for CudaSequence {
    fn clone_state(&self) -> Box<dyn SequenceState> {
        // The trait cannot return an error; a failed device copy (out of memory) is fatal here.
        Box::new(
            self.try_clone()
                .unwrap_or_else(|e| panic!("cloning a CUDA sequence: {e:#}")),
        )
    }
    fn memory_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                DevLayerState::Gdn { ring, state } => (ring.len() + state.len()) * 4,
                DevLayerState::Attn { k, v } => (k.len() + v.len()) * 4,
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
