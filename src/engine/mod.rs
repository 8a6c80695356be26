//! Generation on top of a backend: token selection and the prefill/decode loop.

pub mod contract;
pub mod default_model;
pub mod generate;
pub mod perplexity;
pub mod sampling;

pub use generate::{generate, FinishReason, GenerationStats, Next};
pub use sampling::{Sampler, SamplingParams};
