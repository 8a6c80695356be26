#![recursion_limit = "256"]
//! Lily: a batch-1 inference engine for Qwen3.6-35B-A3B (MLX affine 4-bit checkpoints).
//!
//! Layers of the crate, in the order data flows:
//! checkpoint (config, layout, mmap'd shards) -> model plan -> backend (cpu | cuda) -> engine
//! (sampling, generation) -> CLI / server. `synth` writes random-weight checkpoints with the
//! exact real layout; `tokenizer` holds the tokenizer, chat template and streaming detokenizer.

pub mod backend;
pub mod checkpoint;
pub mod engine;
pub mod model;
pub mod quant;
pub mod quantize;
pub mod server;
pub mod synth;
pub mod tokenizer;
