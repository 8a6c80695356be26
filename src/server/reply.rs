//! The reply to one request as its tokens come in, wherever they are decoded (alone, in a
//! batch, or on the host with logits): stop tokens and `max_tokens`, the output pipeline (stop
//! strings, reasoning split, tool calls), logprobs, events to the client, latency metrics, and
//! the usage and finish reason it ends with.

use super::metrics::Metrics;
use super::output::{Delta, OutputPipeline};
use super::request::Endpoint;
use super::worker::{Event, Job, TokenLogprob, Usage};
use crate::engine::sampling::{log_softmax, Sampler, SamplerSnapshot};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::time::Instant;

/// How a reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// A stop token (it is counted in the usage, not shown).
    StopToken,
    /// A stop string matched.
    StopString,
    /// `max_tokens`, or the sequence is full.
    Length,
    /// The client went away.
    ClientGone,
}

pub(super) fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// The log-probability of `id` under `logits`, with the `top` most likely alternatives.
pub(super) fn logprob_entry(tok: &Tokenizer, logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let (token, bytes) = token_text(tok, id);
    let mut tops = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        for i in idx {
            let (t, b) = token_text(tok, i);
            tops.push((t, b, lp[i as usize].max(-9999.0)));
        }
    }
    TokenLogprob { token, bytes, logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY).max(-9999.0), top: tops }
}

/// One request's reply in progress.
pub struct Reply {
    pub job: Job,
    pub usage: Usage,
    /// The request's sampling, continued by whichever path decodes it (draws keyed by position).
    pub sampler: SamplerSnapshot,
    /// The token fed at the next decode step (the last one accepted).
    pub next: u32,
    pub generated: Vec<u32>,
    pub end: Option<End>,
    /// The reply cannot go on: a backend error or panic in one of its steps, or its
    /// structured-output matcher failed. The request is answered with an error.
    pub failed: Option<anyhow::Error>,
    pub started: Instant,
    pipeline: OutputPipeline,
    decoder: StreamDecoder,
    last_token_at: Option<Instant>,
    pub first_token_at: Option<Instant>,
    /// When the request joined the batch (before its prefix-cache lookup), when it had its
    /// sequence, and when all but the last prompt token were in.
    pub admitted: Instant,
    pub resumed: Instant,
    pub prompt_in: Option<Instant>,
    /// What [`Reply::finish`] returned, once it ran: the final event goes out when the reply
    /// ends, mid-way through a decode call, not when the call returns.
    answered: Option<Option<&'static str>>,
}

impl Reply {
    /// The reply to `job`'s choice `job.index`; a choice forked from another (`job.index` past the
    /// job's first) counts no prompt tokens of its own.
    pub fn new(job: Job, cached_tokens: usize) -> Self {
        let req = &job.req;
        let chat = req.endpoint == Endpoint::Chat;
        let tools = if req.has_tools() { Some(req.tool_schemas.clone()) } else { None };
        let pipeline = OutputPipeline::new(req.stop.clone(), if chat { Some(job.starts_in_reasoning) } else { None }, tools);
        // The request seed fixes the snapshot's seed, so it fixes every token; choice j of a
        // prompt draws with seed + j (choice 0 is what the prompt alone with that seed gives).
        let mut params = req.sampling.clone();
        params.seed = params.seed.map(|s| s.wrapping_add((job.index % req.n) as u64));
        let sampler = Sampler::new(params).snapshot();
        let forked = job.index % req.n != 0;
        let usage = if forked { Usage::default() } else { Usage { prompt_tokens: job.prompt.len(), cached_tokens, ..Default::default() } };
        Reply { job, usage, sampler, next: 0, generated: Vec::new(), end: None, failed: None, started: Instant::now(), pipeline, decoder: StreamDecoder::new().skip_special(true), last_token_at: None, first_token_at: None, admitted: Instant::now(), resumed: Instant::now(), prompt_in: None, answered: None }
    }

    /// Tokens this reply may still produce.
    pub fn remaining(&self) -> usize {
        self.job.max_tokens.saturating_sub(self.generated.len())
    }

    /// Each token needs the logits on the host (logprobs), so the reply's steps run there.
    /// Structured output does not: its mask goes to the backend's sampler (`StepHooks::mask`).
    pub fn wants_logits(&self) -> bool {
        self.job.req.logprobs
    }

    /// The tokens the structured-output constraint allows next (`StepHooks::mask`), or false
    /// when none applies now. A constraint that fails ends the request with its error, and
    /// the row is left unconstrained for the step that is already due.
    pub fn allowed(&mut self, words: &mut [u32]) -> bool {
        let Some(c) = self.job.constraint.as_mut() else { return false };
        match c.allowed(words) {
            Ok(on) => on,
            Err(e) => {
                self.failed = Some(e.context("structured output"));
                false
            }
        }
    }

    /// Draws the next token from `logits` (fed at `position`): masked by the structured-output
    /// constraint when it applies, then sampled with the request's sampling.
    pub fn draw(&mut self, logits: &mut [f32], position: usize) -> anyhow::Result<u32> {
        if let Some(c) = self.job.constraint.as_mut() {
            c.mask(logits)?;
        }
        Ok(self.sampler.sample_at(logits, position))
    }

