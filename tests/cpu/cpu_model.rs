//! The CPU backend against the transformers reference (goldens generated once by
//! scripts/transformers_goldens.py on the tiny synthetic checkpoint, seed 0) and against itself
//! (prefill vs decode, chunk boundaries).

use crate::common::{max_abs_diff, rel_rms, tiny_checkpoint};
use lily::backend::cpu::CpuBackend;
use lily::backend::{Backend, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::sampling::argmax;
use serde_json::Value;

/// Largest |logit error| accepted against transformers. Both sides compute in f32 from the same
/// dequantized weights, so the differences come only from summation order (our grouped 4-bit
/// dot products vs dense GEMMs), the GDN chunked form vs HF's triangular solve, and f64 vs f32
/// RoPE angles. Logits here have magnitude ~1-5; we observe a max error of 4.6e-6
/// (teacher-forced, 64 positions x (top-20 + 256 probe ids)) and 6.2e-6 along the greedy path.
/// 1e-4 leaves ~20x margin for other CPUs' summation orders while still catching any real bug
/// (a wrong rounding point, norm offset, RoPE pairing or routing choice moves logits by 1e-2+).
const LOGIT_TOL: f32 = 1e-4;

fn backend() -> CpuBackend {
    CpuBackend::new(&Checkpoint::open(tiny_checkpoint()).unwrap()).unwrap()
}

fn golden() -> Value {
    serde_json::from_str(include_str!("../goldens/tiny_transformers.json")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn teacher_forced_logits_match_transformers() {
    check_teacher_forced(&golden(), "transformers");
}

/// mlx-lm loaded the synthetic checkpoint unchanged (which proves the layout is the real
/// mlx-community one) and ran it with every parameter cast to float32
/// (scripts/mlx_logits.py --float32, mlx 0.32.4 CPU): a second, independent reference.
#[test]
fn teacher_forced_logits_match_mlx_lm() {
    check_teacher_forced(&serde_json::from_str(include_str!("../goldens/tiny_mlx_lm_f32.json")).unwrap(), "mlx-lm");
}

fn check_teacher_forced(g: &Value, name: &str) {
    let prompt = ids(&g["prompt_ids"]);
    let probes = ids(&g["probe_ids"]);
    let mut b = backend();
    let vocab = b.config().vocab_size;
    let mut seq = b.new_sequence(prompt.len() + 1).unwrap();
    let logits = b.forward(&mut seq, &prompt, LogitsWanted::All).unwrap();
    assert_eq!(logits.len(), prompt.len() * vocab);
    let mut worst = 0.0f32;
    let mut top1_agree = 0;
    for (t, pos) in g["positions"].as_array().unwrap().iter().enumerate() {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let top_ids = ids(&pos["top_ids"]);
        let top_logits = floats(&pos["top_logits"]);
        if argmax(row) == top_ids[0] {
            top1_agree += 1;
        }
        for (&id, &want) in top_ids.iter().zip(&top_logits) {
            worst = worst.max((row[id as usize] - want).abs());
        }
        for (&id, &want) in probes.iter().zip(&floats(&pos["probe_logits"])) {
            worst = worst.max((row[id as usize] - want).abs());
        }
    }
    eprintln!("teacher-forced vs {name}: top-1 agreement {top1_agree}/{}, max |logit error| {worst:.3e}", prompt.len());
    assert_eq!(top1_agree, prompt.len(), "top-1 must agree at every position");
    assert!(worst <= LOGIT_TOL, "max |logit error| {worst} > {LOGIT_TOL}");
}

#[test]
fn greedy_continuation_matches_transformers() {
    let g = golden();
    let prompt = ids(&g["prompt_ids"]);
    let want = ids(&g["greedy_ids"]);
    let mut b = backend();
    let mut seq = b.new_sequence(prompt.len() + want.len() + 1).unwrap();
    let mut logits = b.forward(&mut seq, &prompt, LogitsWanted::Last).unwrap();
    let mut got = Vec::new();
    let mut worst = 0.0f32;
    for step in g["greedy_steps"].as_array().unwrap() {
        for (&id, &v) in ids(&step["top_ids"]).iter().zip(&floats(&step["top_logits"])) {
            worst = worst.max((logits[id as usize] - v).abs());
        }
        let t = argmax(&logits);
        got.push(t);
        logits = b.forward(&mut seq, &[t], LogitsWanted::Last).unwrap();
    }
    eprintln!("greedy: {} tokens, max |logit error| along the path {worst:.3e}", got.len());
    assert_eq!(got, want);
    assert!(worst <= LOGIT_TOL, "{worst}");
}

/// The goldens' prompt: the contract formula below the special-token range.
fn prompt(n: usize) -> Vec<u32> {
    lily::engine::contract::contract_prompt(n, 248_044)
}

#[test]
fn prefill_then_decode_equals_token_by_token() {
    let p = prompt(80);
    let mut b = backend();
    let mut a = b.new_sequence(100).unwrap();
    let all = b.forward(&mut a, &p, LogitsWanted::All).unwrap();
    let vocab = b.config().vocab_size;
    let mut s = b.new_sequence(100).unwrap();
    let mut worst = 0.0f32;
    for (t, &tok) in p.iter().enumerate() {
        let row = b.forward(&mut s, &[tok], LogitsWanted::Last).unwrap();
        worst = worst.max(max_abs_diff(&row, &all[t * vocab..(t + 1) * vocab]));
        assert_eq!(argmax(&row), argmax(&all[t * vocab..(t + 1) * vocab]), "position {t}");
    }
    // Continue both with the same token: the states must agree too.
    let next_a = b.forward(&mut a, &[7], LogitsWanted::Last).unwrap();
    let next_s = b.forward(&mut s, &[7], LogitsWanted::Last).unwrap();
    worst = worst.max(max_abs_diff(&next_a, &next_s));
    eprintln!("chunked prefill vs recurrent decode: max |logit diff| {worst:.3e}");
    assert!(worst < 1e-3, "{worst}");
}

#[test]
fn chunk_boundaries_do_not_change_results() {
    let p = prompt(150);
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    let mut whole = CpuBackend::new(&ck).unwrap();
    let vocab = whole.config().vocab_size;
    let mut s = whole.new_sequence(200).unwrap();
    let reference = whole.forward(&mut s, &p, LogitsWanted::All).unwrap();
    // Block sizes that cut the GDN 64-chunks at odd places, and caller-side splits.
    for block in [1usize, 7, 63, 64, 65] {
        let mut b = CpuBackend::new(&ck).unwrap().with_prefill_block(block);
        let mut s = b.new_sequence(200).unwrap();
        let got = b.forward(&mut s, &p, LogitsWanted::All).unwrap();
        let d = max_abs_diff(&got, &reference);
        assert!(d < 1e-3, "block {block}: {d}");
    }
    let mut b = CpuBackend::new(&ck).unwrap();
    let mut s = b.new_sequence(200).unwrap();
    let mut got = Vec::new();
    for range in [0..1, 1..64, 64..65, 65..129, 129..150] {
        got.extend(b.forward(&mut s, &p[range], LogitsWanted::All).unwrap());
    }
    assert_eq!(got.len(), 150 * vocab);
    let d = max_abs_diff(&got, &reference);
    eprintln!("split prefill vs whole: max |logit diff| {d:.3e}");
    assert!(d < 1e-3, "{d}");
}

#[test]
fn sequence_clone_is_a_snapshot() {
    let p = prompt(40);
    let mut b = backend();
    let mut s = b.new_sequence(64).unwrap();
    b.forward(&mut s, &p[..30], LogitsWanted::None).unwrap();
    let mut snap = s.try_clone().unwrap();
    let a = b.forward(&mut s, &p[30..], LogitsWanted::Last).unwrap();
    let c = b.forward(&mut snap, &p[30..], LogitsWanted::Last).unwrap();
    assert_eq!(a, c);
    assert_eq!(s.len(), 40);
}

#[test]
fn long_prompt_stays_finite_and_rejects_overflow() {
    let p = prompt(1500);
    let mut b = backend();
    let mut s = b.new_sequence(1501).unwrap();
    let logits = b.forward(&mut s, &p, LogitsWanted::Last).unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let spread = logits.iter().cloned().fold(f32::MIN, f32::max) - logits.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 1.0 && spread < 100.0, "logit spread {spread}");
    b.forward(&mut s, &[1], LogitsWanted::Last).unwrap();
    let err = b.forward(&mut s, &[1], LogitsWanted::Last).unwrap_err().to_string();
    assert!(err.contains("max-seq"), "{err}");
    let err = b.forward(&mut b.new_sequence(4).unwrap(), &[248_320], LogitsWanted::Last).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
}

/// The bf16 KV cache setting (the reference for the CUDA backend's bf16 KV): K and V are rounded
/// when appended, so the logits move by bf16 rounding of the cached keys/values (relative RMS
/// 2e-4 on the tiny model), not more, and the sequences created before the switch keep f32.
#[test]
fn bf16_kv_cache_rounds_keys_and_values_only() {
    let p = prompt(96);
    let mut b = backend();
    let vocab = b.config().vocab_size;
    let mut f32_seq = b.new_sequence(128).unwrap();
    b.set_kv_bf16(true);
    let mut bf16_seq = b.new_sequence(128).unwrap();
    let want = b.forward(&mut f32_seq, &p, LogitsWanted::All).unwrap();
    let got = b.forward(&mut bf16_seq, &p, LogitsWanted::All).unwrap();
    let rel = rel_rms(&got, &want);
    let agree = (0..p.len())
        .filter(|&t| argmax(&got[t * vocab..(t + 1) * vocab]) == argmax(&want[t * vocab..(t + 1) * vocab]))
        .count();
    eprintln!("bf16 KV vs f32 KV, {} positions: logits relative RMS {rel:.2e}, top-1 {agree}/{}", p.len(), p.len());
    // The first position attends only to itself (softmax weight 1): its output is the rounded v.
    assert!(got != want, "the bf16 KV setting changed nothing");
    assert!(rel < 5e-3, "bf16 KV moved the logits by {rel:.2e} (relative RMS)");
    assert!(agree * 10 >= p.len() * 9, "top-1 agreement {agree}/{}", p.len());
    // Decode after the prompt keeps working on both, and a sequence made after switching back is f32 again.
    b.set_kv_bf16(false);
    let mut again = b.new_sequence(128).unwrap();
    assert_eq!(b.forward(&mut again, &p, LogitsWanted::All).unwrap(), want);
    assert!(b.forward(&mut bf16_seq, &[7], LogitsWanted::Last).unwrap().iter().all(|x| x.is_finite()));
}

/// The CUDA prefill's few-row products run on the tensor cores only where every norm feeding them
/// keeps its outputs within f16's range (`weights::norm_outputs_fit_f16`): true for the tiny
/// checkpoint's gains, false once one gain times sqrt(hidden) passes the bound.
#[test]
fn few_row_inputs_fit_f16_by_the_norm_gains() {
    use lily::backend::cuda::weights::{norm_outputs_fit_f16, FEW_INPUT_MAX};
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    let mut mw = lily::model::ModelWeights::from_checkpoint(&ck).unwrap();
    assert!(norm_outputs_fit_f16(&mw));
    let root = (mw.config.hidden_size as f32).sqrt();
    let last = mw.layers.len() - 1;
    mw.layers[last].post_norm[3] = -FEW_INPUT_MAX / root * 0.99;
    assert!(norm_outputs_fit_f16(&mw));
    mw.layers[last].post_norm[3] = -FEW_INPUT_MAX / root * 1.01;
    assert!(!norm_outputs_fit_f16(&mw));
}
