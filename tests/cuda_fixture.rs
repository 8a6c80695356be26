//! The CUDA paths on the trained fixture (tests/fixtures/qwen-fixture) against the CPU
//! reference, on held-out text: the accuracy bounds of docs/correctness.md ("Trained fixture").
//! On the H200 (2026-12-01, 8 chunks of 512) the default path scored KL 2.6e-4 against the
//! transformers f32 reference, top-1 99.56%, PPL -0.008%; the decode kernels token by token
//! (bf16 KV) 8.9e-5, 99.95%, -0.016%; the f32 paths 3-4e-7, 100%, and Lily's CPU equals that
//! reference to 3e-7. The bounds here leave a few times that room; a bug (a wrong rounding
//! point, a misrouted expert, a stale KV row) moves KL by orders of magnitude on peaked,
//! trained distributions. Needs a GPU: run with `bash .device/run test -E 'binary(cuda_fixture)'`.

mod fixture;

use fixture::{fixture_dir, mlx_checkpoint};
use lily::backend::cpu::CpuBackend;
use lily::backend::cuda::{CudaBackend, CudaOptions};
use lily::backend::Backend;
use lily::checkpoint::Checkpoint;
use lily::engine::perplexity::{divergence, evaluate, Divergence, LogProbFile, LogProbWriter, Ppl, PplConfig};
use lily::tokenizer::Tokenizer;
use std::path::Path;

/// The first two chunks of 512 held-out tokens (510 scored positions).
const CFG: PplConfig = PplConfig { ctx: 512, max_chunks: 2 };

fn score(backend: &mut dyn Backend, tokens: &[u32], save: &Path) -> Ppl {
    let mut w = LogProbWriter::create(save, backend.config().vocab_size).unwrap();
    let (ppl, _) = evaluate(backend, tokens, CFG, Some(&mut w), |_, _| {}).unwrap();
    w.finish().unwrap();
    ppl
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_paths_track_the_cpu_on_the_trained_fixture() {
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("mlx");
    mlx_checkpoint(&model);
    let ck = Checkpoint::open(&model).unwrap();
    let text = std::fs::read_to_string(fixture_dir().join("heldout.txt")).unwrap();
    let tokens = Tokenizer::load(&model).unwrap().encode(&text).unwrap();
    let cpu_file = work.path().join("cpu.logp");
    let cpu = score(&mut CpuBackend::new(&ck).unwrap(), &tokens, &cpu_file);
    let reference = LogProbFile::read(&cpu_file).unwrap();
    // (label, options, max mean KL, min top-1 agreement)
    let default = CudaOptions::default();
    let paths = [
        ("default (bf16 prefill, bf16 KV, f16 GDN states)", default.clone(), 1e-3, 0.99),
        // Every position's step reads and rounds the f16 GDN states (the CPU study of
        // docs/correctness.md: mean KL 1.3e-5 from the states alone); beside it the same path
        // with f32 states, so the two rows show what the rounding costs on the GPU.
        ("decode kernels token by token (bf16 KV, f16 GDN states)", CudaOptions { decode_forward: true, ..default.clone() }, 5e-4, 0.99),
        ("decode kernels token by token (bf16 KV, f32 GDN states)", CudaOptions { decode_forward: true, gdn_state_f16: false, ..default.clone() }, 5e-4, 0.99),
        // These 512-token chunks through the long chunks' route (wgmma experts with bf16 down
        // and shared-expert outputs, the combine fused into the next norm) instead of moe_tcb.
        ("long chunks' expert route (bf16 prefill, bf16 KV, f16 GDN states)", CudaOptions { tcb_prefill_tokens: 0, ..default.clone() }, 1e-3, 0.99),
        ("exact (f32 prefill, f32 KV, f32 GDN states)", CudaOptions { exact_prefill: true, kv_bf16: false, gdn_state_f16: false, ..default.clone() }, 1e-5, 1.0),
    ];
    for (label, opts, max_kl, min_top1) in paths {
        let file = work.path().join("cuda.logp");
        let ppl = score(&mut CudaBackend::with_options(&ck, opts).unwrap(), &tokens, &file);
        let d: Divergence = divergence(&reference, &LogProbFile::read(&file).unwrap()).unwrap();
        let dppl = ppl.ppl / cpu.ppl - 1.0;
        eprintln!(
            "{label}: PPL {:.4} (CPU {:.4}, {dppl:+.2e}); KL mean {:.3e}, p99 {:.3e}, max {:.3e}; top-1 {:.2}% of {}",
            ppl.ppl, cpu.ppl, d.mean_kl, d.p99_kl, d.max_kl, 100.0 * d.top1_agreement, d.positions
        );
        assert!(dppl.abs() < 1e-3, "{label}: PPL {} against the CPU's {}", ppl.ppl, cpu.ppl);
        assert!(d.mean_kl < max_kl, "{label}: mean KL {}", d.mean_kl);
        assert!(d.top1_agreement >= min_top1, "{label}: top-1 agreement {}", d.top1_agreement);
    }
}
