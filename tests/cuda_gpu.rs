//! The CUDA backend against the CPU reference backend on the tiny synthetic checkpoint (seed 0).
//! These need an H100/H200 and run on the GPU machine (`bash .device/run test cuda_`); they are
//! ignored elsewhere.
//!
//! Tolerances: both backends compute in f32 from the same 4-bit weights (bf16 scales/biases,
//! bias folded per group) and keep the GDN state and the KV cache in f32, so they differ only in
//! summation order (warp-tree vs sequential sums, FMA contraction, split-KV softmax merge). Tiny
//! model logits are O(1-5); 1e-3 absolute leaves a wide margin over that rounding while any real
//! bug (wrong rounding point, norm offset, RoPE pairing, routing choice) moves logits by 1e-2+.

mod common;

use common::{layer0_matrices, max_abs_diff, random_quant, rel_rms, rnd, tiny_checkpoint};
use lily::backend::cpu::{attention, gdn, moe, ops, qmatmul, CpuBackend};
use lily::backend::cuda::{testing, CudaBackend, CudaOptions};
use lily::backend::{Backend, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::sampling::argmax;
use lily::model::{MixerWeights, ModelWeights};

const LOGIT_TOL: f32 = 1e-3;

fn ck() -> Checkpoint {
    Checkpoint::open(tiny_checkpoint()).unwrap()
}

/// These tests hold the decode kernels and the whole model to the CPU at rounding level
/// (LOGIT_TOL), so their multi-token forwards use the f32 prefill; the bf16 tensor-core prefill
/// (the default) is measured against the CPU with its own tolerances in tests/cuda_prefill.rs.
fn cuda() -> CudaBackend {
    cuda_with(exact_options())
}

/// Exact f32 prefill, f32 KV like the CPU reference (the default bf16 cache has its own test
/// below), and every 4-bit GEMV set on the tensor-core kernel (the tiny model's sets are all
/// small).
fn exact_options() -> CudaOptions {
    CudaOptions { exact_prefill: true, kv_bf16: false, gdn_state_f16: false, gemv_tc_min_tiles: 0, ..CudaOptions::default() }
}

fn cuda_with(opts: CudaOptions) -> CudaBackend {
    CudaBackend::with_options(&ck(), opts).expect("CUDA backend (needs an sm_90 GPU)")
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    lily::engine::contract::contract_prompt(n, vocab)
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_gemv_matches_cpu_qmatmul() {
    let ck = ck();
    let mw = ModelWeights::from_checkpoint(&ck).unwrap();
    let b = cuda();
    let mut cases = layer0_matrices(&mw);
    cases.push(("lm_head", &mw.lm_head));
    for (name, q) in cases {
        let x = rnd(7, q.cols);
        let want = qmatmul::qmatmul_all(q, &x, 1);
        let got = testing::gemv(&b, q, &x, None).unwrap();
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        let e = max_abs_diff(&got, &want);
        eprintln!(
            "gemv {name} [{}x{}, {}-bit]: max |err| {e:.3e} (max |y| {scale:.3})",
            q.rows, q.cols, q.bits
        );
        assert!(
            e <= 1e-5 * scale.max(1.0) * (q.cols as f32 / 64.0).sqrt(),
            "{name}: max err {e}"
        );
        // With the RMSNorm prologue.
        if q.cols == mw.config.hidden_size {
            let gain = &mw.layers[0].input_norm;
            let mut u = vec![0.0; q.cols];
            ops::rms_norm(&x, gain, mw.config.rms_norm_eps as f32, &mut u);
            let want = qmatmul::qmatmul_all(q, &u, 1);
            let got = testing::gemv(&b, q, &x, Some(gain)).unwrap();
            let e = max_abs_diff(&got, &want);
            eprintln!("gemv+norm {name}: max |err| {e:.3e}");
            assert!(e <= 1e-4 * scale.max(1.0), "{name} with norm: max err {e}");
        }
    }
}

/// The decode GEMV at the 35B's widths, which the tiny checkpoint does not reach: the
/// tensor-core kernel's aligned scale loads (512-column chunks), its 1/4/8-slice splits and
/// partial tiles (row counts not multiples of 16), and the 8-bit fallback.
#[test]
#[ignore = "needs a GPU"]
fn cuda_gemv_35b_widths_match_cpu_qmatmul() {
    let mut b = cuda();
    // (rows, cols, bits): few tiles -> 8 or 4 slices; 60,000 rows -> one slice of 4 chunks.
    for (rows, cols, bits, seed) in [
        (2048usize, 4096usize, 4usize, 1u64),
        (300, 2048, 4, 2),
        (8200, 2048, 4, 3),
        (60_000, 2048, 4, 4),
        (257, 2048, 8, 5),
    ] {
        let q = random_quant(rows, cols, bits, seed);
        let x = rnd(100 + seed, cols);
        let want = qmatmul::qmatmul_all(&q, &x, 1);
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        // The tensor-core kernel for every size, then the default routing (small sets on gemv_q).
        for min_tiles in [0usize, 256] {
            testing::options_mut(&mut b).gemv_tc_min_tiles = min_tiles;
            let got = testing::gemv(&b, &q, &x, None).unwrap();
            let e = max_abs_diff(&got, &want);
            eprintln!(
                "gemv [{rows}x{cols}, {bits}-bit] (tc min tiles {min_tiles}): max |err| {e:.3e} (max |y| {scale:.3})"
            );
            assert!(
                e <= 1e-5 * scale.max(1.0) * (cols as f32 / 64.0).sqrt(),
                "[{rows}x{cols}]: max err {e}"
            );
        }
    }
    // The router's set with its RMSNorm prologue (the post-attention norm), as decode runs it:
    // small sets split each row over several warps (`gemv_q_split`).
    let q = random_quant(257, 2048, 8, 6);
    let (x, gain) = (rnd(106, 2048), rnd(107, 2048));
    let mut u = vec![0.0; 2048];
    ops::rms_norm(&x, &gain, b.config().rms_norm_eps as f32, &mut u);
    let want = qmatmul::qmatmul_all(&q, &u, 1);
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let got = testing::gemv(&b, &q, &x, Some(&gain)).unwrap();
    let e = max_abs_diff(&got, &want);
    eprintln!("gemv+norm [257x2048, 8-bit]: max |err| {e:.3e} (max |y| {scale:.3})");
    assert!(e <= 1e-4 * scale.max(1.0), "the router set with its norm: max err {e}");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_argmax_matches_host() {
    let b = cuda();
    let mut l = rnd(3, 248_320);
    assert_eq!(testing::argmax(&b, &l).unwrap(), argmax(&l));
    l[1000] = 5.0;
    l[200_000] = 5.0; // tie: lowest id wins
    assert_eq!(testing::argmax(&b, &l).unwrap(), 1000);
}

/// CPU reference of one decode token, layer by layer (the same steps as CpuBackend::run_block).
struct CpuTrace {
    w: ModelWeights,
    inv_freq: Vec<f64>,
    gdn: Vec<Option<gdn::GdnState>>,
    kv: Vec<Option<attention::KvCache>>,
}

impl CpuTrace {
    fn new(ck: &Checkpoint) -> Self {
        let w = ModelWeights::from_checkpoint(ck).unwrap();
        let cfg = w.config.clone();
        let inv_freq = ops::rope_inv_freq(cfg.rotary_dim(), cfg.rope_theta);
        let gdn = w
            .layers
            .iter()
            .map(|l| matches!(l.mixer, MixerWeights::Gdn(_)).then(|| gdn::GdnState::new(&cfg)))
            .collect();
        let kv = w
            .layers
            .iter()
            .map(|l| {
                matches!(l.mixer, MixerWeights::Attention(_)).then(attention::KvCache::default)
            })
            .collect();
        CpuTrace {
            w,
            inv_freq,
            gdn,
            kv,
        }
    }
    fn token(&mut self, tok: u32, pos: usize) -> Vec<Vec<f32>> {
        let cfg = self.w.config.clone();
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps as f32;
        let mut x = vec![0.0; h];
        qmatmul::dequantize_row(&self.w.embed, tok as usize, &mut x);
        let mut u = vec![0.0; h];
        let mut out = Vec::new();
        for (i, layer) in self.w.layers.iter().enumerate() {
            ops::rms_norm(&x, &layer.input_norm, eps, &mut u);
            let mixed = match &layer.mixer {
                MixerWeights::Gdn(g) => gdn::forward(g, &cfg, &u, 1, self.gdn[i].as_mut().unwrap()),
                MixerWeights::Attention(a) => attention::forward(
                    a,
                    &cfg,
                    &self.inv_freq,
                    &u,
                    1,
                    pos,
                    self.kv[i].as_mut().unwrap(),
                ),
            };
            x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
            ops::rms_norm(&x, &layer.post_norm, eps, &mut u);
            let m = moe::forward(&layer.moe, &cfg, &u, 1);
            x.iter_mut().zip(&m).for_each(|(a, b)| *a += b);
            out.push(x.clone());
        }
        out
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_layers_match_cpu_per_token() {
    let ck = ck();
    let mut b = cuda();
    let mut cpu = CpuTrace::new(&ck);
    let vocab = b.config().vocab_size;
    let toks = prompt(80, vocab);
    let mut seq = b.new_sequence(toks.len()).unwrap();
    let mut worst = vec![0.0f32; cpu.w.layers.len()];
    for (pos, &t) in toks.iter().enumerate() {
        let want = cpu.token(t, pos);
        let (got, _) = testing::forward_traced(&mut b, &mut seq, t).unwrap();
        for (l, (g, w)) in got.iter().zip(&want).enumerate() {
            let e = max_abs_diff(g, w);
            worst[l] = worst[l].max(e);
            if e > 1e-3 {
                panic!(
                    "token {pos} layer {l} ({}): max |hidden err| {e:.3e}",
                    if matches!(cpu.w.layers[l].mixer, MixerWeights::Gdn(_)) {
                        "GDN"
                    } else {
                        "attention"
                    }
                );
            }
        }
    }
    let w: Vec<String> = worst.iter().map(|e| format!("{e:.3e}")).collect();
    eprintln!(
        "per-layer max |hidden err| over {} tokens: {}",
        toks.len(),
        w.join(" ")
    );
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_teacher_forced_logits_match_cpu() {
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let mut gpu = cuda();
    let vocab = cpu.config().vocab_size;
    let toks = prompt(96, vocab);
    let mut s1 = cpu.new_sequence(toks.len()).unwrap();
    let want = cpu.forward(&mut s1, &toks, LogitsWanted::All).unwrap();
    let mut s2 = gpu.new_sequence(toks.len()).unwrap();
    let got = gpu.forward(&mut s2, &toks, LogitsWanted::All).unwrap();
    assert_eq!(got.len(), want.len());
    let e = max_abs_diff(&got, &want);
    let mut agree = 0;
    for t in 0..toks.len() {
        if argmax(&got[t * vocab..(t + 1) * vocab]) == argmax(&want[t * vocab..(t + 1) * vocab]) {
            agree += 1;
        }
    }
    eprintln!(
        "teacher-forced {} positions: max |logit err| {e:.3e}, top-1 agreement {agree}/{}",
        toks.len(),
        toks.len()
    );
    assert!(e <= LOGIT_TOL, "max |logit error| {e} > {LOGIT_TOL}");
    assert_eq!(agree, toks.len());
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_decode_graphs_follow_the_addresses_they_bake_in() {
    // A decode graph is keyed by the sequence's addresses and the options the step reads: a new
    // sequence at a finished one's addresses replays its graph (and decodes as it did), one
    // elsewhere or under other options captures its own.
    let mut gpu = cuda();
    let vocab = gpu.config().vocab_size;
    let toks = prompt(40, vocab);
    let decode = |b: &mut CudaBackend| -> (Vec<u32>, Vec<u64>) {
        let mut seq = b.new_sequence(toks.len() + 24).unwrap();
        let mut logits = b.forward(&mut seq, &toks, LogitsWanted::Last).unwrap();
        let mut out = Vec::new();
        for _ in 0..16 {
            let t = argmax(&logits);
            out.push(t);
            logits = b.forward(&mut seq, &[t], LogitsWanted::Last).unwrap();
        }
        (out, testing::binding(&seq))
    };
    let (first, at) = decode(&mut gpu);
    let graphs = testing::decode_graphs(&gpu);
    assert!(graphs >= 1, "the steps ran through a graph");
    let (again, at2) = decode(&mut gpu);
    assert_eq!(again, first, "the same prompt decodes the same tokens");
    let now = testing::decode_graphs(&gpu);
    eprintln!("decode graphs: {graphs} after the first sequence, {now} after the second (same addresses: {})", at2 == at);
    assert_eq!(now, if at2 == at { graphs } else { graphs + 1 }, "a graph per distinct set of addresses");
    // Another GEMV route: the same addresses capture again.
    let min_tiles = testing::options_mut(&mut gpu).gemv_tc_min_tiles;
    testing::options_mut(&mut gpu).gemv_tc_min_tiles = min_tiles + 100_000;
    let (routed, at3) = decode(&mut gpu);
    eprintln!("the CUDA-core GEMVs' tokens: {routed:?} (same addresses again: {})", at3 == at2);
    assert_eq!(testing::decode_graphs(&gpu), now + 1, "one more graph");
    if at3 == at2 {
        // At the same addresses only the options can have made it new; back to them, it replays.
        testing::options_mut(&mut gpu).gemv_tc_min_tiles = min_tiles;
        let (back, at4) = decode(&mut gpu);
        assert_eq!(back, first);
        if at4 == at2 {
            assert_eq!(testing::decode_graphs(&gpu), now + 1, "the first options' graph replays");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_decode_graphs_taken_over_by_new_sequences_decode_as_direct_launches() {
    // With every graph place held by sequences still alive, each new sequence's step takes over
    // the least recently used graph (its executable graph updated to the new addresses): every
    // sequence's tokens, new ones and old ones continued afterwards, are those of direct
    // launches.
    let mut gpu = cuda();
    let mut direct = cuda_with(CudaOptions { graphs: false, ..exact_options() });
    let vocab = gpu.config().vocab_size;
    let n = testing::MAX_DECODE_GRAPHS + 4;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let mut p = prompt(30 + i, vocab);
            p.rotate_left(i);
            p
        })
        .collect();
    let run = |b: &mut CudaBackend| -> Vec<Vec<u32>> {
        let mut seqs = Vec::new();
        let mut out: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut seq = b.new_sequence(p.len() + 20).unwrap();
                let (prefix, last) = p.split_at(p.len() - 1);
                b.forward(&mut seq, prefix, LogitsWanted::None).unwrap();
                let mut got = Vec::new();
                b.decode_greedy(&mut seq, last[0], 12, &mut |t| {
                    got.push(t);
                    true
                })
                .unwrap();
                seqs.push(seq);
                got
            })
            .collect();
        // The first sequences again: their graphs went to later ones.
        for (seq, got) in seqs.iter_mut().zip(out.iter_mut()).take(4) {
            let next = *got.last().unwrap();
            b.decode_greedy(seq, next, 6, &mut |t| {
                got.push(t);
                true
            })
            .unwrap();
        }
        out
    };
    let (with_graphs, launched) = (run(&mut gpu), run(&mut direct));
    let updates = testing::decode_graph_updates(&gpu);
    eprintln!("{n} sequences, {updates} graph updates, {} graphs kept", testing::decode_graphs(&gpu));
    assert_eq!(with_graphs, launched, "graph steps differ from direct launches");
    assert!(updates >= 4, "new sequences took over old graphs ({updates} updates)");
    assert!(testing::decode_graphs(&gpu) <= testing::MAX_DECODE_GRAPHS);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_greedy_matches_cpu_and_clone_continues() {
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let mut gpu = cuda();
    let vocab = cpu.config().vocab_size;
    let toks = prompt(40, vocab);
    let n = 32;
    let run = |b: &mut dyn Backend| -> (Vec<u32>, f32) {
        let mut seq = b.new_sequence(toks.len() + n + 1).unwrap();
        let mut logits = b.forward(&mut seq, &toks, LogitsWanted::Last).unwrap();
        let mut out = Vec::new();
        for _ in 0..n {
            let t = argmax(&logits);
            out.push(t);
            logits = b.forward(&mut seq, &[t], LogitsWanted::Last).unwrap();
        }
        (out, logits[0])
    };
    let (want, _) = run(&mut cpu);
    let (got, _) = run(&mut gpu);
    eprintln!("greedy cpu {want:?}\ngreedy gpu {got:?}");
    assert_eq!(got, want, "32-token greedy continuation differs");

    // A cloned sequence continues exactly like the original.
    let mut seq = gpu.new_sequence(toks.len() + 8).unwrap();
    gpu.forward(&mut seq, &toks, LogitsWanted::None).unwrap();
    let mut fork = seq.try_clone().unwrap();
    let a = gpu
        .forward(&mut seq, &[5, 6, 7], LogitsWanted::All)
        .unwrap();
    let b = gpu
        .forward(&mut fork, &[5, 6, 7], LogitsWanted::All)
        .unwrap();
    assert_eq!(a, b, "clone diverged");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_bad_input_is_an_error() {
    let mut gpu = cuda();
    let vocab = gpu.config().vocab_size as u32;
    assert!(
        gpu.new_sequence(1 << 28).is_err(),
        "a max-seq whose KV offsets overflow the kernels' 32-bit positions must be refused"
    );
    let mut seq = gpu.new_sequence(4).unwrap();
    assert!(gpu.forward(&mut seq, &[vocab], LogitsWanted::Last).is_err());
    assert!(gpu
        .forward(&mut seq, &[1, 2, 3, 4, 5], LogitsWanted::Last)
        .is_err());
    assert!(gpu.forward(&mut seq, &[], LogitsWanted::Last).is_err());
    assert!(gpu.forward(&mut seq, &[1, 2], LogitsWanted::Last).is_ok());
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_long_prompt_matches_cpu() {
    // 300 positions: several KV splits per head in decode attention, and the conv ring wraps many times.
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let mut gpu = cuda();
    let vocab = cpu.config().vocab_size;
    let toks = prompt(300, vocab);
    let mut s1 = cpu.new_sequence(320).unwrap();
    let mut s2 = gpu.new_sequence(320).unwrap();
    let mut want = cpu.forward(&mut s1, &toks, LogitsWanted::Last).unwrap();
    let mut got = gpu.forward(&mut s2, &toks, LogitsWanted::Last).unwrap();
    let mut worst = 0.0f32;
    for _ in 0..16 {
        worst = worst.max(max_abs_diff(&got, &want));
        let (a, b) = (argmax(&want), argmax(&got));
        assert_eq!(a, b, "greedy diverged after a 300-token prompt");
        want = cpu.forward(&mut s1, &[a], LogitsWanted::Last).unwrap();
        got = gpu.forward(&mut s2, &[b], LogitsWanted::Last).unwrap();
    }
    eprintln!("300-token prompt + 16 greedy steps: max |logit err| {worst:.3e}");
    assert!(worst <= LOGIT_TOL);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_decode_greedy_matches_forward_argmax() {
    // The pipelined device-side greedy loop must produce exactly the tokens of forward + host
    // argmax (and of the CPU backend's default decode_greedy), leave the sequence at the same
    // length, and stop early when asked.
    let ck = ck();
    let mut gpu = cuda();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let vocab = gpu.config().vocab_size;
    let toks = prompt(70, vocab); // > 64 positions: two KV splits at this max-seq
    let n = 40;
    let (prefix, last) = toks.split_at(toks.len() - 1);
    let max_seq = toks.len() + n + 1;

    // Reference: forward + host argmax.
    let mut s_ref = gpu.new_sequence(max_seq).unwrap();
    gpu.forward(&mut s_ref, prefix, LogitsWanted::None).unwrap();
    let mut want = Vec::new();
    let mut cur = last[0];
    for _ in 0..n {
        let l = gpu.forward(&mut s_ref, &[cur], LogitsWanted::Last).unwrap();
        cur = argmax(&l);
        want.push(cur);
    }

    let run = |b: &mut dyn Backend| -> (Vec<u32>, usize) {
        let mut seq = b.new_sequence(max_seq).unwrap();
        b.forward(&mut seq, prefix, LogitsWanted::None).unwrap();
        let mut got = Vec::new();
        let k = b
            .decode_greedy(&mut seq, last[0], n, &mut |t| {
                got.push(t);
                true
            })
            .unwrap();
        assert_eq!(k, n);
        (got, seq.len())
    };
    let (got, len) = run(&mut gpu);
    eprintln!("decode_greedy gpu {got:?}");
    assert_eq!(got, want, "decode_greedy differs from forward + argmax");
    assert_eq!(len, toks.len() + n - 1);
    let (got_cpu, len_cpu) = run(&mut cpu);
    assert_eq!(got_cpu, want, "CPU default decode_greedy differs from the CUDA tokens");
    assert_eq!(len_cpu, len);

    // Early stop after 5 tokens, then continue with forward: same tokens as the reference.
    let mut seq = gpu.new_sequence(max_seq).unwrap();
    gpu.forward(&mut seq, prefix, LogitsWanted::None).unwrap();
    let mut got = Vec::new();
    let k = gpu
        .decode_greedy(&mut seq, last[0], n, &mut |t| {
            got.push(t);
            got.len() < 5
        })
        .unwrap();
    assert_eq!(k, 5);
    assert_eq!(got, want[..5]);
    // The pipelined backend may already have fed the 5th token.
    let fed = seq.len() - prefix.len();
    assert!(fed == 5 || fed == 6, "fed {fed}");
    let mut cur = if fed == 5 { got[4] } else { u32::MAX };
    let mut cont = Vec::new();
    if fed == 5 {
        let l = gpu.forward(&mut seq, &[cur], LogitsWanted::Last).unwrap();
        cur = argmax(&l);
        cont.push(cur);
    } else {
        // Continue through decode_greedy's own first step: feed nothing new, read from forward.
        let mut t = Vec::new();
        gpu.decode_greedy(&mut seq, want[5], 1, &mut |x| {
            t.push(x);
            true
        })
        .unwrap();
        // that call fed want[5] (produced by the speculative step) and produced want[6]
        cont.push(want[5]);
        cont.extend(t);
    }
    assert_eq!(cont[..], want[5..5 + cont.len()]);

    // A sink that lets no step be queued ahead from its 4th token on (the server's solo row once
    // a request waits to join) and stops at the 5th: the sequence holds every token but the
    // 5th, and a second call resuming with it continues exactly.
    let mut seq = gpu.new_sequence(max_seq).unwrap();
    gpu.forward(&mut seq, prefix, LogitsWanted::None).unwrap();
    let mut sink = Pausing { got: Vec::new(), stop_at: 5 };
    assert_eq!(gpu.decode_greedy(&mut seq, last[0], n, &mut sink).unwrap(), 5);
    assert_eq!(sink.got, want[..5]);
    assert_eq!(seq.len(), prefix.len() + 5, "the paused sequence holds every token but its last");
    let mut rest = Vec::new();
    gpu.decode_greedy(&mut seq, sink.got[4], n - 5, &mut |x| {
        rest.push(x);
        true
    })
    .unwrap();
    assert_eq!(rest, want[5..]);

    // A second decode_greedy on the same backend and a fresh sequence reuses the captured graph.
    let (again, _) = run(&mut gpu);
    assert_eq!(again, want);
}

/// A token sink that stops at its `stop_at`-th token and lets no step be queued ahead from the
/// token before it on.
struct Pausing {
    got: Vec<u32>,
    stop_at: usize,
}

impl lily::backend::TokenSink for Pausing {
    fn token(&mut self, token: u32) -> bool {
        self.got.push(token);
        self.got.len() < self.stop_at
    }

    fn queue_ahead(&mut self) -> bool {
        self.got.len() + 2 < self.stop_at
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_pdl_and_many_splits_match_cpu() {
    // A large max-seq gives the decode graph the most KV splits per head (128) at a 300-token
    // context (chunks of 3 positions, many splits empty): exercises the parallel split merge
    // (attn_combine) and the split kernel's edge cases. Then the same decode with programmatic
    // dependent launch off must give bit-identical logits (PDL changes scheduling, never the
    // math), and the CUDA-core MoE kernels (the fallback for shapes the tensor-core ones do not
    // take) must match the CPU too.
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let vocab = cpu.config().vocab_size;
    let toks = prompt(300, vocab);
    let steps = 8;
    let mut s1 = cpu.new_sequence(toks.len() + steps).unwrap();
    let mut wants = vec![cpu.forward(&mut s1, &toks, LogitsWanted::Last).unwrap()];
    for _ in 0..steps {
        let t = argmax(wants.last().unwrap());
        wants.push(cpu.forward(&mut s1, &[t], LogitsWanted::Last).unwrap());
    }
    let run = |opts: CudaOptions| -> Vec<Vec<f32>> {
        let mut gpu = cuda_with(opts);
        let mut s2 = gpu.new_sequence(8192).unwrap();
        let mut got = gpu.forward(&mut s2, &toks, LogitsWanted::Last).unwrap();
        let mut all = vec![got.clone()];
        for _ in 0..steps {
            let t = argmax(&got);
            got = gpu.forward(&mut s2, &[t], LogitsWanted::Last).unwrap();
            all.push(got.clone());
        }
        all
    };
    let check = |what: &str, run: &[Vec<f32>]| {
        let mut worst = 0.0f32;
        for (i, (got, want)) in run.iter().zip(&wants).enumerate() {
            worst = worst.max(max_abs_diff(got, want));
            assert_eq!(argmax(got), argmax(want), "{what}: greedy diverged at step {i}");
        }
        eprintln!("max-seq 8192 (max splits), 300-token prompt + {steps} steps, {what}: max |logit err| {worst:.3e}");
        assert!(worst <= LOGIT_TOL, "{what}: {worst}");
    };
    let on = run(exact_options());
    check("PDL", &on);
    let off = run(CudaOptions { pdl: false, ..exact_options() });
    assert!(on == off, "PDL on/off logits differ");
    check("CUDA-core MoE", &run(CudaOptions { force_cuda_core_moe: true, ..exact_options() }));
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_bf16_kv_matches_cpu_bf16_kv() {
    // The bf16 KV cache (LILY_KV_BF16 / set_kv_bf16): the CPU reference rounds K and V to bf16 as
    // it appends them, so both backends compute the same thing and LOGIT_TOL still applies. A
    // 300-token prompt through the exact prefill (pf_attn_prep_bf16, pf_attn_{hd}_bf16), then
    // greedy decode steps through the graph (attn_prep_bf16, the tiled attn_split_{hd}_bf16) at
    // max-seq 8192 (the most KV splits). Then the default tensor-core prefill with a bf16 cache
    // (pf_attn_tc_{hd}_bf16) against the same CPU logits, with the bf16-prefill tolerance of
    // tests/cuda_prefill.rs.
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    cpu.set_kv_bf16(true);
    let mut gpu = cuda();
    gpu.set_kv_bf16(true);
    let vocab = cpu.config().vocab_size;
    let toks = prompt(300, vocab);
    let steps = 12;
    let mut s1 = cpu.new_sequence(8192).unwrap();
    let mut s2 = gpu.new_sequence(8192).unwrap();
    let mut want = cpu.forward(&mut s1, &toks, LogitsWanted::Last).unwrap();
    let first = want.clone();
    let mut got = gpu.forward(&mut s2, &toks, LogitsWanted::Last).unwrap();
    let mut worst = 0.0f32;
    for i in 0..steps {
        worst = worst.max(max_abs_diff(&got, &want));
        let (a, b) = (argmax(&want), argmax(&got));
        assert_eq!(a, b, "greedy diverged at step {i} with the bf16 KV cache");
        want = cpu.forward(&mut s1, &[a], LogitsWanted::Last).unwrap();
        got = gpu.forward(&mut s2, &[b], LogitsWanted::Last).unwrap();
    }
    eprintln!("bf16 KV: 300-token prompt + {steps} greedy steps: max |logit err| {worst:.3e}");
    assert!(worst <= LOGIT_TOL, "bf16 KV: max |logit error| {worst} > {LOGIT_TOL}");

    let mut tc = CudaBackend::new(&ck).unwrap();
    tc.set_kv_bf16(true);
    let mut s3 = tc.new_sequence(320).unwrap();
    let fast = tc.forward(&mut s3, &toks, LogitsWanted::Last).unwrap();
    let rel = rel_rms(&fast, &first);
    eprintln!("bf16 KV + tensor-core prefill vs CPU: last-position logits relative RMS {rel:.2e}");
    assert!(rel.is_finite() && rel < 0.1, "tensor-core prefill with a bf16 KV cache: relative RMS {rel}");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_f16_gdn_states_decode_within_their_rounding_of_the_cpu() {
    // The GDN states stored in f16 (`gdn_state_f16`): the exact prefill's scan leaves the
    // 300-token prompt's state rounded once (pf_gdn_scan_*_f16), then every decode step through
    // the graph (gdn_step_f16) reads and rounds it again. Teacher-forced with the CPU's greedy
    // tokens, so one flipped choice does not change the inputs after it; the f32-state backend
    // runs beside it as the yardstick (its error is rounding only).
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let mut f32s = cuda();
    let mut f16s = cuda_with(CudaOptions { gdn_state_f16: true, ..exact_options() });
    let vocab = cpu.config().vocab_size;
    let toks = prompt(300, vocab);
    let steps = 24;
    let mut sc = cpu.new_sequence(1024).unwrap();
    let (mut s32, mut s16) = (f32s.new_sequence(1024).unwrap(), f16s.new_sequence(1024).unwrap());
    let mut want = cpu.forward(&mut sc, &toks, LogitsWanted::Last).unwrap();
    let mut got32 = f32s.forward(&mut s32, &toks, LogitsWanted::Last).unwrap();
    let mut got16 = f16s.forward(&mut s16, &toks, LogitsWanted::Last).unwrap();
    let (mut worst32, mut worst16, mut worst_rel, mut agree, mut apart) = (0f32, 0f32, 0f32, 0, 0f32);
    for _ in 0..steps {
        worst32 = worst32.max(max_abs_diff(&got32, &want));
        worst16 = worst16.max(max_abs_diff(&got16, &want));
        apart = apart.max(max_abs_diff(&got16, &got32));
        worst_rel = worst_rel.max(rel_rms(&got16, &want));
        let t = argmax(&want);
        agree += (argmax(&got16) == t) as usize;
        want = cpu.forward(&mut sc, &[t], LogitsWanted::Last).unwrap();
        got32 = f32s.forward(&mut s32, &[t], LogitsWanted::Last).unwrap();
        got16 = f16s.forward(&mut s16, &[t], LogitsWanted::Last).unwrap();
    }
    eprintln!(
        "f16 GDN states: 300-token prompt + {steps} steps: max |logit err| {worst16:.3e} (f32 states {worst32:.3e}, \
         f16 vs f32 {apart:.3e}), worst relative RMS {worst_rel:.2e}, greedy agreement {agree}/{steps}"
    );
    assert!(worst32 <= LOGIT_TOL, "f32 states: max |logit error| {worst32}");
    // The two backends differ only in the states' element type: the f16 instances ran.
    assert!(apart > 0.0, "f16 states gave the f32 states' logits bit for bit");
    assert!(worst_rel < 5e-3, "f16 states: max |logit error| {worst16}, relative RMS {worst_rel}");
    assert!(agree + 1 >= steps, "f16 states: greedy agreement {agree}/{steps}");
}

/// The hand-over microbenchmark's chain (`lily-bench --handover`) gives the host's result every
/// way it runs: one programmatic-dependent launch per phase, and one persistent launch whose
/// blocks wait on flags (for the whole grid, or for one neighbour block), with and without the
/// weights prefetched; all ways the same bits. A flag protocol that let a block read a phase
/// before it was written would show here (or hang: the persistent grid is sized to be resident).
#[test]
#[ignore = "needs a GPU"]
fn cuda_handover_chain_matches_host_every_way() {
    use lily::backend::cuda::handover::{Chain, HandoverBench, Way};
    use lily::backend::cuda::Gpu;
    let gpu = Gpu::open(0, true).unwrap();
    let resident = HandoverBench::resident_blocks(&gpu).unwrap();
    let blocks = (2 * gpu.sms as usize).min(resident);
    let chain = Chain { rows: 1024, cols: 512, phases: 6, blocks, neighbour: false };
    let mut bench = HandoverBench::new(&gpu, chain).unwrap();
    for neighbour in [false, true] {
        bench.set_grid(blocks, neighbour).unwrap();
        let want = HandoverBench::host_reference(bench.chain());
        let mut digests = Vec::new();
        for way in [
            Way::Launches { prefetch: false },
            Way::Launches { prefetch: true },
            Way::Persistent { prefetch: false, wait: true },
            Way::Persistent { prefetch: true, wait: true },
        ] {
            let m = bench.run(way, 1, 2).unwrap();
            let got = bench.last_output().unwrap();
            let (err, scale) = (max_abs_diff(&got, &want), want.iter().fold(0f32, |a, v| a.max(v.abs())));
            eprintln!("handover {} neighbour {neighbour}: max |diff| {err:.3e} of max |y| {scale:.3}", way.label());
            assert!(scale > 0.1 && err <= 1e-4 * scale, "{} (neighbour {neighbour}): max |diff| {err} against max |y| {scale}", way.label());
            digests.push(m.digest);
        }
        assert!(digests.windows(2).all(|w| w[0] == w[1]), "neighbour {neighbour}: digests differ {digests:x?}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_decode_after_takes_the_first_token_from_the_prefills_last_row() {
    // decode_after runs the prompt through the prefill and the decode step's head and argmax on
    // its last row, then the pipelined steps: on the f32 prefill the tokens are the CPU's (whose
    // default decode_after is forward + host argmax + decode_greedy) and the sequence ends at the
    // same length; stopping at the first token leaves the prompt in.
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let vocab = cpu.config().vocab_size;
    let toks = prompt(70, vocab);
    let n = 24;
    let max_seq = toks.len() + n + 1;
    let run = |b: &mut dyn Backend, stop_at: usize| -> (Vec<u32>, usize) {
        let mut seq = b.new_sequence(max_seq).unwrap();
        let mut got = Vec::new();
        let k = b
            .decode_after(&mut seq, &toks, n, None, &mut |t| {
                got.push(t);
                got.len() < stop_at
            })
            .unwrap();
        assert_eq!(k, got.len());
        (got, seq.len())
    };
    let want = run(&mut cpu, usize::MAX);
    assert_eq!(want.1, toks.len() + n - 1);
    let mut gpu = cuda();
    let got = run(&mut gpu, usize::MAX);
    eprintln!("decode_after gpu {:?}", got.0);
    assert_eq!(got, want, "decode_after on the f32 prefill differs from the CPU's");
    let (first, len) = run(&mut gpu, 1);
    assert_eq!(first, want.0[..1]);
    assert!(len == toks.len() || len == toks.len() + 1, "len {len}");

    // The default (bf16) prefill: the first token is the argmax of the prefill's own last-row
    // logits up to their rounding, and the steps after it are the decode steps' from that
    // token on the same prefilled sequence.
    let mut gpu = cuda_with(CudaOptions::default());
    let (got, len) = run(&mut gpu, usize::MAX);
    assert_eq!(len, toks.len() + n - 1);
    let mut seq = gpu.new_sequence(max_seq).unwrap();
    let l = gpu.forward(&mut seq, &toks, LogitsWanted::Last).unwrap();
    let top = argmax(&l);
    assert!(got[0] == top || l[top as usize] - l[got[0] as usize] < 1e-2, "first token {} vs prefill logits' {top} ({} vs {})", got[0], l[got[0] as usize], l[top as usize]);
    let mut cur = got[0];
    for (i, &t) in got[1..].iter().enumerate() {
        let l = gpu.forward(&mut seq, &[cur], LogitsWanted::Last).unwrap();
        cur = argmax(&l);
        assert_eq!(t, cur, "token {} differs from the decode step's", i + 1);
    }
}
