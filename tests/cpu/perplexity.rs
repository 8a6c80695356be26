//! `lily perplexity` and engine::perplexity on the tiny checkpoint (CPU): the PPL is exp of the
//! mean negative log-likelihood of the scored positions, recomputed here from the backend's
//! logits; a saved run compared with itself has zero KL and full top-1 agreement; bad inputs are
//! one-line errors.

use crate::common::tiny_checkpoint;
use crate::fixture::lily;
use lily::backend::{open_backend, BackendKind, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::perplexity::{evaluate, first_scored, PplConfig};

#[test]
fn ppl_is_the_mean_nll_of_the_second_half_of_each_chunk() {
    let ck = Checkpoint::open(tiny_checkpoint()).unwrap();
    let mut b = open_backend(BackendKind::Cpu, &ck).unwrap();
    let vocab = b.config().vocab_size;
    let toks = lily::engine::contract::contract_prompt(100, vocab);
    let cfg = PplConfig { ctx: 32, max_chunks: 0 };
    let mut seen = Vec::new();
    let (ppl, scored) = evaluate(b.as_mut(), &toks, cfg, None, |i, p| seen.push((i, p.ppl))).unwrap();
    // 3 whole chunks of 32, positions 16..30 of each predict tokens 17..31.
    assert_eq!((seen.len(), scored.len(), ppl.tokens_scored), (3, 45, 45));
    let mut nll = Vec::new();
    for c in 0..3 {
        let chunk = &toks[c * 32..(c + 1) * 32];
        let mut seq = b.new_sequence(32).unwrap();
        let logits = b.forward(&mut seq, chunk, LogitsWanted::All).unwrap();
        for t in first_scored(32)..31 {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let lp = lily::engine::sampling::log_softmax(row);
            nll.push(-(lp[chunk[t + 1] as usize] as f64));
        }
    }
    let want = (nll.iter().sum::<f64>() / nll.len() as f64).exp();
    assert!((ppl.ppl / want - 1.0).abs() < 1e-5, "PPL {} against {want}", ppl.ppl);
    assert_eq!(seen.last().unwrap().1, ppl.ppl);
    assert!(ppl.ppl_stderr > 0.0 && ppl.ppl_stderr < ppl.ppl);
}

#[test]
fn saved_runs_compare_and_bad_inputs_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "The quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let (model, file, saved) = (tiny_checkpoint().to_str().unwrap(), text.to_str().unwrap(), dir.path().join("a.logp"));
    let base = ["perplexity", "--model", model, "--file", file, "--ctx", "48", "--chunks", "2", "--backend", "cpu"];
    let (ok, out, err) = lily(&[&base[..], &["--save-logits", saved.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    let first: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(first["tokens_scored"], 2 * 23);
    assert!(first["ppl"].as_f64().unwrap() > 1.0);
    let (ok, out, err) = lily(&[&base[..], &["--kl-against", saved.to_str().unwrap()]].concat());
    assert!(ok, "{err}");
    let again: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(again["ppl"], first["ppl"], "deterministic");
    assert_eq!(again["against"]["mean_kl"], 0.0);
    assert_eq!(again["against"]["top1_agreement"], 1.0);
    // Another --ctx scores other positions: refused, not compared.
    let other = ["perplexity", "--model", model, "--file", file, "--ctx", "40", "--chunks", "2", "--backend", "cpu"];
    let (ok, _, err) = lily(&[&other[..], &["--kl-against", saved.to_str().unwrap()]].concat());
    assert!(!ok && err.contains("differ in shape"), "{err}");
    // Too short for one chunk; not a log-probability file.
    let (ok, _, err) = lily(&["perplexity", "--model", model, "--file", file, "--ctx", "100000", "--backend", "cpu"]);
    assert!(!ok && err.contains("at least one chunk"), "{err}");
    let (ok, _, err) = lily(&[&base[..], &["--kl-against", file]].concat());
    assert!(!ok && err.contains("not a lily log-probability file"), "{err}");
}
