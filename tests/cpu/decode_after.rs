//! `Backend::decode_after` on the CPU reference (its default, `decode_after_forward`): a prompt's
//! rest fed with its first token chosen from the last row gives the tokens, sequence length and
//! stopping of the old path (all but the last token fed, then a decode step on the last one),
//! greedy and sampled.

use crate::common::tiny_checkpoint;
use lily::backend::{open_backend, Backend, BackendKind, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::sampling::{SamplerSnapshot, SamplingParams};

fn backend() -> Box<dyn Backend> {
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    open_backend(BackendKind::Cpu, &ck).unwrap()
}

fn prompt() -> Vec<u32> {
    (0..23u32).map(|i| (i * 977 + 5) % 1000).collect()
}

/// Tokens and the sequence's length after: `rest` tokens of the prompt through `decode_after`
/// (the ones before fed by `forward`), stopping after `stop_after` tokens.
fn after(b: &mut dyn Backend, rest: usize, steps: usize, snap: Option<&SamplerSnapshot>, stop_after: usize) -> (Vec<u32>, usize, usize) {
    let p = prompt();
    let mut seq = b.new_sequence(p.len() + steps + 1).unwrap();
    let (head, tail) = p.split_at(p.len() - rest);
    if !head.is_empty() {
        b.forward(&mut seq, head, LogitsWanted::None).unwrap();
    }
    let mut got = Vec::new();
    let n = b
        .decode_after(&mut seq, tail, steps, snap, &mut |t| {
            got.push(t);
            got.len() < stop_after
        })
        .unwrap();
    (got, n, seq.len())
}

#[test]
fn the_first_token_from_the_prompts_last_row_continues_as_a_decode_step_would() {
    let mut b = backend();
    let p = prompt();
    let steps = 10;
    // The old path: all but the last token in, the last one fed by the decode.
    let old = after(b.as_mut(), 1, steps, None, usize::MAX);
    assert_eq!((old.1, old.2), (steps, p.len() + steps - 1));
    for rest in [2, 9, p.len()] {
        assert_eq!(after(b.as_mut(), rest, steps, None, usize::MAX), old, "rest of {rest}");
    }
    // Sampled: the draws are keyed by position, so the same snapshot gives the same tokens.
    let snap = SamplerSnapshot { params: SamplingParams { temperature: 0.9, top_p: 0.95, repetition_penalty: 1.1, ..SamplingParams::default() }, seed: 11, counts: vec![] };
    let old = after(b.as_mut(), 1, steps, Some(&snap), usize::MAX);
    assert_eq!(after(b.as_mut(), p.len(), steps, Some(&snap), usize::MAX), old);
    // A stop at the first token leaves the whole feed in and that token out; later stops as
    // decode_greedy's.
    assert_eq!(after(b.as_mut(), 9, steps, None, 1), (old_first(b.as_mut()), 1, p.len()));
    let (got, n, len) = after(b.as_mut(), 9, steps, None, 4);
    assert_eq!((got.len(), n, len), (4, 4, p.len() + 3));
    // No steps feed nothing.
    assert_eq!(after(b.as_mut(), 9, 0, None, usize::MAX), (vec![], 0, p.len() - 9));
}

fn old_first(b: &mut dyn Backend) -> Vec<u32> {
    after(b, 1, 1, None, usize::MAX).0
}

#[test]
fn decode_after_checks_its_feed_and_room() {
    let mut b = backend();
    let mut seq = b.new_sequence(8).unwrap();
    assert!(b.decode_after(&mut seq, &[], 3, None, &mut |_| true).is_err());
    // 6 fed + 3 produced (the last not fed) need 8 places: fits; 4 produced do not.
    let feed = [1u32, 2, 3, 4, 5, 6];
    assert!(b.decode_after(&mut seq, &feed, 4, None, &mut |_| true).is_err());
    assert_eq!(seq.len(), 0, "a refused call feeds nothing");
    assert_eq!(b.decode_after(&mut seq, &feed, 3, None, &mut |_| true).unwrap(), 3);
    assert_eq!(seq.len(), 8);
}
