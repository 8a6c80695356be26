//! `Backend::decode_batch` on the CPU reference (the contract every backend follows; the CUDA
//! implementation is tested against it in tests/cuda_batch.rs): each row produces exactly what
//! `decode_sampled` produces for it alone, rows leave independently, sequences keep the same
//! length rules, and invalid rows fail before anything runs.

use crate::common::{check_token_masks, tiny_checkpoint};
use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, BatchRow, LogitsWanted, Sequence};
use lily::checkpoint::Checkpoint;
use lily::engine::contract::batch_prompt;
use lily::engine::sampling::{SamplerSnapshot, SamplingParams};

fn prefilled(b: &mut CpuBackend, i: usize, len: usize) -> (Sequence, u32) {
    let p = batch_prompt(i, len, b.config().vocab_size);
    let mut seq = b.new_sequence(64).unwrap();
    b.forward(&mut seq, &p[..len - 1], LogitsWanted::None).unwrap();
    (seq, p[len - 1])
}

fn settings() -> Vec<SamplerSnapshot> {
    let s = |params, seed| SamplerSnapshot { params, seed, counts: vec![] };
    vec![
        s(SamplingParams::greedy(), 0),
        s(SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() }, 5),
        s(SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.5, ..Default::default() }, 6),
        s(SamplingParams { temperature: 1.0, min_p: 0.05, ..Default::default() }, 7),
    ]
}

#[test]
fn every_row_decodes_as_it_would_alone() {
    let mut cpu = CpuBackend::new(&Checkpoint::open(tiny_checkpoint()).unwrap()).unwrap();
    let snaps = settings();
    let lens = [3, 8, 13, 21];
    let max = [6, 9, 4, 9];
    let mut seqs: Vec<(Sequence, u32)> = lens.iter().enumerate().map(|(i, &l)| prefilled(&mut cpu, i, l)).collect();
    let mut got = vec![Vec::new(); 4];
    let mut order = Vec::new();
    let mut rows: Vec<BatchRow> = seqs
        .iter_mut()
        .zip(&snaps)
        .zip(max)
        .map(|(((seq, t), s), m)| BatchRow { seq, first_token: *t, max_tokens: m, sampler: s.clone() })
        .collect();
    // Row 1 hangs up after its third token.
    let produced = cpu
        .decode_batch(&mut rows, &mut |i: usize, t: u32| {
            got[i].push(t);
            order.push(i);
            !(i == 1 && got[i].len() == 3)
        })
        .unwrap();
    assert_eq!(produced, vec![6, 3, 4, 9]);
    // Steps go row by row: the first step visits every row in order.
    assert_eq!(&order[..4], &[0, 1, 2, 3]);
    for (i, &l) in lens.iter().enumerate() {
        assert_eq!(seqs[i].0.len(), l - 1 + produced[i], "row {i}: first token + all but the last");
        let (mut seq, t) = prefilled(&mut cpu, i, l);
        let mut alone = Vec::new();
        cpu.decode_sampled(&mut seq, t, produced[i], &snaps[i], &mut |tok| {
            alone.push(tok);
            true
        })
        .unwrap();
        assert_eq!(alone, got[i], "row {i}");
    }
}

#[test]
fn invalid_rows_fail_before_any_step() {
    let mut cpu = CpuBackend::new(&Checkpoint::open(tiny_checkpoint()).unwrap()).unwrap();
    let (mut a, ta) = prefilled(&mut cpu, 0, 5);
    let (mut b, tb) = prefilled(&mut cpu, 1, 5);
    let greedy = SamplerSnapshot { params: SamplingParams::greedy(), seed: 0, counts: vec![] };
    let bad = SamplerSnapshot { params: SamplingParams { top_p: 1.5, ..Default::default() }, ..greedy.clone() };
    let cases: Vec<(u32, usize, SamplerSnapshot, &str)> = vec![
        (u32::MAX, 2, greedy.clone(), "outside the vocabulary"),
        (tb, 500, greedy.clone(), "max-seq"),
        (tb, 2, bad, "top_p"),
    ];
    for (tok, max, snap, want) in cases {
        let mut calls = 0;
        let mut rows = vec![
            BatchRow { seq: &mut a, first_token: ta, max_tokens: 2, sampler: greedy.clone() },
            BatchRow { seq: &mut b, first_token: tok, max_tokens: max, sampler: snap },
        ];
        let e = cpu.decode_batch(&mut rows, &mut |_: usize, _: u32| {
            calls += 1;
            true
        });
        let msg = format!("{:#}", e.unwrap_err());
        assert!(msg.contains("batch row 1") && msg.contains(want), "{msg}");
        assert_eq!(calls, 0);
        assert_eq!((a.len(), b.len()), (4, 4));
    }
}

#[test]
fn token_masks_hold_their_rows_and_leave_the_others_alone() {
    let mut cpu = CpuBackend::new(&Checkpoint::open(tiny_checkpoint()).unwrap()).unwrap();
    check_token_masks(&mut cpu, [3, 8, 13, 21], 64);
}
