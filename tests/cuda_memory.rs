//! Sequence memory on the CUDA backend (src/backend/cuda/seqmem.rs) on the tiny synthetic
//! checkpoint: KV pages mapped as a sequence grows (decode across a page boundary against the CPU
//! reference), clones sharing every page and copying the partly filled last one only when they
//! continue (interleaved with their source, bit-identical to sequences that share nothing),
//! snapshots holding their pages unmapped until a copy continues, copies in pinned host memory
//! restored exactly, and the budget refusing work that does not fit with a `MemoryFull` error
//! that leaves every sequence intact (a reservation covering a copy's own last pages).
//! These need an H100/H200 (`bash .device/run test cuda_memory`); they are ignored elsewhere.
//!
//! The tiny model has one attention layer (2 caches, K and V) of kv_dim 128: with an f32 cache a
//! 2 MiB page holds 4,096 positions.

mod common;

use common::{max_abs_diff, tiny_checkpoint};
use lily::backend::cpu::CpuBackend;
use lily::backend::cuda::hostmem::PinnedPool;
use lily::backend::cuda::{state, testing, CudaBackend, CudaOptions};
use lily::backend::{is_memory_full, Backend, BatchRow, LogitsWanted, Sequence};
use lily::checkpoint::Checkpoint;
use lily::engine::contract::contract_prompt;
use lily::engine::sampling::{argmax, SamplerSnapshot, SamplingParams};

const LOGIT_TOL: f32 = 1e-3;

fn ck() -> Checkpoint {
    Checkpoint::open(tiny_checkpoint()).unwrap()
}

/// Exact f32 prefill and f32 KV, as the CPU reference computes; `cap` bounds the budget.
fn cuda(cap: Option<usize>) -> CudaBackend {
    let opts = CudaOptions { exact_prefill: true, kv_bf16: false, gdn_state_f16: false, gemv_tc_min_tiles: 0, sequence_memory_cap: cap, ..CudaOptions::default() };
    CudaBackend::with_options(&ck(), opts).expect("CUDA backend (needs an sm_90 GPU)")
}

struct Sizes {
    page: usize,
    slot: usize,
    rows_per_page: usize,
}

fn sizes(b: &CudaBackend) -> Sizes {
    let cfg = b.config();
    let page = b.sequence_memory().unwrap().page_bytes as usize;
    Sizes { page, slot: state::layout(cfg, false).1 * 4, rows_per_page: page / (cfg.kv_dim() * 4) }
}

fn in_use(b: &CudaBackend) -> usize {
    b.sequence_memory().unwrap().in_use_bytes as usize
}

fn prefill(b: &mut CudaBackend, seq: &mut Sequence, toks: &[u32]) {
    testing::prefill(b, seq, toks, LogitsWanted::None, 1024, true).unwrap();
}

