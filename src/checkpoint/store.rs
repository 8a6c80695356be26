//! Memory-mapped safetensors shards.
pub struct Checkpoint;
