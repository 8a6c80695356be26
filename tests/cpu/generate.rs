//! `engine::generate`: the plain-greedy path through `Backend::decode_greedy` (the token picked
//! on the device on CUDA) gives the same tokens, stop handling and sequence length as the path
//! that samples from host logits; sampled requests without logprobs go through
//! `Backend::decode_sampled` and stay reproducible from the request seed.

use crate::common::tiny_checkpoint;
use lily::backend::{open_backend, BackendKind};
use lily::checkpoint::Checkpoint;
use lily::engine::generate::{generate, FinishReason, GenerationStats, Next};
use lily::engine::sampling::{Sampler, SamplingParams};

fn run(want_logits: bool, max_tokens: usize, stop_ids: &[u32], stop_after: usize) -> (Vec<u32>, GenerationStats, usize) {
    run_with(SamplingParams::greedy(), want_logits, max_tokens, stop_ids, stop_after)
}

fn run_with(params: SamplingParams, want_logits: bool, max_tokens: usize, stop_ids: &[u32], stop_after: usize) -> (Vec<u32>, GenerationStats, usize) {
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    let mut backend = open_backend(BackendKind::Cpu, &ck).unwrap();
    let prompt: Vec<u32> = (0..23u32).map(|i| (i * 977 + 5) % 1000).collect();
    let mut seq = backend.new_sequence(prompt.len() + max_tokens + 1).unwrap();
    let mut sampler = Sampler::new(params);
    let mut toks = Vec::new();
    let stats = generate(backend.as_mut(), &mut seq, &prompt, max_tokens, &mut sampler, stop_ids, want_logits, |t, logits| {
        assert_eq!(logits.is_empty(), !want_logits && !toks.is_empty(), "logits only where asked (the first token always has them)");
        toks.push(t);
        if toks.len() == stop_after { Next::Stop } else { Next::Continue }
    })
    .unwrap();
    (toks, stats, seq.len())
}

#[test]
fn device_greedy_path_produces_the_same_tokens_as_the_logits_path() {
    let (a, sa, la) = run(true, 12, &[], usize::MAX);
    let (b, sb, lb) = run(false, 12, &[], usize::MAX);
    assert_eq!(a.len(), 12);
    assert_eq!(a, b);
    assert_eq!((sa.completion_tokens, sa.finish, la), (sb.completion_tokens, sb.finish, lb));
    assert_eq!(sb.finish, FinishReason::Length);
    // A stop id at the 6th token ends both the same way, without passing it on.
    let (c, sc, _) = run(false, 12, &[a[5]], usize::MAX);
    let (d, sd, _) = run(true, 12, &[a[5]], usize::MAX);
    assert_eq!(c, d);
    assert_eq!(c, a[..a.iter().position(|&t| t == a[5]).unwrap()].to_vec());
    assert_eq!((sc.finish, sd.finish), (FinishReason::Stop, FinishReason::Stop));
    // The callback stopping after 4 tokens.
    let (e, se, _) = run(false, 12, &[], 4);
    assert_eq!(e, a[..4].to_vec());
    assert_eq!(se.finish, FinishReason::Cancelled);
}

#[test]
fn sampled_requests_without_logprobs_are_reproducible() {
    let chat = SamplingParams { temperature: 0.9, top_p: 0.9, top_k: 40, presence_penalty: 0.3, seed: Some(17), ..Default::default() };
    let (a, sa, la) = run_with(chat.clone(), false, 12, &[], usize::MAX);
    let (b, _, lb) = run_with(chat.clone(), false, 12, &[], usize::MAX);
    assert_eq!((a.len(), sa.finish), (12, FinishReason::Length));
    assert_eq!((a.clone(), la), (b, lb), "same seed, same tokens and sequence length");
    let (c, _, _) = run_with(SamplingParams { seed: Some(18), ..chat.clone() }, false, 12, &[], usize::MAX);
    assert_ne!(a, c, "another seed samples other tokens");
    // The callback stopping after 5 tokens ends the backend's loop there.
    let (d, sd, _) = run_with(chat, false, 12, &[], 5);
    assert_eq!((d, sd.finish), (a[..5].to_vec(), FinishReason::Cancelled));
}