/// A fresh sequence of room `max` holding `toks`.
fn prefilled(b: &mut CudaBackend, toks: &[u32], max: usize) -> Sequence {
    let mut s = b.new_sequence(max).unwrap();
    prefill(b, &mut s, toks);
    s
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_kv_pages_are_mapped_as_the_sequence_grows_and_decode_crosses_them() {
    let ck = ck();
    let mut gpu = cuda(None);
    let mut cpu = CpuBackend::new(&ck).unwrap();
    let z = sizes(&gpu);
    let vocab = gpu.config().vocab_size;
    let n = z.rows_per_page - 6;
    let toks = contract_prompt(n + 1, vocab);
    let mut g = gpu.new_sequence(3 * z.rows_per_page).unwrap();
    assert_eq!(g.memory_bytes(), z.slot + 8, "a fresh sequence holds its state slot and no KV");
    assert_eq!(in_use(&gpu), z.slot);
    let mut c = cpu.new_sequence(3 * z.rows_per_page).unwrap();
    prefill(&mut gpu, &mut g, &toks[..n]);
    cpu.forward(&mut c, &toks[..n], LogitsWanted::None).unwrap();
    assert_eq!(g.memory_bytes(), z.slot + 2 * z.page + 8, "one page per cache");
    // Twelve decode steps, the seventh at the first position of the second page.
    let (mut tg, mut tc) = (toks[n], toks[n]);
    let mut worst = 0.0f32;
    for _ in 0..12 {
        let a = gpu.forward(&mut g, &[tg], LogitsWanted::Last).unwrap();
        let b = cpu.forward(&mut c, &[tc], LogitsWanted::Last).unwrap();
        worst = worst.max(max_abs_diff(&a, &b));
        (tg, tc) = (argmax(&a), argmax(&b));
        assert_eq!(tg, tc, "greedy diverged at position {}", g.len());
    }
    eprintln!("decode across a KV page boundary: max |logit err| {worst:.3e}");
    assert!(worst <= LOGIT_TOL);
    assert_eq!(g.memory_bytes(), z.slot + 4 * z.page + 8);
    drop(g);
    assert_eq!(in_use(&gpu), 0, "a dropped sequence's slot and pages go back to the pool");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_clones_share_pages_copy_the_last_on_write_and_never_see_each_others_writes() {
    let mut gpu = cuda(None);
    let z = sizes(&gpu);
    let vocab = gpu.config().vocab_size;
    let n = z.rows_per_page + 100;
    let toks = contract_prompt(n, vocab);
    // Two sequences holding the same tokens, and a clone of the first.
    let mut a = gpu.new_sequence(2 * z.rows_per_page).unwrap();
    let mut a_ref = gpu.new_sequence(2 * z.rows_per_page).unwrap();
    prefill(&mut gpu, &mut a, &toks);
    prefill(&mut gpu, &mut a_ref, &toks);
    let before = in_use(&gpu);
    let mut b = a.try_clone().unwrap();
    assert_eq!(in_use(&gpu) - before, z.slot, "the clone shares every page, the partly filled last one included");
    // Each holds half of the pages they share, so their figures add up to what they hold.
    assert_eq!((a.memory_bytes(), b.memory_bytes()), (z.slot + 2 * z.page + 8, z.slot + 2 * z.page + 8));
    let mut b_ref = gpu.new_sequence(2 * z.rows_per_page).unwrap();
    prefill(&mut gpu, &mut b_ref, &toks);
    // Source and clone step in turn with different tokens, each into its own last page; each
    // must match its unshared twin bit for bit.
    for i in 0..24u32 {
        let (x, y) = (3 + i, 1000 + 7 * i);
        let la = gpu.forward(&mut a, &[x], LogitsWanted::Last).unwrap();
        let lb = gpu.forward(&mut b, &[y], LogitsWanted::Last).unwrap();
        assert_eq!(la, gpu.forward(&mut a_ref, &[x], LogitsWanted::Last).unwrap(), "source diverged at step {i}");
        assert_eq!(lb, gpu.forward(&mut b_ref, &[y], LogitsWanted::Last).unwrap(), "clone diverged at step {i}");
    }
    // The clone's first step took a last page of its own for each cache; the full ones stay shared.
    assert_eq!((a.memory_bytes(), b.memory_bytes()), (z.slot + 3 * z.page + 8, z.slot + 3 * z.page + 8));
    // The clone keeps the shared pages alive once its source is gone.
    drop(a);
    drop(a_ref);
    assert_eq!(b.memory_bytes(), z.slot + 4 * z.page + 8, "alone, the clone holds the shared pages whole");
    let lb = gpu.forward(&mut b, &[5], LogitsWanted::Last).unwrap();
    assert_eq!(lb, gpu.forward(&mut b_ref, &[5], LogitsWanted::Last).unwrap());
    drop(b);
    drop(b_ref);
    assert_eq!(in_use(&gpu), 0);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_snapshots_hold_pages_unmapped_and_their_copies_continue_exactly() {
    let mut gpu = cuda(None);
    let z = sizes(&gpu);
    let vocab = gpu.config().vocab_size;
    let toks = contract_prompt(2 * z.rows_per_page, vocab);
    let n = z.rows_per_page + 100;
    let fresh = |gpu: &mut CudaBackend, k: usize| prefilled(gpu, &toks[..k], 2 * z.rows_per_page);
    // A snapshot, a snapshot of the snapshot, and the source gone before either continues.
    let a = fresh(&mut gpu, n);
    let before = in_use(&gpu);
    let s = a.try_clone().unwrap();
    let mut s2 = s.try_clone().unwrap();
    assert_eq!(in_use(&gpu) - before, 2 * z.slot, "each copy owns a state slot and shares every page");
    drop(a);
    let mut s = s;
    let mut twin = fresh(&mut gpu, n);
    for i in 0..8u32 {
        let t = 11 + 5 * i;
        let (got, want) = (gpu.forward(&mut s2, &[t], LogitsWanted::Last).unwrap(), gpu.forward(&mut twin, &[t], LogitsWanted::Last).unwrap());
        assert_eq!(got, want, "the snapshot's snapshot diverged at step {i}");
    }
    // The first snapshot is still whole after its copy continued (its own last page untouched).
    drop(twin);
    let mut twin = fresh(&mut gpu, n);
    let rest = &toks[n..n + 40];
    let (got, want) = (gpu.forward(&mut s, rest, LogitsWanted::Last).unwrap(), gpu.forward(&mut twin, rest, LogitsWanted::Last).unwrap());
    assert_eq!(got, want, "the first snapshot after its copy continued");
    drop((s, s2, twin));
    assert_eq!(in_use(&gpu), 0);

    // A snapshot at a page boundary copies nothing but its state slot.
    let b = fresh(&mut gpu, z.rows_per_page);
    let before = in_use(&gpu);
    let mut c = b.try_clone().unwrap();
    assert_eq!(in_use(&gpu) - before, z.slot, "full pages only: shared, none copied");
    assert_eq!(c.memory_bytes(), z.slot + z.page + 8, "half of each of the two shared pages");
    let mut twin = fresh(&mut gpu, z.rows_per_page);
    let (got, want) = (gpu.forward(&mut c, &toks[5..9], LogitsWanted::Last).unwrap(), gpu.forward(&mut twin, &toks[5..9], LogitsWanted::Last).unwrap());
    assert_eq!(got, want, "a boundary snapshot continues into a page of its own");
    drop((b, c, twin));
    assert_eq!(in_use(&gpu), 0);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_host_copies_restore_sequences_exactly() {
    let mut gpu = cuda(None);
    let z = sizes(&gpu);
    let cfg = gpu.config().clone();
    let toks = contract_prompt(2 * z.rows_per_page, cfg.vocab_size);
    let n = z.rows_per_page + 100;
    let fresh = |gpu: &mut CudaBackend| prefilled(gpu, &toks[..n], 2 * z.rows_per_page);
    // From a running sequence and from a held snapshot (mapped only for the copy).
    let a = fresh(&mut gpu);
    let snap = a.try_clone().unwrap();
    // The third copy started on the copy stream and waited for (the prefix cache's moves ahead).
    let copies = [a.to_host().unwrap(), snap.to_host().unwrap(), snap.start_to_host().unwrap().finish().unwrap()];
    let want = PinnedPool::rounded(z.slot + 2 * n * cfg.kv_dim() * 4);
    assert_eq!((copies[0].bytes(), copies[1].bytes(), copies[2].bytes(), a.host_bytes()), (want, want, want, want));
    drop((a, snap));
    assert_eq!(in_use(&gpu), 0, "host copies hold no device memory");
    for (k, h) in copies.iter().enumerate() {
        let mut s = gpu.restore_sequence(h).unwrap();
        assert_eq!(s.len(), n);
        let mut twin = fresh(&mut gpu);
        for i in 0..6u32 {
            let t = 7 + 13 * i;
            let (got, want) = (gpu.forward(&mut s, &[t], LogitsWanted::Last).unwrap(), gpu.forward(&mut twin, &[t], LogitsWanted::Last).unwrap());
            assert_eq!(got, want, "copy {k} diverged at step {i}");
        }
    }
    assert_eq!(in_use(&gpu), 0);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_budget_refuses_work_that_does_not_fit_and_loses_nothing() {
    // The reference: 100 tokens and one more on an unbounded backend.
    let mut probe = cuda(None);
    let z = sizes(&probe);
    let vocab = probe.config().vocab_size;
    let toks = contract_prompt(z.rows_per_page + 50, vocab);
    let mut r = probe.new_sequence(64 * 1024).unwrap();
    prefill(&mut probe, &mut r, &toks[..100]);
    let want = probe.forward(&mut r, &toks[100..101], LogitsWanted::Last).unwrap();

    // Room for two state slots and four KV pages (one page per cache of two sequences).
    let mut gpu = cuda(Some(2 * z.slot + 4 * z.page));
    let max = 4 * z.rows_per_page;
    let mut s1 = gpu.new_sequence(max).unwrap();
    let mut s2 = gpu.new_sequence(max).unwrap();
    prefill(&mut gpu, &mut s1, &toks[..100]);
    prefill(&mut gpu, &mut s2, &toks[..100]);
    let e = gpu.new_sequence(max).map(|_| ()).unwrap_err();
    assert!(is_memory_full(&e), "no room for a third state slot: {e:#}");
    // Past its first page s2 needs two more pages: refused before any work, s2 unchanged.
    let e = gpu.forward(&mut s2, &toks[100..z.rows_per_page + 10], LogitsWanted::None).unwrap_err();
    assert!(is_memory_full(&e), "{e:#}");
    assert_eq!(s2.len(), 100);
    let got = gpu.forward(&mut s2, &toks[100..101], LogitsWanted::Last).unwrap();
    assert!(max_abs_diff(&got, &want) <= 1e-5, "a refused sequence continues as if never refused");
    drop(s2);

    // A snapshot of 100 rows shares s1's partly filled pages; its reservation covers the pages of
    // its own its first step takes (the two pages s2 held), so that step cannot run out of memory.
    let mut snap = s1.try_clone().unwrap();
    snap.reserve(101).unwrap();
    let e = s1.reserve(z.rows_per_page + 10).unwrap_err();
    assert!(is_memory_full(&e), "the snapshot's reservation is not s1's to take: {e:#}");
    let got = gpu.forward(&mut snap, &toks[100..101], LogitsWanted::Last).unwrap();
    assert!(max_abs_diff(&got, &want) <= 1e-5, "the snapshot continues as its source would");
    drop(snap);
    let mut s2 = gpu.new_sequence(max).unwrap();
    prefill(&mut gpu, &mut s2, &toks[..100]);

    // A reservation holds room for its sequence alone.
    assert!(is_memory_full(&s1.reserve(2 * z.rows_per_page).unwrap_err()));
    drop(s2);
    s1.reserve(2 * z.rows_per_page).unwrap();
    let mut s3 = gpu.new_sequence(max).unwrap();
    let e = gpu.forward(&mut s3, &toks[..100], LogitsWanted::None).unwrap_err();
    assert!(is_memory_full(&e), "s1's reservation is not s3's to take: {e:#}");
    assert_eq!(s3.len(), 0);
    prefill(&mut gpu, &mut s1, &toks[100..z.rows_per_page + 10]);
    assert_eq!(s1.memory_bytes(), z.slot + 4 * z.page + 8, "s1 grew into its reservation");
    drop(s1);

    // s4 holds one page per cache, s3 the last two: greedy decode of s3 that runs past its page
    // stops there, with every fed step's token delivered.
    let mut s4 = gpu.new_sequence(max).unwrap();
    prefill(&mut gpu, &mut s4, &toks[..100]);
    prefill(&mut gpu, &mut s3, &toks[..100]);
    let room = z.rows_per_page - s3.len();
    let mut got = Vec::new();
    let e = gpu
        .decode_greedy(&mut s3, 7, room + 20, &mut |t| {
            got.push(t);
            true
        })
        .unwrap_err();
    assert!(is_memory_full(&e), "{e:#}");
    assert_eq!(s3.len(), z.rows_per_page, "every mapped position was fed, none beyond");
    assert_eq!(got.len(), room);

    // A batch stops before the step in which a row cannot grow.
    let mut rows = vec![
        BatchRow { seq: &mut s4, first_token: 1, max_tokens: 4, sampler: greedy() },
        BatchRow { seq: &mut s3, first_token: 2, max_tokens: 4, sampler: greedy() },
    ];
    let e = gpu.decode_batch(&mut rows, &mut |_: usize, _: u32| true).unwrap_err();
    assert!(is_memory_full(&e), "{e:#}");
    assert_eq!((s4.len(), s3.len()), (100, z.rows_per_page));
}

fn greedy() -> SamplerSnapshot {
    SamplerSnapshot { params: SamplingParams::greedy(), seed: 0, counts: vec![] }
}
