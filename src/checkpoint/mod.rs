//! Checkpoint side of Lily: `config.json`, the tensor inventory, and the memory-mapped shards.

pub mod config;
pub mod layout;
pub mod store;

pub use config::{LayerKind, ModelConfig, QuantConfig};
pub use layout::DType;
pub use store::Checkpoint;
