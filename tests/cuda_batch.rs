//! Batched decode on the CUDA backend (src/backend/cuda/batch.rs) on the tiny synthetic checkpoint:
//! against the CPU reference, and batch invariance (a sequence's logits and tokens do not depend
//! on the other sequences of its steps). These need an H100/H200 (`bash .device/run test
//! cuda_batch`); they are ignored elsewhere.
//!
//! Tolerance against the CPU: the batch step's GEMMs are bf16 tensor-core products (as the
//! prefill's default path; tests/cuda_prefill.rs), so logits move by a few 1e-2 relative and the
//! tiny model's near-tie router flips an expert now and then: RMS relative error < 0.1 over all
//! rows and the top-1 token of at least 10 of 12 rows. Invariance is exact: bit-identical logits
//! and identical tokens.

mod common;

use common::{max_abs_diff, random_quant, rel_rms, rnd, tiny_checkpoint};
use lily::backend::cpu::CpuBackend;
use lily::backend::cuda::{attention, testing, CudaBackend, CudaOptions};
use lily::backend::{Backend, BatchRow, LogitsWanted, Sequence};
use lily::checkpoint::Checkpoint;
use lily::engine::contract::batch_prompt;
use lily::engine::sampling::{argmax, SamplerSnapshot, SamplingParams};

fn ck() -> Checkpoint {
    Checkpoint::open(tiny_checkpoint()).unwrap()
}

fn cuda(kv_bf16: bool) -> CudaBackend {
    // f32 GDN states whatever the environment asks (the f16 ones: cuda_f16_state).
    let opts = CudaOptions { gdn_state_f16: false, ..CudaOptions::from_env() };
    let mut b = CudaBackend::with_options(&ck(), opts).expect("CUDA backend (needs an sm_90 GPU)");
    b.set_kv_bf16(kv_bf16);
    b
}

/// The backend with its GDN states stored in f16 (`CudaOptions::gdn_state_f16`).
fn cuda_f16_state(kv_bf16: bool) -> CudaBackend {
    let opts = CudaOptions { gdn_state_f16: true, kv_bf16, ..CudaOptions::from_env() };
    CudaBackend::with_options(&ck(), opts).expect("CUDA backend (needs an sm_90 GPU)")
}

/// Prompt lengths of different sequences (the rows of a batch).
const LENS: [usize; 16] = [1, 2, 5, 9, 17, 31, 40, 64, 65, 100, 128, 150, 200, 257, 300, 333];

/// Sequence i prefilled with all but the last token of its prompt (exact f32 prefill, so the
/// state matches the CPU's to rounding); returns it and that last token.
fn prefilled(b: &mut CudaBackend, i: usize, len: usize) -> (Sequence, u32) {
    let vocab = b.config().vocab_size;
    let p = batch_prompt(i, len, vocab);
    let mut seq = b.new_sequence(512).unwrap();
    if len > 1 {
        testing::prefill(b, &mut seq, &p[..len - 1], LogitsWanted::None, 256, true).unwrap();
    }
    (seq, p[len - 1])
}

fn greedy() -> SamplerSnapshot {
    SamplerSnapshot { params: SamplingParams::greedy(), seed: 0, counts: vec![] }
}

fn snap(params: SamplingParams, seed: u64) -> SamplerSnapshot {
    SamplerSnapshot { params, seed, counts: vec![] }
}

/// Decodes the rows together, row r hanging up at its n-th token for each (r, n) of `stops`;
/// tokens per row.
fn decode_together(b: &mut CudaBackend, seqs: &mut [(Sequence, u32)], max: &[usize], snaps: &[SamplerSnapshot], stops: &[(usize, usize)]) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); seqs.len()];
    let mut rows: Vec<BatchRow> = seqs
        .iter_mut()
        .zip(max)
        .zip(snaps)
        .map(|(((seq, first), &m), s)| BatchRow { seq, first_token: *first, max_tokens: m, sampler: s.clone() })
        .collect();
    let produced = b
        .decode_batch(&mut rows, &mut |i: usize, t: u32| {
            out[i].push(t);
            !stops.contains(&(i, out[i].len()))
        })
        .unwrap();
    for (i, p) in produced.iter().enumerate() {
        assert_eq!(*p, out[i].len());
    }
    out
}

/// The CPU reference's last-position logits of each `batch_prompt` of `lens`, one row after another.
fn cpu_last_logits(cpu: &mut CpuBackend, lens: &[usize]) -> Vec<f32> {
    let vocab = cpu.config().vocab_size;
    let mut want = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let p = batch_prompt(i, len, vocab);
        let mut s = cpu.new_sequence(512).unwrap();
        want.extend(cpu.forward(&mut s, &p, LogitsWanted::Last).unwrap());
    }
    want
}