    /// Whether the client is gone (checked between steps where no token is sent).
    pub fn client_gone(&self) -> bool {
        self.job.events.is_closed()
    }

    /// Takes the next token (with the logits it was drawn from, or none where it was chosen on
    /// the device): sends what it releases to the client and says whether to go on. When it
    /// returns false, `end` says why.
    pub fn accept(&mut self, tok: u32, logits: &[f32], stop_ids: &[u32], tokenizer: &Tokenizer, metrics: &Metrics) -> bool {
        let go = self.take_token(tok, logits, stop_ids, tokenizer, metrics);
        // An ended reply is answered now: its client has its last event (and can send its next
        // request) while the rest of the decode call runs the other rows, up to 16 steps.
        if !go && self.end.is_some() && self.failed.is_none() {
            self.finish();
        }
        go
    }

    /// Whether the final event went out (or the client was gone by then).
    pub fn answered(&self) -> bool {
        self.answered.is_some()
    }

    fn take_token(&mut self, tok: u32, logits: &[f32], stop_ids: &[u32], tokenizer: &Tokenizer, metrics: &Metrics) -> bool {
        if self.failed.is_some() {
            // Drawn after the constraint failed (see `allowed`): not the request's.
            return false;
        }
        if stop_ids.contains(&tok) && !self.job.req.ignore_eos {
            self.end = Some(End::StopToken);
            // Not the request's output, but a pipelined decode may have fed it already, so it
            // may be part of the sequence the prefix cache keeps (`stop_token`).
            self.next = tok;
            return false;
        }
        let now = Instant::now();
        match self.last_token_at {
            None => {
                metrics.ttft.observe(now.duration_since(self.job.arrived).as_secs_f64());
                metrics.prefill_time.observe(now.duration_since(self.admitted).as_secs_f64());
                self.first_token_at = Some(now);
            }
            Some(t) => metrics.itl.observe(now.duration_since(t).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        metrics.generated(1);
        self.sampler.observe(tok);
        self.generated.push(tok);
        if self.pipeline.in_reasoning() {
            self.usage.reasoning_tokens += 1;
        }
        let text = self.decoder.push(tokenizer, tok);
        let (delta, hit) = self.pipeline.push(&text);
        if let Some(c) = self.job.constraint.as_mut() {
            // The token that ends the reasoning is the last one the constraint lets through.
            let r = if c.is_active() { c.consume(tok) } else { Ok(()) };
            if !c.is_active() && !self.pipeline.in_reasoning() {
                c.activate();
            }
            if let Err(e) = r {
                self.failed = Some(e.context("structured output"));
                return false;
            }
        }
        let logprobs = if self.job.req.logprobs && !logits.is_empty() { vec![logprob_entry(tokenizer, logits, tok, self.job.req.top_logprobs)] } else { vec![] };
        if !delta.is_empty() || !logprobs.is_empty() {
            if self.job.events.send(Event::Delta { index: self.job.index, delta, logprobs }).is_err() {
                self.end = Some(End::ClientGone);
                return false;
            }
        } else if self.job.events.is_closed() {
            self.end = Some(End::ClientGone);
            return false;
        }
        if hit {
            self.end = Some(End::StopString);
            return false;
        }
        if self.remaining() == 0 {
            self.end = Some(End::Length);
            return false;
        }
        self.next = tok;
        true
    }

    /// The stop token that ended the reply, if one did.
    pub fn stop_token(&self) -> Option<u32> {
        (self.end == Some(End::StopToken)).then_some(self.next)
    }

    /// Sends the rest of the text and the final event (once: later calls return what the first
    /// did); returns the finish reason, or `None` when the client is gone. Call once `end` is set.
    pub fn finish(&mut self) -> Option<&'static str> {
        if let Some(done) = self.answered {
            return done;
        }
        let done = self.send_final();
        self.answered = Some(done);
        done
    }

    fn send_final(&mut self) -> Option<&'static str> {
        let end = self.end.unwrap_or(End::Length);
        self.usage.completion_tokens = self.generated.len() + usize::from(end == End::StopToken);
        if end == End::ClientGone {
            return None;
        }
        let tail = if end == End::StopString { Delta::default() } else { self.pipeline.finish(&self.decoder.finish()) };
        if !tail.is_empty() {
            let _ = self.job.events.send(Event::Delta { index: self.job.index, delta: tail, logprobs: vec![] });
        }
        // "tool_calls" only when every call is whole: a call cut by the end of sequence, a stop
        // string or max_tokens ends as "stop" / "length" with its partial arguments.
        let finish = if self.pipeline.tool_calls() > 0 && !self.pipeline.tool_call_cut() && end != End::Length {
            "tool_calls"
        } else if end == End::Length {
            "length"
        } else {
            "stop"
        };
        if self.job.events.send(Event::Done { index: self.job.index, finish_reason: finish, usage: self.usage.clone() }).is_err() {
            self.end = Some(End::ClientGone);
            return None;
        }
        Some(finish)
    }
}
