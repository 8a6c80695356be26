//! The prefill → decode loop for one request on any backend.

use super::sampling::Sampler;
use crate::backend::{Backend, LogitsWanted, Sequence};
use anyhow::{bail, Result};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token was produced (it is not passed to the callback).
    Stop,
    /// The callback asked to stop (client gone, stop string matched, …).
    Cancelled,
}

impl FinishReason {
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop | FinishReason::Cancelled => "stop",
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    pub finish: FinishReason,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Decode rate over the steps after the first token (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        self.completion_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// What the per-token callback wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Continue,
    Stop,
}

/// Feeds `prompt` (the tokens not yet in `seq`) and generates up to `max_tokens` tokens.
/// `on_token(token, logits)` sees every generated token except a stop token, with the logits
/// it was sampled from (after penalties).
pub fn generate(
    backend: &mut dyn Backend,
    seq: &mut Sequence,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    mut on_token: impl FnMut(u32, &[f32]) -> Next,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        bail!("empty prompt: at least one new token is needed to produce logits");
    }
    let t0 = Instant::now();
    let mut logits = backend.forward(seq, prompt, LogitsWanted::Last)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut produced = 0;
    let mut finish = FinishReason::Length;
    while produced < max_tokens {
        let tok = sampler.sample(&mut logits);
        if stop_ids.contains(&tok) {
            finish = FinishReason::Stop;
            break;
        }
        produced += 1;
        sampler.observe(tok);
        if on_token(tok, &logits) == Next::Stop {
            finish = FinishReason::Cancelled;
            break;
        }
        if produced == max_tokens {
            break;
        }
        logits = backend.forward(seq, &[tok], LogitsWanted::Last)?;
    }
    Ok(GenerationStats { prompt_tokens: prompt.len(), completion_tokens: produced, prefill_secs, decode_secs: t1.elapsed().as_secs_f64(), finish })
}
