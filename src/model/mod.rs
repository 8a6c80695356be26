//! The model's execution plan: weights grouped per layer in the order the forward pass uses
//! them, independent of the backend that runs them.

pub mod plan;

pub use plan::{AttentionWeights, GdnWeights, LayerWeights, MixerWeights, ModelWeights, MoeWeights};