/// The logits of two batch steps of the prefilled `batch_prompt`s of `lens` together, both
/// steps feeding each row the token its prefill chose.
fn two_steps_together(gpu: &mut CudaBackend, lens: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let mut seqs: Vec<(Sequence, u32)> = lens.iter().enumerate().map(|(i, &len)| prefilled(gpu, i, len)).collect();
    let tokens: Vec<u32> = seqs.iter().map(|s| s.1).collect();
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().map(|s| &mut s.0).collect();
    let first = testing::batch_logits(gpu, &mut refs, &tokens).unwrap();
    let second = testing::batch_logits(gpu, &mut refs, &tokens).unwrap();
    (first, second)
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_logits_match_cpu_and_do_not_depend_on_the_batch() {
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let mut gpu = cuda(false);
    let vocab = cpu.config().vocab_size;
    let lens = &LENS[..12];
    let want = cpu_last_logits(&mut cpu, lens);
    let mut seqs: Vec<(Sequence, u32)> = lens.iter().enumerate().map(|(i, &len)| prefilled(&mut gpu, i, len)).collect();
    let mut alone = Vec::new();
    for (s, t) in seqs.iter() {
        let mut c = s.try_clone().unwrap();
        alone.extend(testing::batch_logits(&mut gpu, &mut [&mut c], &[*t]).unwrap());
    }
    let tokens: Vec<u32> = seqs.iter().map(|s| s.1).collect();
    // Reversed order first (on clones), then in order on the sequences themselves.
    let mut rev: Vec<Sequence> = seqs.iter().rev().map(|s| s.0.try_clone().unwrap()).collect();
    let rev_toks: Vec<u32> = tokens.iter().rev().copied().collect();
    let reversed = testing::batch_logits(&mut gpu, &mut rev.iter_mut().collect::<Vec<_>>(), &rev_toks).unwrap();
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().map(|s| &mut s.0).collect();
    let got = testing::batch_logits(&mut gpu, &mut refs, &tokens).unwrap();
    assert_eq!(got.len(), lens.len() * vocab);
    for (i, &len) in lens.iter().enumerate() {
        assert_eq!(seqs[i].0.len(), len, "row {i} advanced by one");
    }
    let row = |v: &[f32], i: usize| v[i * vocab..(i + 1) * vocab].to_vec();
    let n = lens.len();
    for i in 0..n {
        assert_eq!(max_abs_diff(&row(&got, i), &row(&alone, i)), 0.0, "row {i}: batch of {n} vs alone");
        assert_eq!(max_abs_diff(&row(&got, i), &row(&reversed, n - 1 - i)), 0.0, "row {i}: order");
    }
    let r = rel_rms(&got, &want);
    let top1 = (0..n).filter(|&i| argmax(&row(&got, i)) == argmax(&row(&want, i))).count();
    eprintln!("batch of {n} vs CPU: rel RMS {r:.3e}, max abs {:.3e}, top-1 {top1}/{n}", max_abs_diff(&got, &want));
    assert!(r < 0.1, "relative logit error {r}");
    assert!(top1 >= 10, "top-1 agreement {top1}/{n}");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_greedy_tokens_do_not_depend_on_the_batch() {
    greedy_tokens_do_not_depend_on_the_batch(cuda(true));
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_greedy_tokens_do_not_depend_on_the_batch_with_f16_gdn_states() {
    // The f16 state's instances of the batched and persistent GDN steps and of the prefill
    // scans (the prompts of 65+ tokens take the chunked walk), the states they leave read back
    // by the next steps: a row's tokens are its tokens alone.
    greedy_tokens_do_not_depend_on_the_batch(cuda_f16_state(true));
}

fn greedy_tokens_do_not_depend_on_the_batch(mut gpu: CudaBackend) {
    let n = LENS.len();
    // Different lengths of output, and row 3 hangs up after 5 tokens: rows leave mid-way and
    // the others are re-bound.
    let max: Vec<usize> = (0..n).map(|i| 12 + 2 * (i % 5)).collect();
    let snaps = vec![greedy(); n];
    let mut seqs: Vec<(Sequence, u32)> = LENS.iter().enumerate().map(|(i, &len)| prefilled(&mut gpu, i, len)).collect();
    let starts: Vec<usize> = seqs.iter().map(|s| s.0.len()).collect();
    let together = decode_together(&mut gpu, &mut seqs, &max, &snaps, &[(3, 5)]);
    for i in 0..n {
        let want = if i == 3 { 5 } else { max[i] };
        assert_eq!(together[i].len(), want, "row {i}");
        // Row 3's next step was queued before its hang-up was read: it fed its last token too.
        let fed = if i == 3 { want + 1 } else { want };
        assert_eq!(seqs[i].0.len(), starts[i] + fed, "row {i} holds its first token and all but the last");
    }
    for (i, &len) in LENS.iter().enumerate() {
        let mut one = vec![prefilled(&mut gpu, i, len)];
        let alone = decode_together(&mut gpu, &mut one, &[together[i].len()], &snaps[..1], &[]);
        assert_eq!(alone[0], together[i], "row {i} (prompt {len}) alone vs in a batch of {n}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_warm_up_captures_every_batch_size_and_changes_no_token() {
    // The server's warm-up: a short prefill, a decode step, and the batch steps of 2..=16 rows,
    // greedy and sampled, captured ahead. Then the same greedy and sampled decodes as on a fresh
    // backend (rows leave mid-way: the steps of the smaller batches run through warmed graphs).
    let n = LENS.len();
    let max: Vec<usize> = (0..n).map(|i| 6 + 2 * (i % 5)).collect();
    let chat = SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() };
    let mut runs = Vec::new();
    for warm in [false, true] {
        let mut gpu = cuda(true);
        if warm {
            let done = gpu.warm_up(n).unwrap().expect("the CUDA backend warms up");
            eprintln!("{done}");
            // Greedy, sampled, and sampled with a small top-k (sample_small_k) per row count.
            assert!(done.contains(&format!(", {} batch step graphs", 3 * (n - 1))), "{done}");
        }
        let mut run = Vec::new();
        for snaps in [vec![greedy(); n], (0..n).map(|i| snap(chat.clone(), 7 + i as u64)).collect()] {
            let mut seqs: Vec<(Sequence, u32)> = LENS.iter().enumerate().map(|(i, &len)| prefilled(&mut gpu, i, len)).collect();
            run.push(decode_together(&mut gpu, &mut seqs, &max, &snaps, &[]));
        }
        runs.push(run);
    }
    assert_eq!(runs[1], runs[0], "tokens after the warm-up vs without it");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_sampling_per_row() {
    let mut gpu = cuda(true);
    let chat = SamplingParams { temperature: 0.7, top_p: 0.8, top_k: 20, ..Default::default() };
    let settings = [
        snap(SamplingParams::greedy(), 0),
        snap(chat.clone(), 11),
        snap(SamplingParams { temperature: 1.0, top_p: 0.95, ..Default::default() }, 12),
        snap(SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.5, ..Default::default() }, 13),
        snap(SamplingParams { temperature: 1.0, top_k: 1, ..Default::default() }, 14),
        snap(SamplingParams { temperature: 0.9, min_p: 0.1, frequency_penalty: 0.4, ..Default::default() }, 15),
        snap(chat, 16),
    ];
    let n = settings.len();
    // Every row starts from the same prompt, so greedy (row 0) and top-k 1 (row 4) must agree.
    let fresh = |gpu: &mut CudaBackend| -> Vec<(Sequence, u32)> { (0..n).map(|_| prefilled(gpu, 0, 40)).collect() };
    let max = vec![16; n];
    let mut a = fresh(&mut gpu);
    let first = decode_together(&mut gpu, &mut a, &max, &settings, &[(2, 7)]);
    let mut b = fresh(&mut gpu);
    let again = decode_together(&mut gpu, &mut b, &max, &settings, &[(2, 7)]);
    assert_eq!(first, again, "same seeds, same tokens");
    assert_eq!(first[0], first[4], "top-k 1 is greedy");
    assert_ne!(first[1], first[6], "different seeds draw differently");
    for (i, s) in settings.iter().enumerate() {
        let mut one = fresh(&mut gpu);
        one.truncate(1);
        let alone = decode_together(&mut gpu, &mut one, &[first[i].len()], std::slice::from_ref(s), &[]);
        assert_eq!(alone[0], first[i], "row {i} alone vs in the batch");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_steps_queued_ahead_leave_each_row_as_alone() {
    // Two steps in flight wherever the rows allow it. Row 2 leaves at max_tokens 4 and row 4 at
    // 10, row 0 runs to 12; row 3 (seeded sampling with a penalty: the batch samples until it
    // leaves) hangs up at its 6th token, greedy row 1 at its 8th (by then the batch takes the
    // argmax path).
    let mut gpu = cuda(true);
    let lens = &LENS[..5];
    let max = [12, 12, 4, 12, 10];
    let sampled = snap(SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, presence_penalty: 0.5, ..Default::default() }, 21);
    let snaps = [greedy(), greedy(), greedy(), sampled, greedy()];
    let mut seqs: Vec<(Sequence, u32)> = lens.iter().enumerate().map(|(i, &len)| prefilled(&mut gpu, i, len)).collect();
    let starts: Vec<usize> = seqs.iter().map(|s| s.0.len()).collect();
    let together = decode_together(&mut gpu, &mut seqs, &max, &snaps, &[(3, 6), (1, 8)]);
    let got: Vec<usize> = together.iter().map(Vec::len).collect();
    assert_eq!(got, [12, 8, 4, 6, 10]);
    // Step k + 1 is queued before step k's tokens are read except where a row takes its last
    // token at step k (k = 3, 9, 11) or step k still runs a row that hung up at step k - 1 (k = 6,
    // 8). So rows 3 and 1, hanging up at steps 5 and 7, also hold their last tokens; the others
    // hold their first token and all but the last.
    let fed = [12, 9, 4, 7, 10];
    for i in 0..lens.len() {
        assert_eq!(seqs[i].0.len(), starts[i] + fed[i], "row {i}");
    }
    for (i, &len) in lens.iter().enumerate() {
        // Alone, two tokens further: the batch's tokens first.
        let mut one = vec![prefilled(&mut gpu, i, len)];
        let alone = decode_together(&mut gpu, &mut one, &[got[i] + 2], &snaps[i..i + 1], &[]).remove(0);
        assert_eq!(alone[..got[i]], together[i][..], "row {i} alone vs in the batch");
        // A step on the batch's sequence, fed the first output it has not taken, continues as
        // alone: the sequence holds exactly the tokens it was fed.
        let mut cont = snaps[i].clone();
        for &t in &alone[..fed[i]] {
            cont.observe(t);
        }
        seqs[i].1 = alone[fed[i] - 1];
        let next = decode_together(&mut gpu, &mut seqs[i..i + 1], &[1], &[cont], &[]);
        assert_eq!(next[0], [alone[fed[i]]], "row {i}: the step after the batch");
    }
}

/// The batched GEMV set at every blocking of a step's tokens: 16 or 8 tokens per 256-thread
/// block, 16 per 512-thread block over 4,096 columns in steps of more than 16 (`gemv_tcb_w`).
/// Each token's outputs are bit-identical whatever the step's token count, and near the CPU's
/// f32 product (bf16 inputs on the tensor cores); at the 35B's hidden width (2,048 columns), GDN
/// value width (4,096) and shared-expert width (512). The fragment-order codes of steps of up to
/// 16 tokens go through the weight-ring kernel (`gemv_tcq`): bit-identical to the row-order ones.
#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_gemv_set_does_not_depend_on_the_token_count() {
    let gpu = cuda(true);
    for (rows, cols) in [(1000usize, 2048usize), (2048, 4096), (300, 512)] {
        let q = random_quant(rows, cols, 4, 7 + cols as u64);
        let n = 100;
        let x = rnd(11, n * cols);
        let all = testing::gemv_batch(&gpu, &q, &x, n, false).unwrap();
        for ntok in [1usize, 8, 9, 16, 17, 32, 33, 64] {
            let part = testing::gemv_batch(&gpu, &q, &x[..ntok * cols], ntok, false).unwrap();
            assert_eq!(max_abs_diff(&part, &all[..ntok * rows]), 0.0, "{rows}x{cols}: {ntok} tokens against {n}");
        }
        // The fragment-order codes (the model's matrices): the same outputs.
        for ntok in [1usize, 16, 17, 64, n] {
            let f = testing::gemv_batch(&gpu, &q, &x[..ntok * cols], ntok, true).unwrap();
            assert_eq!(max_abs_diff(&f, &all[..ntok * rows]), 0.0, "{rows}x{cols}: {ntok} tokens, fragment order");
        }
        let want = lily::backend::cpu::qmatmul::qmatmul_all(&q, &x, n);
        let r = rel_rms(&all, &want);
        eprintln!("{rows}x{cols}, {n} tokens: rel RMS {r:.3e} against the CPU");
        assert!(r < 1e-2, "{rows}x{cols}: relative error {r}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_rejects_bad_rows_before_any_step() {
    let mut gpu = cuda(true);
    let (mut s1, t1) = prefilled(&mut gpu, 0, 10);
    gpu.set_kv_bf16(false);
    let mut other = gpu.new_sequence(64).unwrap();
    gpu.set_kv_bf16(true);
    let mut rows = vec![
        BatchRow { seq: &mut s1, first_token: t1, max_tokens: 4, sampler: greedy() },
        BatchRow { seq: &mut other, first_token: 1, max_tokens: 4, sampler: greedy() },
    ];
    let e = gpu.decode_batch(&mut rows, &mut |_: usize, _: u32| true).unwrap_err().to_string();
    assert!(e.contains("KV cache"), "{e}");
    let (mut s2, t2) = prefilled(&mut gpu, 1, 10);
    let len = s2.len();
    let mut rows = vec![BatchRow { seq: &mut s2, first_token: t2, max_tokens: 10_000, sampler: greedy() }];
    let e = gpu.decode_batch(&mut rows, &mut |_: usize, _: u32| true).unwrap_err().to_string();
    assert!(e.contains("max-seq"), "{e}");
    let mut rows = vec![BatchRow { seq: &mut s2, first_token: u32::MAX, max_tokens: 1, sampler: greedy() }];
    assert!(gpu.decode_batch(&mut rows, &mut |_: usize, _: u32| true).is_err());
    assert_eq!(s2.len(), len, "nothing ran");
}

/// The MoE output added into the residual by the next layer's first staging (`stage_tcb_after`,
/// one launch) against `moe::combine` then `stage_tcb`: the same residual, fragment words and
/// group sums, bit for bit, and the residual as the host computes it; 5 rows (a partial block of
/// 16) and 16, the 35B's width and k.
#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_combine_folded_into_the_next_staging_is_bit_identical() {
    let b = cuda(true);
    let (h, k) = (2048usize, 8usize);
    for n in [5usize, 16] {
        let x = rnd(3 + n as u64, n * h);
        let down = rnd(5 + n as u64, n * k * h);
        let top_w: Vec<f32> = rnd(7 + n as u64, n * k).iter().map(|v| v.abs()).collect();
        let shared = rnd(9 + n as u64, n * h);
        let sgl = rnd(11 + n as u64, n);
        let gain: Vec<f32> = rnd(13, h).iter().map(|v| 1.0 + 0.5 * v).collect();
        let [fused, two] = testing::staged_after_combine(&b, &x, &down, &top_w, k, &shared, &sgl, &gain, n).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused.0), bits(&two.0), "residual, {n} rows");
        assert_eq!(fused.1, two.1, "fragment words, {n} rows");
        assert_eq!(bits(&fused.2), bits(&two.2), "group sums, {n} rows");
        let mut want = x.clone();
        for t in 0..n {
            let g = 1.0 / (1.0 + (-sgl[t]).exp());
            for c in 0..h {
                let routed: f32 = (0..k).map(|j| top_w[t * k + j] * down[(t * k + j) * h + c]).sum();
                want[t * h + c] += routed + g * shared[t * h + c];
            }
        }
        let err = max_abs_diff(&fused.0, &want);
        eprintln!("combine folded into the staging, {n} rows: max |err| {err:.2e} against the host");
        assert!(err < 1e-4, "{n} rows: {err}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_routing_kernel_matches_the_cpu_router_and_lists() {
    // moe_route_batch alone: f32 router and gate logits against the CPU's qmatmul, its picks
    // against the CPU's softmax top-k of those logits, and the lists and tiles the expert kernels
    // read (the shared expert as expert E); 5 tokens (one token block) and 40 (three), each
    // launched twice on the same buffers.
    let ck = ck();
    let b = cuda(true);
    let mw = lily::model::ModelWeights::from_checkpoint(&ck).unwrap();
    let cfg = b.config().clone();
    let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
    for (layer, n) in [(0usize, 5usize), (1, 40)] {
        let u = rnd(7 + n as u64, n * h);
        let mut runs = testing::route_batch(&b, layer, &u, n, 2).unwrap();
        // The order of the slots inside an expert's list is the kernel's shared-memory atomics'
        // (no product depends on it: each slot is a tensor-core column of its own), so the runs
        // are compared with every expert's slots sorted.
        for r in runs.iter_mut() {
            for (ex, &c) in r.counts.iter().enumerate() {
                let o = r.offsets[ex] as usize;
                r.list[o..o + c as usize].sort();
            }
        }
        assert_eq!(runs[0], runs[1], "a second launch on the same buffers gives the same routing");
        let got = &runs[0];
        let m = &mw.layers[layer].moe;
        let want = lily::backend::cpu::qmatmul::qmatmul_all(&m.router, &u, n);
        let want_sgl = lily::backend::cpu::qmatmul::qmatmul_all(&m.shared_expert_gate, &u, n);
        let (err, err_sgl) = (max_abs_diff(&got.logits, &want), max_abs_diff(&got.sgl, &want_sgl));
        eprintln!("routing kernel, {n} tokens: router max |err| {err:.2e}, gate {err_sgl:.2e}");
        assert!(err < 1e-4 && err_sgl < 1e-4);
        let mut counts = vec![0i32; e];
        for t in 0..n {
            let (ids, w) = lily::backend::cpu::moe::route(&got.logits[t * e..(t + 1) * e], k);
            let mut pairs: Vec<(usize, f32)> = ids.into_iter().zip(w).collect();
            pairs.sort_by_key(|p| p.0);
            for (j, (id, w)) in pairs.iter().enumerate() {
                assert_eq!(got.top_ids[t * k + j], *id as i32, "token {t} pick {j}");
                assert!((got.top_w[t * k + j] - w).abs() < 1e-6);
                counts[*id] += 1;
            }
        }
        // The shared expert is expert E: every token once, in slots n * k + t after the routed ones.
        counts.push(n as i32);
        assert_eq!(got.counts, counts);
        let mut off = 0;
        // Tiles of 16 slots, the shared expert's first (the heaviest blocks in the first wave),
        // then the routed experts' in expert order.
        let mut tiles: Vec<i32> = (0..n as i32).step_by(16).flat_map(|f0| [e as i32, f0]).collect();
        for (ex, &c) in counts.iter().enumerate() {
            assert_eq!(got.offsets[ex], off);
            let mut slots: Vec<i32> = got.list[off as usize..(off + c) as usize].to_vec();
            slots.sort();
            let want: Vec<i32> = if ex < e {
                (0..(n * k) as i32).filter(|&s| got.top_ids[s as usize] == ex as i32).collect()
            } else {
                ((n * k) as i32..(n * (k + 1)) as i32).collect()
            };
            assert_eq!(slots, want, "expert {ex}'s slot list");
            if ex < e {
                for f0 in (0..c).step_by(16) {
                    tiles.extend([ex as i32, f0]);
                }
            }
            off += c;
        }
        assert_eq!(got.tiles[0] as usize, tiles.len() / 2);
        assert_eq!(&got.tiles[1..], &tiles[..]);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_token_masks_hold_their_rows_and_leave_the_others_alone() {
    let mut gpu = cuda(true);
    common::check_token_masks(&mut gpu, [3, 40, 65, 200], 512);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_gdn_step_kernels_agree_bit_for_bit() {
    // The batched GDN step with a block per (row, head) item, on persistent blocks of one item
    // each (the default at this size) and on 5 persistent blocks (about 10 items each, so the
    // shared-memory ring wraps); two steps, the second reading the states and conv rings the
    // first wrote.
    // The same with the states in f16 (the `_f16` instances), which must stay within the f16
    // rounding of the f32 states' logits.
    let lens = &LENS[..12];
    let mut f32_runs = Vec::new();
    for f16 in [false, true] {
        let mut runs = Vec::new();
        for blocks in [Some(0), None, Some(5)] {
            let mut gpu = if f16 { cuda_f16_state(false) } else { cuda(false) };
            testing::options_mut(&mut gpu).gdn_step_blocks = blocks;
            let (first, second) = two_steps_together(&mut gpu, lens);
            runs.push((blocks, first, second));
        }
        let (_, want1, want2) = &runs[0];
        for (blocks, first, second) in &runs[1..] {
            assert_eq!(max_abs_diff(first, want1), 0.0, "f16 {f16}: step 1, persistent blocks {blocks:?} vs a block per item");
            assert_eq!(max_abs_diff(second, want2), 0.0, "f16 {f16}: step 2, persistent blocks {blocks:?} vs a block per item");
        }
        f32_runs.push(runs.swap_remove(0));
    }
    let ((_, a1, a2), (_, b1, b2)) = (&f32_runs[0], &f32_runs[1]);
    let (r1, r2) = (rel_rms(b1, a1), rel_rms(b2, a2));
    eprintln!("f16 GDN states against f32: logits relative RMS {r1:.2e} (step 1), {r2:.2e} (step 2)");
    assert!(r1 > 0.0 && r1 < 5e-3 && r2 < 5e-3, "f16 GDN states: logits relative RMS {r1} / {r2} against the f32 states'");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_tensor_core_attention_matches_the_cpu_and_the_cuda_core_kernel() {
    // bf16 KV cache: the batched decode's attention splits on the tensor cores (the default) against
    // the CPU reference (the bounds of the test above) and against the CUDA-core split kernel
    // (bf16 q and probabilities against f32: a few 1e-3 relative), 12 rows of 1 to 200 prompt
    // tokens, two steps.
    let ck = ck();
    let mut cpu = CpuBackend::new(&ck).unwrap();
    cpu.set_kv_bf16(true);
    let vocab = cpu.config().vocab_size;
    let lens = &LENS[..12];
    let want = cpu_last_logits(&mut cpu, lens);
    let mut runs = Vec::new();
    for cuda_core in [false, true] {
        let mut gpu = cuda(true);
        testing::options_mut(&mut gpu).attn_split_cuda_core = cuda_core;
        runs.push(two_steps_together(&mut gpu, lens));
    }
    let n = lens.len();
    let row = |v: &[f32], i: usize| v[i * vocab..(i + 1) * vocab].to_vec();
    let (tc, cc) = (&runs[0], &runs[1]);
    let r = rel_rms(&tc.0, &want);
    let top1 = (0..n).filter(|&i| argmax(&row(&tc.0, i)) == argmax(&row(&want, i))).count();
    let (d1, d2) = (rel_rms(&tc.0, &cc.0), rel_rms(&tc.1, &cc.1));
    eprintln!("tensor-core attention: vs CPU rel RMS {r:.3e}, top-1 {top1}/{n}; vs the CUDA-core kernel {d1:.3e} / {d2:.3e}");
    assert!(r < 0.1 && top1 >= 10, "against the CPU: {r}, top-1 {top1}/{n}");
    assert!(d1 < 0.05 && d2 < 0.05, "against the CUDA-core kernel: {d1} / {d2}");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_attention_kernels_match_an_exact_reference() {
    // The batched decode's split + combine alone at the 35B's attention shape (16 q heads, 2 KV
    // heads, head dim 256), bf16 caches of 1 to 257 positions (tile and split edges), 1 and 4
    // splits, against softmax attention in f64 over the same bf16 values: the CUDA-core kernel to
    // f32 rounding, the tensor-core kernel (bf16 q and probabilities) within 1e-2 of the largest
    // output.
    let b = cuda(true);
    let (nh, nkv, hd) = (16usize, 2usize, 256usize);
    let lens = [1usize, 5, 31, 32, 33, 64, 100, 257];
    let rows = lens.len();
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    let q = rnd(11, rows * nh * hd);
    let gate = rnd(12, rows * nh * hd);
    let caches: Vec<(Vec<f32>, Vec<f32>)> = lens.iter().enumerate().map(|(i, &len)| (rnd(100 + i as u64, len * nkv * hd), rnd(200 + i as u64, len * nkv * hd))).collect();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut want = vec![0f32; rows * nh * hd];
    for (r, (k, v)) in caches.iter().enumerate() {
        let len = lens[r];
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[(r * nh + h) * hd..][..hd];
            let s: Vec<f64> = (0..len).map(|j| (0..hd).map(|d| qh[d] as f64 * bf(k[(j * nkv + kvh) * hd + d]) as f64).sum::<f64>() * scale).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = e.iter().sum();
            for d in 0..hd {
                let o: f64 = (0..len).map(|j| e[j] * bf(v[(j * nkv + kvh) * hd + d]) as f64).sum::<f64>() / l;
                let g = gate[(r * nh + h) * hd + d] as f64;
                want[(r * nh + h) * hd + d] = (o / (1.0 + (-g).exp())) as f32;
            }
        }
    }
    let peak = want.iter().fold(0f32, |a, &x| a.max(x.abs()));
    for splits in [1usize, 4] {
        for kernel in [attention::SplitBatch::CudaCore, attention::SplitBatch::TensorCore] {
            let got = testing::batch_attention(&b, &q, &gate, &caches, nh, nkv, hd, splits, kernel).unwrap();
            let err = max_abs_diff(&got, &want);
            eprintln!("batched attention {kernel:?}, {splits} splits: max |err| {err:.3e} of max |out| {peak:.3}");
            let bound = if kernel == attention::SplitBatch::CudaCore { 1e-5 } else { 1e-2 } * peak;
            assert!(err < bound, "{kernel:?}, {splits} splits: {err} (bound {bound})");
        }
    }
}

/// Random inputs of a batched GDN step at `d`'s dims: rows at positions from 0 (no conv history
/// yet) to past 4K, states of moderate size, negative decay rates, norm weights near 1.
fn gdn_step_inputs(d: &lily::backend::cuda::gdn::GdnDims, rows: usize, seed: u64) -> testing::GdnStepInput {
    let (c, vd) = (d.conv_dim, d.nv * d.dv);
    let scaled = |s: u64, n: usize, k: f32| rnd(seed + s, n).into_iter().map(|x| k * x).collect::<Vec<f32>>();
    testing::GdnStepInput {
        qkv: rnd(seed + 1, rows * c),
        z: rnd(seed + 2, rows * vd),
        braw: rnd(seed + 3, rows * d.nv),
        araw: rnd(seed + 4, rows * d.nv),
        rings: (0..rows as u64).map(|r| rnd(seed + 100 + r, d.kc * c)).collect(),
        states: (0..rows as u64).map(|r| scaled(1000 + r, d.nv * d.dk * d.dv, 0.5)).collect(),
        positions: (0..rows).map(|r| [0, 1, 2, 3, 7, 100, 4095][r % 7] + r as i32).collect(),
        taps: scaled(5, d.kc * c, 0.5),
        dt_bias: rnd(seed + 6, d.nv),
        neg_a: rnd(seed + 7, d.nv).into_iter().map(|x| -(1.0 + x.abs())).collect(),
        norm_w: scaled(8, d.dv, 0.1).into_iter().map(|x| 1.0 + x).collect(),
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_gdn_steps_at_the_35b_shapes_equal_the_general_kernels() {
    // The _35b GDN steps (the 35B's head shapes as compile-time constants) against the general
    // ones at those dims, bit for bit: the outputs, the batched steps' staged out-projection
    // inputs, the states and the conv rings; gdn_step_batch over 20 rows (positions from 0 on),
    // gdn_step_persist over 3 rows on a block per item and on 5 blocks (its shared-memory ring
    // wrapping), one sequence's gdn_step at three positions; f32 and f16 states.
    use lily::backend::cuda::gdn::{GdnDims, StepBatchKernel};
    use testing::GdnStepKernel::{Batch, One};
    let batch = |kernel, shaped| Batch { kernel, shaped };
    let b = cuda(false);
    let big = GdnDims::new(&lily::checkpoint::ModelConfig::qwen36_35b_a3b());
    for f16 in [false, true] {
        let d = big.with_state_f16(f16);
        let mut cases = vec![(gdn_step_inputs(&d, 20, 11), batch(StepBatchKernel::PerItem, false), batch(StepBatchKernel::PerItem, true))];
        for blocks in [3 * d.nv, 5] {
            let persist = StepBatchKernel::Persist { blocks };
            cases.push((gdn_step_inputs(&d, 3, 20 + blocks as u64), batch(persist, false), batch(persist, true)));
        }
        for (i, pos) in [0, 2, 4099].into_iter().enumerate() {
            let mut inp = gdn_step_inputs(&d, 1, 50 + i as u64);
            inp.positions = vec![pos];
            cases.push((inp, One { shaped: false }, One { shaped: true }));
        }
        for (inp, general_kernel, shaped_kernel) in cases {
            let what = format!("f16 {f16}, {general_kernel:?} at positions {:?}", &inp.positions[..inp.positions.len().min(3)]);
            let general = testing::gdn_step(&b, &d, &inp, general_kernel).unwrap();
            let shaped = testing::gdn_step(&b, &d, &inp, shaped_kernel).unwrap();
            // The harness ran a step: finite outputs, every state rewritten, and the ring slot of
            // each row's position now holds its q|k|v (the first value head of each key head
            // writes q and k).
            assert!(general.y.iter().all(|v| v.is_finite()) && general.y.iter().any(|&v| v != 0.0), "{what}");
            let c = d.conv_dim;
            for r in 0..inp.positions.len() {
                assert_ne!(general.states[r], inp.states[r], "{what}: row {r}'s state");
                let slot = inp.positions[r] as usize % d.kc;
                assert_eq!(general.rings[r][slot * c..(slot + 1) * c], inp.qkv[r * c..(r + 1) * c], "{what}: row {r}'s ring");
            }
            assert_eq!(shaped.y, general.y, "{what}: outputs");
            assert_eq!(shaped.frag, general.frag, "{what}: staged words");
            assert_eq!(shaped.gsum, general.gsum, "{what}: staged group sums");
            assert_eq!(shaped.states, general.states, "{what}: states");
            assert_eq!(shaped.rings, general.rings, "{what}: rings");
        }
    }
    // Other dims cannot take the shaped kernels.
    let other = GdnDims { nv: 16, ..big };
    for kernel in [batch(StepBatchKernel::PerItem, true), batch(StepBatchKernel::Persist { blocks: 5 }, true), One { shaped: true }] {
        let err = testing::gdn_step(&b, &other, &gdn_step_inputs(&other, 1, 3), kernel).unwrap_err();
        assert!(format!("{err:#}").contains("head shapes"), "{err:#}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_batch_routing_at_the_35b_shapes_equals_the_general_kernel() {
    // moe_route_batch_1_35b / _4_35b (the 35B's routing shapes as compile-time constants) against
    // moe_route_batch_1 / _4 on a random 8-bit router and shared-expert gate of the 35B's shapes
    // (2,048 columns, 256 experts, top 8), bit for bit: logits, gate logits, top-k ids and
    // weights, counts, offsets, slot lists (each expert's slots sorted) and tiles; one token
    // block (a router row per block) and several (four rows per block).
    use lily::backend::cuda::moe::MoeDims;
    let b = cuda(false);
    let d = MoeDims::new(&lily::checkpoint::ModelConfig::qwen36_35b_a3b());
    let (router, gate) = (random_quant(d.e, d.hidden, 8, 21), random_quant(1, d.hidden, 8, 22));
    for n in [1, 16, 40, 64] {
        let u = rnd(30 + n as u64, n * d.hidden);
        // The order of the slots inside an expert's list is the shared-memory atomics' (as in the
        // test above): compared with every expert's slots sorted.
        let sorted = |mut r: testing::BatchRouting| {
            for (ex, &c) in r.counts.iter().enumerate() {
                let o = r.offsets[ex] as usize;
                r.list[o..o + c as usize].sort();
            }
            r
        };
        let general = sorted(testing::route_batch_at(&b, &router, &gate, &d, 64, &u, n, false).unwrap());
        let shaped = sorted(testing::route_batch_at(&b, &router, &gate, &d, 64, &u, n, true).unwrap());
        // A routing happened: every token's k slots counted, the shared expert's n.
        assert_eq!(general.counts[..d.e].iter().sum::<i32>() as usize, n * d.k, "{n} tokens");
        assert_eq!(general.counts[d.e] as usize, n, "{n} tokens");
        assert_eq!(shaped, general, "{n} tokens");
    }
    // Other shapes (a 4-bit router) cannot take the shaped kernels.
    let r4 = random_quant(d.e, d.hidden, 4, 23);
    let err = testing::route_batch_at(&b, &r4, &gate, &d, 64, &rnd(1, d.hidden), 1, true).unwrap_err();
    assert!(format!("{err:#}").contains("routing shapes"), "{err:#}");
}
