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
///
/// When the caller does not need the logits (`want_logits` false), the tokens after the first
/// come from the backend's own loop: `Backend::decode_greedy` for plain greedy (the same tokens
/// either way: argmax, ties to the lowest id), else `Backend::decode_sampled` with a snapshot of
/// the sampler (seeded from it, so a request seed still fixes the tokens). On CUDA the token
/// stays on the device and step N+1 is queued before token N is read; `on_token` then gets an
/// empty logits slice.
pub fn generate(
    backend: &mut dyn Backend,
    seq: &mut Sequence,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    want_logits: bool,
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
    let on_device = !want_logits;
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
        if on_device {
            let greedy = sampler.is_plain_greedy();
            let snap = (!greedy).then(|| sampler.snapshot());
            let left = max_tokens - produced;
            let mut each = |t: u32| {
                if stop_ids.contains(&t) {
                    finish = FinishReason::Stop;
                    return false;
                }
                produced += 1;
                sampler.observe(t);
                if on_token(t, &[]) == Next::Stop {
                    finish = FinishReason::Cancelled;
                    return false;
                }
                true
            };
            match &snap {
                None => backend.decode_greedy(seq, tok, left, &mut each)?,
                Some(snap) => backend.decode_sampled(seq, tok, left, snap, &mut each)?,
            };
            break;
        }
        logits = backend.forward(seq, &[tok], LogitsWanted::Last)?;
    }
    Ok(GenerationStats { prompt_tokens: prompt.len(), completion_tokens: produced, prefill_secs, decode_secs: t1.elapsed().as_secs_f64(), finish })
}
