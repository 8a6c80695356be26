//! Shared fixture: the tiny synthetic checkpoint (seed 0), written once per test binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[path = "../scratch/mod.rs"]
pub mod scratch;

/// Seed the committed goldens were generated from.
pub const GOLDEN_SEED: u64 = 0;

pub fn tiny_checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch::scratch_dir().join("tiny");
        lily::synth::synthesize(
            &lily::synth::Preset::Tiny.config(),
            &dir,
            GOLDEN_SEED,
            false,
        )
        .expect("synthesize tiny checkpoint");
        dir
    })
}

/// Copies the tiny checkpoint into a fresh directory the test may damage.
pub fn tiny_copy() -> PathBuf {
    let src = tiny_checkpoint();
    let dst = scratch::scratch_subdir("damaged-");
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// RMS of (got - want) over RMS of want.
pub fn rel_rms(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt() as f32
}

/// The quantized matrices of layer 0 the kernel tests multiply against the CPU's qmatmul: the
/// 8-bit router and shared-expert gate, the expert gate and down stacks, and (on a Gated DeltaNet
/// layer) the in- and out-projections.
pub fn layer0_matrices(mw: &lily::model::ModelWeights) -> Vec<(&'static str, &lily::checkpoint::store::QuantTensor)> {
    let l0 = &mw.layers[0];
    let mut cases = vec![
        ("router (8-bit)", &l0.moe.router),
        ("shared_expert_gate (8-bit)", &l0.moe.shared_expert_gate),
        ("gate_exps", &l0.moe.gate_exps),
        ("down_exps", &l0.moe.down_exps),
    ];
    if let lily::model::MixerWeights::Gdn(g) = &l0.mixer {
        cases.push(("in_proj_qkv", &g.in_qkv));
        cases.push(("out_proj", &g.out));
    }
    cases
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift; kernel tests' inputs).
pub fn rnd(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A random MLX-quantized matrix [rows, cols] (values in [-1, 1), bf16 scales/biases), for
/// kernel tests at shapes the tiny checkpoint does not have (the 35B's widths).
pub fn random_quant(rows: usize, cols: usize, bits: usize, seed: u64) -> lily::checkpoint::store::QuantTensor {
    use lily::checkpoint::store::{QuantTensor, TensorBytes};
    let group = 64;
    let (mut words, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rows {
        let w = rnd(seed.wrapping_mul(1_000_003).wrapping_add(r as u64), cols);
        let (codes, s, b) = lily::quant::quantize_row(&w, bits, group);
        lily::quant::pack_codes(&codes, bits, &mut words);
        scales.extend(s.iter().map(|v| v.to_bits()));
        biases.extend(b.iter().map(|v| v.to_bits()));
    }
    let owned = |bytes: &[u8]| {
        let mut w = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..bytes.len()].copy_from_slice(bytes);
        TensorBytes::Owned { words: std::sync::Arc::new(w), len: bytes.len() }
    };
    QuantTensor {
        name: format!("random_{rows}x{cols}_{bits}bit"),
        rows,
        cols,
        bits,
        group,
        weight: owned(bytemuck::cast_slice(&words)),
        scales: owned(bytemuck::cast_slice(&scales)),
        biases: owned(bytemuck::cast_slice(&biases)),
        scale_dtype: lily::checkpoint::layout::DType::BF16,
    }
}

/// Token masks in a batched decode (`StepHooks::mask`), the same check on every backend. Four
/// rows, prompts of `lens` tokens (`batch_prompt`; all but the last prefilled into sequences of
/// `max_seq`, the last fed by the first step): greedy, greedy, seeded sampled, seeded sampled. Decoded once without masks, then with row 0 forced onto a token per step
/// (an allowed set of one), row 2 held to three tokens per step, row 3's hook saying
/// "unconstrained" and row 1 left alone: row 0 gets exactly the forced tokens, row 2 only
/// allowed ones, and rows 1 and 3 what they got without masks (a mask touches its own row only).
/// Then two greedy rows, row 0 masked at one step only (the step leaves the argmax kernel for
/// the sampler and comes back): row 1 unchanged, row 0 forced at that step.
pub fn check_token_masks(b: &mut dyn lily::backend::Backend, lens: [usize; 4], max_seq: usize) {
    use lily::backend::{BatchRow, LogitsWanted, StepHooks};
    let fresh = |b: &mut dyn lily::backend::Backend| -> Vec<(lily::backend::Sequence, u32)> {
        lens.iter()
            .enumerate()
            .map(|(i, &l)| {
                let p = lily::engine::contract::batch_prompt(i, l, b.config().vocab_size);
                let mut seq = b.new_sequence(max_seq).unwrap();
                b.forward(&mut seq, &p[..l - 1], LogitsWanted::None).unwrap();
                (seq, p[l - 1])
            })
            .collect()
    };
    use lily::engine::sampling::{SamplerSnapshot, SamplingParams};
    const STEPS: usize = 6;
    let vocab = b.config().vocab_size as u32;
    let greedy = SamplerSnapshot { params: SamplingParams::greedy(), seed: 0, counts: vec![] };
    let sampled = |seed| SamplerSnapshot { params: SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, ..Default::default() }, seed, counts: vec![] };
    let snaps = [greedy.clone(), greedy.clone(), sampled(11), sampled(12)];
    // Tokens of a step's allowed sets, spread over the vocabulary.
    let forced = |step: usize| (7919 * (step as u32 + 1) + 13) % vocab;
    let set = |step: usize| [(104_729 * (step as u32 + 3)) % vocab, (15_485_863 * (step as u32 + 5)) % vocab, (step as u32 * 31 + 2) % vocab];

    struct Hooks<'a> {
        out: Vec<Vec<u32>>,
        rule: &'a dyn Fn(usize, usize) -> Option<Vec<u32>>,
    }
    impl StepHooks for Hooks<'_> {
        fn token(&mut self, row: usize, token: u32) -> bool {
            self.out[row].push(token);
            true
        }
        fn mask(&mut self, row: usize, allowed: &mut [u32]) -> anyhow::Result<bool> {
            let Some(tokens) = (self.rule)(row, self.out[row].len()) else { return Ok(false) };
            allowed.iter_mut().for_each(|w| *w = 0);
            for t in tokens {
                allowed[t as usize / 32] |= 1 << (t % 32);
            }
            Ok(true)
        }
    }
    let run = |b: &mut dyn lily::backend::Backend, snaps: &[SamplerSnapshot], rule: &dyn Fn(usize, usize) -> Option<Vec<u32>>| {
        let mut seqs = fresh(b);
        seqs.truncate(snaps.len());
        let mut rows: Vec<BatchRow> = seqs.iter_mut().zip(snaps).map(|((seq, t), s)| BatchRow { seq, first_token: *t, max_tokens: STEPS, sampler: s.clone() }).collect();
        let mut hooks = Hooks { out: vec![Vec::new(); snaps.len()], rule };
        b.decode_batch(&mut rows, &mut hooks).unwrap();
        hooks.out
    };
    let free = run(b, &snaps, &|_, _| None);
    let masked = run(b, &snaps, &|row, step| match row {
        0 => Some(vec![forced(step)]),
        2 => Some(set(step).to_vec()),
        _ => None,
    });
    assert_eq!(masked[0], (0..STEPS).map(forced).collect::<Vec<_>>(), "row 0: the forced tokens");
    for (s, t) in masked[2].iter().enumerate() {
        assert!(set(s).contains(t), "row 2, step {s}: token {t} outside {:?}", set(s));
    }
    assert_eq!(masked[1], free[1], "row 1 (no mask) beside masked rows");
    assert_eq!(masked[3], free[3], "row 3 (hook: unconstrained) beside masked rows");
    assert_ne!(free[0], masked[0], "the forced tokens are not what row 0 picks by itself");

    let two = [greedy.clone(), greedy];
    let free = run(b, &two, &|_, _| None);
    let once = run(b, &two, &|row, step| (row == 0 && step == 2).then(|| vec![forced(2)]));
    assert_eq!(once[1], free[1], "greedy row 1 when row 0 is masked at one step");
    assert_eq!(once[0][..2], free[0][..2], "row 0 before its masked step");
    assert_eq!(once[0][2], forced(2), "row 0 at its masked step");
}
