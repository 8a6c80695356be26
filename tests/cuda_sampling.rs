//! The device sampler (kernels/sample.cu) against the host sampler (engine::sampling), and
//! sampled decoding on the CUDA backend. These need an H100/H200 (`bash .device/run test
//! cuda_sampl`); they are ignored elsewhere.
//!
//! The two samplers draw from different random streams, so they are compared in distribution: a
//! two-sample chi-square test over 20,000 draws each (tokens drawn fewer than 10 times in all are
//! pooled into one bin) must not reject at p = 0.001, and with top-k every device token must be
//! among the k largest logits. Greedy (temperature 0) must match exactly, penalties included.

mod common;

use common::{rnd, tiny_checkpoint};
use lily::backend::cuda::{testing, CudaBackend, CudaOptions};
use lily::backend::{Backend, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::sampling::{Sampler, SamplerSnapshot, SamplingParams};
use std::collections::{BTreeMap, HashSet};

fn cuda() -> CudaBackend {
    CudaBackend::with_options(&Checkpoint::open(tiny_checkpoint()).unwrap(), CudaOptions::default()).expect("CUDA backend (needs an sm_90 GPU)")
}

/// Logits with a realistic spread: a few strong candidates over a long tail.
fn logits(n: usize, seed: u64) -> Vec<f32> {
    rnd(seed, n).iter().enumerate().map(|(i, v)| v * 4.0 + if i % 97 == 0 { 6.0 } else { 0.0 }).collect()
}

fn snap(params: SamplingParams, seed: u64) -> SamplerSnapshot {
    SamplerSnapshot { params, seed, counts: vec![] }
}

fn host_draws(l: &[f32], s: &SamplerSnapshot, n: usize) -> Vec<u32> {
    let mut smp = Sampler::from_snapshot(s);
    (0..n).map(|_| smp.sample(&mut l.to_vec())).collect()
}

/// Two-sample chi-square statistic and its degrees of freedom (equal sample sizes).
fn chi_square(a: &[u32], b: &[u32]) -> (f64, usize) {
    let mut bins: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    a.iter().for_each(|&t| bins.entry(t).or_default().0 += 1.0);
    b.iter().for_each(|&t| bins.entry(t).or_default().1 += 1.0);
    let (mut cells, mut pool) = (Vec::new(), (0.0, 0.0));
    for (_, (x, y)) in bins {
        if x + y >= 10.0 {
            cells.push((x, y));
        } else {
            pool = (pool.0 + x, pool.1 + y);
        }
    }
    if pool.0 + pool.1 > 0.0 {
        cells.push(pool);
    }
    let stat = cells.iter().map(|(x, y)| (x - y) * (x - y) / (x + y)).sum();
    (stat, cells.len().saturating_sub(1))
}

/// The chi-square value a statistic must stay under at p = 0.001 (Wilson-Hilferty).
fn critical(dof: usize) -> f64 {
    let k = dof.max(1) as f64;
    let z = 3.09;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sampler_matches_the_host_sampler_in_distribution() {
    let b = cuda();
    let n = 5000;
    let l = logits(n, 3);
    let settings = [
        ("chat: T 0.7, top-p 0.8, top-k 20", SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() }),
        ("T 1", SamplingParams { temperature: 1.0, ..Default::default() }),
        ("T 1, min-p 0.05", SamplingParams { temperature: 1.0, min_p: 0.05, ..Default::default() }),
        ("T 1.3, top-p 0.95", SamplingParams { temperature: 1.3, top_p: 0.95, ..Default::default() }),
        ("T 0.5, top-k 50, min-p 0.02, top-p 0.9", SamplingParams { temperature: 0.5, top_k: 50, min_p: 0.02, top_p: 0.9, ..Default::default() }),
        ("T 0.9, top-k 3", SamplingParams { temperature: 0.9, top_k: 3, ..Default::default() }),
    ];
    let draws = 20_000;
    for (name, params) in settings {
        let s = snap(params, 11);
        let host = host_draws(&l, &s, draws);
        let dev = testing::sample(&b, &l, &s, draws).unwrap();
        // Top-k bounds the kept set exactly: the k largest logits.
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|&x, &y| l[y as usize].total_cmp(&l[x as usize]));
        let k = if s.params.top_k == 0 { n } else { s.params.top_k };
        let top: HashSet<u32> = order[..k].iter().copied().collect();
        let outside = dev.iter().filter(|t| !top.contains(t)).count();
        let (stat, dof) = chi_square(&host, &dev);
        let crit = critical(dof);
        eprintln!("{name}: chi-square {stat:.1} over {dof} dof (p=0.001 critical {crit:.1}); {} distinct device tokens", dev.iter().collect::<HashSet<_>>().len());
        assert!(stat < crit, "{name}: device and host samplers differ (chi-square {stat:.1} > {crit:.1}, {dof} dof)");
        assert_eq!(outside, 0, "{name}: the device drew tokens outside the top-{k}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sampler_greedy_with_penalties_matches_the_host_exactly() {
    let b = cuda();
    // The full vocabulary: the kernels' slices and passes at their real size.
    let l = logits(248_320, 5);
    for params in [
        SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.3, ..Default::default() },
        SamplingParams { temperature: 0.8, top_k: 1, ..Default::default() },
        SamplingParams { temperature: 0.6, min_p: 1.0, frequency_penalty: 2.0, ..Default::default() },
    ] {
        let s = SamplerSnapshot { params, seed: 1, counts: vec![(l.iter().enumerate().fold(0, |m, (i, v)| if *v > l[m] { i } else { m }) as u32, 1)] };
        let mut host = Sampler::from_snapshot(&s);
        let want: Vec<u32> = (0..40)
            .map(|_| {
                let t = host.sample(&mut l.clone());
                host.observe(t);
                t
            })
            .collect();
        let got = testing::sample(&b, &l, &s, 40).unwrap();
        assert_eq!(got, want, "{:?}", s.params);
        assert!(got.iter().collect::<HashSet<_>>().len() > 1 || s.params.frequency_penalty == 0.0, "the penalties moved the choice");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_small_k_sampler_draws_the_general_kernels_tokens() {
    // `sample_small_k` (one launch, rows with top-k <= SMALL_K) must choose exactly what
    // sample_prep + sample_select x 8 + sample_draw choose: the same thresholds from the same
    // integer masses, the same Gumbel scores. Over several logit rows (one with most logits
    // exactly equal, as a model's unused vocabulary rows give, so blocks overflow their lists and
    // the last block reads the row), settings and seeds, 64 draws each at successive positions.
    // In the last row fewer than k values sit above the tied zeros (+0.0 and -0.0 mixed), so the
    // k-th largest is 0.0 itself and the kept set is most of the row: only the whole-row reading
    // finds it.
    use lily::backend::cuda::sampling::SMALL_K;
    let b = cuda();
    let n = b.config().vocab_size;
    let mut tied = vec![0.0f32; n];
    for (i, v) in logits(n, 7).iter().enumerate().filter(|(i, _)| i % 1013 == 0) {
        tied[i] = *v;
    }
    let mut few_above: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { -0.0 } else { 0.0 }).collect();
    for (j, i) in (0..10).map(|j| (j, 7 + 24_551 * j)).filter(|&(_, i)| i < n) {
        few_above[i] = 1.0 + 0.25 * j as f32;
    }
    let rows = [logits(n, 3), logits(n, 5).iter().map(|v| v * 0.05).collect(), tied, few_above];
    let chat = SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() };
    let settings = [
        chat.clone(),
        SamplingParams { top_k: 1, ..chat.clone() },
        SamplingParams { top_k: SMALL_K, top_p: 0.95, ..chat.clone() },
        SamplingParams { top_p: 1.0, ..chat.clone() },
        SamplingParams { min_p: 0.05, ..chat.clone() },
        SamplingParams { temperature: 1.3, top_k: 40, top_p: 0.5, ..Default::default() },
        SamplingParams { repetition_penalty: 1.1, presence_penalty: 0.4, frequency_penalty: 0.2, ..chat.clone() },
        SamplingParams { top_p: 1.0, top_k: SMALL_K, ..chat.clone() },
        SamplingParams { top_p: 0.95, top_k: 20, temperature: 1.0, ..Default::default() },
    ];
    for (ri, l) in rows.iter().enumerate() {
        for (si, params) in settings.iter().enumerate() {
            for seed in [1u64, 77] {
                let s = snap(params.clone(), seed);
                let small = testing::sample(&b, l, &s, 64).unwrap();
                let general = testing::sample_general(&b, l, &s, 64).unwrap();
                assert_eq!(small, general, "logits row {ri}, setting {si} ({params:?}), seed {seed}");
            }
        }
    }
    // A batched step's rows: 64 rows take 8 blocks each, so each block lists the k largest of a
    // slice of ~31,000 values (one row: 64 blocks of ~3,900); every row draws the same token as
    // one row through the general kernels.
    for (ri, l) in rows.iter().enumerate() {
        for (si, params) in settings.iter().enumerate() {
            let s = snap(params.clone(), 5);
            let general = testing::sample_general(&b, l, &s, 1).unwrap()[0];
            for n_rows in [8usize, 64] {
                let batch = testing::sample_rows(&b, l, &s, n_rows, true).unwrap();
                assert!(batch.iter().all(|&t| t == general), "logits row {ri}, setting {si}, {n_rows} rows: {batch:?} against {general}");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sampler_same_seed_same_tokens() {
    let b = cuda();
    let l = logits(248_320, 7);
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, ..Default::default() };
    let a = testing::sample(&b, &l, &snap(params.clone(), 42), 200).unwrap();
    assert_eq!(a, testing::sample(&b, &l, &snap(params.clone(), 42), 200).unwrap());
    assert_ne!(a, testing::sample(&b, &l, &snap(params, 43), 200).unwrap());
    assert!(a.iter().collect::<HashSet<_>>().len() > 10, "it samples");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sampled_decode_follows_the_snapshot() {
    // top-k 1 at any temperature is greedy: sampled decoding on the device (graphs, two steps in
    // flight) must give decode_greedy's tokens; a real sampling snapshot gives the same tokens
    // twice and stops where asked.
    let mut b = cuda();
    let vocab = b.config().vocab_size;
    let prompt = lily::engine::contract::contract_prompt(40, vocab);
    let run = |b: &mut CudaBackend, snap: Option<&SamplerSnapshot>, steps: usize| -> Vec<u32> {
        let mut seq = b.new_sequence(prompt.len() + steps + 1).unwrap();
        b.forward(&mut seq, &prompt[..prompt.len() - 1], LogitsWanted::None).unwrap();
        let mut toks = Vec::new();
        let last = prompt[prompt.len() - 1];
        match snap {
            None => b.decode_greedy(&mut seq, last, steps, &mut |t| { toks.push(t); true }).unwrap(),
            Some(s) => b.decode_sampled(&mut seq, last, steps, s, &mut |t| { toks.push(t); true }).unwrap(),
        };
        assert_eq!(seq.len(), prompt.len() + steps - 1);
        toks
    };
    let greedy = run(&mut b, None, 24);
    let top1 = snap(SamplingParams { temperature: 0.8, top_k: 1, ..Default::default() }, 5);
    assert_eq!(run(&mut b, Some(&top1), 24), greedy);
    let chat = snap(SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, repetition_penalty: 1.05, ..Default::default() }, 9);
    let a = run(&mut b, Some(&chat), 24);
    assert_eq!(a, run(&mut b, Some(&chat), 24), "same snapshot, same tokens");
    assert!(a.iter().all(|&t| (t as usize) < vocab));
    // Stopping early: the callback's false ends the loop after that token.
    let mut seq = b.new_sequence(prompt.len() + 30).unwrap();
    b.forward(&mut seq, &prompt[..prompt.len() - 1], LogitsWanted::None).unwrap();
    let mut seen = 0;
    let got = b.decode_sampled(&mut seq, prompt[prompt.len() - 1], 24, &chat, &mut |_| { seen += 1; seen < 5 }).unwrap();
    assert_eq!((got, seen), (5, 5));
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_sampled_decode_after_a_prompt_follows_the_snapshot() {
    // decode_after draws the first token on the device from the prefill's last row with the
    // snapshot's sampler, keyed by the last prompt position as a decode step's draw is: top-k 1
    // gives the greedy tokens, a real snapshot the same tokens twice; a stop at the first token
    // ends the call there.
    let mut b = cuda();
    let vocab = b.config().vocab_size;
    let prompt = lily::engine::contract::contract_prompt(40, vocab);
    let run = |b: &mut CudaBackend, snap: Option<&SamplerSnapshot>, steps: usize, stop_at: usize| -> (Vec<u32>, usize) {
        let mut seq = b.new_sequence(prompt.len() + steps + 1).unwrap();
        let mut toks = Vec::new();
        let k = b
            .decode_after(&mut seq, &prompt, steps, snap, &mut |t| {
                toks.push(t);
                toks.len() < stop_at
            })
            .unwrap();
        assert_eq!(k, toks.len());
        (toks, seq.len())
    };
    let greedy = run(&mut b, None, 24, usize::MAX);
    assert_eq!(greedy.1, prompt.len() + 23);
    let top1 = snap(SamplingParams { temperature: 0.8, top_k: 1, ..Default::default() }, 5);
    assert_eq!(run(&mut b, Some(&top1), 24, usize::MAX), greedy);
    for params in [
        SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, repetition_penalty: 1.05, ..Default::default() },
        SamplingParams { temperature: 1.0, ..Default::default() },
    ] {
        let s = snap(params, 9);
        let a = run(&mut b, Some(&s), 24, usize::MAX);
        assert_eq!(a, run(&mut b, Some(&s), 24, usize::MAX), "same snapshot, same tokens");
        assert!(a.0.iter().all(|&t| (t as usize) < vocab));
        let (first, _) = run(&mut b, Some(&s), 24, 1);
        assert_eq!(first, a.0[..1]);
    }
}
