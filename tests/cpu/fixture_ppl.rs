//! Perplexity regression on the trained fixture (tests/fixtures/qwen-fixture): Lily's CPU backend
//! on the committed 4-bit checkpoint scores the first chunks of the held-out text at the PPL
//! recorded in fixture.json (1e-4 relative: a change in any kernel, the tokenizer or the
//! scoring shows here), which is also the PPL of the transformers float32 reference on the same
//! chunks (scripts/fixture_reference.py) within 0.1% (the target for every Lily path),
//! and far below the unigram model's.

use crate::fixture::{fixture_dir, lily, mlx_checkpoint};

#[test]
fn cpu_perplexity_of_the_fixture_is_the_recorded_one() {
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("fixture.json")).unwrap()).unwrap();
    let reg = &meta["regression"];
    let (ctx, chunks) = (reg["ctx"].as_u64().unwrap().to_string(), reg["chunks"].as_u64().unwrap().to_string());
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("mlx");
    mlx_checkpoint(&model);
    let text = fixture_dir().join("heldout.txt");
    let args = ["perplexity", "--model", model.to_str().unwrap(), "--file", text.to_str().unwrap(), "--ctx", &ctx, "--chunks", &chunks, "--backend", "cpu"];
    let (ok, out, err) = lily(&args);
    assert!(ok, "{err}");
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let ppl = got["ppl"].as_f64().unwrap();
    assert_eq!(got["tokens_scored"].as_u64(), reg["tokens_scored"].as_u64());

    let recorded = reg["lily_cpu_ppl"].as_f64().unwrap();
    assert!((ppl / recorded - 1.0).abs() < 1e-4, "PPL {ppl}, recorded {recorded}");
    let reference = reg["reference_ppl"].as_f64().unwrap();
    assert!((ppl / reference - 1.0).abs() < 1e-3, "PPL {ppl}, transformers f32 reference {reference}");
    let unigram = reg["unigram_ppl"].as_f64().unwrap();
    assert!(ppl < unigram / 4.0, "PPL {ppl} is not far below the unigram model's {unigram}");
}
