//! lily-bench: the measurement contract of the original Lily report, on any backend.
//!
//! Batch 1, greedy; prompt token i = ((i * 2654435761) mod 2^32) mod vocab_size; one process
//! per (context) arm; an exact-shape warmup; one measured prefill that ends when the first
//! token is known (TTFT-style); exactly `--decode-steps` measured decode steps; the 64-bit
//! FNV-1a digest of the decode tokens. Prints one JSON line to stdout (and `--json-out`).
//!
//! `--batch N`: N distinct prompts (consecutive slices of the contract sequence), each
//! prefilled, then decoded together by `Backend::decode_batch`: the prefill phase ends when every
//! sequence's first token is known, the decode phase is the next `--decode-steps` batch steps;
//! reports the aggregate and per-sequence decode rates and a digest per sequence.

use anyhow::{bail, Context, Result};
use clap::Parser;
use lily::backend::cuda::CudaOptions;
use lily::backend::{open_backend_with, BackendKind, KvCache};
use lily::engine::sampling::{Sampler, SamplingArgs, SamplingParams};
use lily::checkpoint::Checkpoint;
use lily::engine::contract::{contract_prompt, token_digest};
use lily::synth::{synthesize, Preset};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Benchmark prefill and decode of one context length (fresh process per arm)")]
struct Args {
    /// Checkpoint directory (default: the embedded tiny synthetic checkpoint).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt length (the context before decoding).
    #[arg(long, required_unless_present_any = ["synth_preset", "handover"])]
    prompt_len: Option<usize>,
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Sequences decoded together (`Backend::decode_batch`); without it, the single-sequence
    /// decode path of batch 1.
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    /// Capacity of the measured sequence (default: prompt + decode steps + 1). Its KV memory is
    /// reserved up front (CUDA: mapped as it grows), e.g. 262144 to show the longest context fits.
    #[arg(long)]
    max_seq: Option<usize>,
    /// CUDA: share of the device's memory for weights, scratch and sequences
    /// (default LILY_GPU_MEMORY_FRACTION or 0.9).
    #[arg(long, value_parser = lily::backend::cuda::options::parse_memory_fraction)]
    gpu_memory_fraction: Option<f64>,
    /// Attention KV cache element: bf16 or f32 (default: the backend's, CUDA bf16 and CPU f32,
    /// or LILY_KV_BF16). Reported as `kv_cache`.
    #[arg(long, value_enum)]
    kv_cache: Option<KvCache>,
    /// Sampling instead of greedy decoding (--temperature > 0 or a penalty), on the device where
    /// the backend can; reported as `sampling`. Without --seed the seed is 0.
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Skip the exact-shape warmup (CPU smoke runs in CI).
    #[arg(long)]
    no_warmup: bool,
    /// Also write the JSON line here.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// First write this preset's synthetic checkpoint (seed 0, as `lily synth --preset` does) to
    /// --model when it holds no config.json; without --prompt-len, only that. A GPU machine's
    /// call then needs no `lily` binary for its checkpoint.
    #[arg(long, requires = "model")]
    synth_preset: Option<Preset>,
    /// Instead of a model: the decode hand-over microbenchmark on the GPU (a JSON line per chain
    /// and way; docs/cuda.md, "Toward a persistent decode kernel").
    #[arg(long, conflicts_with_all = ["prompt_len", "batch", "synth_preset"])]
    handover: bool,
}

impl Args {
    fn prompt_len(&self) -> usize {
        self.prompt_len.unwrap_or(0)
    }
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("lily-bench: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if args.handover {
        return handover::sweep(args.json_out.as_deref());
    }
    if let (Some(preset), Some(dir)) = (args.synth_preset, &args.model) {
        if !dir.join("config.json").exists() {
            eprintln!("lily-bench: writing the {preset} synthetic checkpoint to {}", dir.display());
            synthesize(&preset.config(), dir, 0, false)?;
        }
        if args.prompt_len.is_none() {
            return Ok(());
        }
    }
    if args.prompt_len() == 0 || args.decode_steps == 0 {
        bail!("--prompt-len and --decode-steps must be positive");
    }
    if args.batch == Some(0) {
        bail!("--batch must be positive");
    }
    let dir = lily::engine::default_model::resolve_model(args.model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let mut opts = CudaOptions::from_env();
    opts.memory_fraction = args.gpu_memory_fraction.unwrap_or(opts.memory_fraction);
    let gdn_state_f16 = opts.gdn_state_f16;
    let mut backend = open_backend_with(args.backend, &ck, opts)?;
    if let Some(kv) = args.kv_cache {
        kv.apply(backend.as_mut());
    }
    let kv_cache = if backend.kv_bf16() { "bf16" } else { "f32" };
    let vocab = backend.config().vocab_size;
    let needed = args.prompt_len().checked_add(args.decode_steps + 1).context("context too large")?;
    let max_seq = args.max_seq.unwrap_or(needed);
    if max_seq < needed {
        bail!("--max-seq {max_seq} is smaller than prompt + decode steps + 1 = {needed}");
    }
    // Device memory is sampled outside the timed regions: after loading, with the warmup
    // sequence alive, and with the measured sequence alive at the end.
    let mut mem_samples = Vec::new();
    mem_samples.extend(backend.device_memory());
    let params = SamplingParams { seed: Some(args.sampling.seed.unwrap_or(0)), ..args.sampling.params().map_err(anyhow::Error::msg)? };
    let common = json!({
        "schema_version": 1,
        "engine": "lily",
        "backend": backend.name(),
        "source_id": option_env!("LILY_BENCH_SOURCE_ID").unwrap_or("unknown"),
        "model": dir.display().to_string(),
        "prompt_len": args.prompt_len(),
        "prompt_kind": "u32_golden_ratio_hash_mod_vocab",
        "decode_steps": args.decode_steps,
        "warmup": !args.no_warmup,
        "max_seq": max_seq,
        "kv_cache": kv_cache,
        // The CPU reference keeps f32 states whatever the CUDA options say.
        "gdn_state": if gdn_state_f16 && backend.name() == "cuda" { "f16" } else { "f32" },
        "sampling": sampling_json(&params),
    });
    if let Some(n) = args.batch {
        let line = batch::run(backend.as_mut(), &args, n, max_seq, &params, mem_samples)?;
        return emit(common, line, args.json_out.as_deref());
    }
    let prompt = contract_prompt(args.prompt_len(), vocab);

    // The whole prompt goes through `Backend::decode_after`, as the server feeds a prompt that
    // decodes alone: the first token is chosen from the prefill's last row, and the decode
    // tokens come out of the same pipelined loop after it.
    let mut sampler = Sampler::new(params.clone());
    let snap = (!sampler.is_plain_greedy()).then(|| sampler.snapshot());
    if !args.no_warmup {
        let mut warm = backend.new_sequence(max_seq)?;
        backend.decode_after(&mut warm, &prompt, 3, snap.as_ref(), &mut |_| true)?;
        mem_samples.extend(backend.device_memory());
    }

    let mut seq = backend.new_sequence(max_seq)?;
    seq.reserve(max_seq)?;
    let mut tokens = Vec::with_capacity(args.decode_steps);
    let mut steps = Vec::with_capacity(args.decode_steps);
    let mut first = None;
    let mut prefill_secs = 0.0;
    let t0 = Instant::now();
    let mut t1 = t0;
    let mut last = t0;
    // Token 0 ends the prefill (TTFT-style; step 1 is already queued then); tokens 1..=N are the
    // N measured decode steps.
    let produced = backend.decode_after(&mut seq, &prompt, args.decode_steps + 1, snap.as_ref(), &mut |t| {
        let now = Instant::now();
        if first.is_none() {
            first = Some(t);
            prefill_secs = now.duration_since(t0).as_secs_f64();
            t1 = now;
        } else {
            tokens.push(t);
            steps.push(now.duration_since(last).as_secs_f64());
        }
        last = now;
        true
    })?;
    if produced != args.decode_steps + 1 || tokens.len() != args.decode_steps {
        bail!("decode stopped after {produced} tokens");
    }
    mem_samples.extend(backend.device_memory());
    let first = first.unwrap_or(0);
    let decode_secs = last.duration_since(t1).as_secs_f64();
    let digest = format!("{:016x}", token_digest(&tokens));
    eprintln!(
        "lily-bench: {} prompt {} -> prefill {:.1} tok/s, decode {:.2} tok/s, digest {digest}",
        backend.name(),
        args.prompt_len(),
        args.prompt_len() as f64 / prefill_secs,
        args.decode_steps as f64 / decode_secs
    );
    let line = json!({
        "prefill": {"wall_secs": prefill_secs, "tok_s": args.prompt_len() as f64 / prefill_secs, "first_token_id": first},
        "decode": {"wall_secs": decode_secs, "tok_s": args.decode_steps as f64 / decode_secs, "step_wall_secs": steps, "token_digest": digest, "token_ids": tokens},
        "sequence_state_bytes": seq.memory_bytes(),
        "sequence_memory": backend.sequence_memory(),
        "device_memory": device_memory_json(&mem_samples, max_seq),
    });
    emit(common, line, args.json_out.as_deref())
}

/// The sampling settings as reported: "greedy", or the parameters.
fn sampling_json(params: &SamplingParams) -> serde_json::Value {
    if params.is_plain_greedy() {
        json!("greedy")
    } else {
        json!({"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty, "seed": params.seed})
    }
}

/// Device memory samples (in use, total) as reported, also printed to stderr.
fn device_memory_json(samples: &[(u64, u64)], max_seq: usize) -> serde_json::Value {
    match (samples.first(), samples.iter().map(|m| m.0).max()) {
        (Some(&(loaded, total)), Some(peak)) => {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            eprintln!("lily-bench: device memory in use: {:.2} GiB after loading, {:.2} GiB at most (max-seq {max_seq})", gib(loaded), gib(peak));
            json!({"total_bytes": total, "used_after_load_bytes": loaded, "used_max_sampled_bytes": peak})
        }
        _ => serde_json::Value::Null,
    }
}

/// Prints the JSON line (`common` fields, then the arm's) and writes it to `json_out`.
fn emit(common: serde_json::Value, arm: serde_json::Value, json_out: Option<&std::path::Path>) -> Result<()> {
    let mut line = common;
    if let (Some(m), serde_json::Value::Object(extra)) = (line.as_object_mut(), arm) {
        m.extend(extra);
    }
    let text = serde_json::to_string(&line)?;
    println!("{text}");
    if let Some(p) = json_out {
        std::fs::write(p, text + "\n").with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// `--batch N`: N prompts prefilled, then decoded together.
mod batch {
    use super::Args;
    use anyhow::{bail, Result};
    use lily::backend::{Backend, BatchRow, PrefillPiece, Sequence};
    use lily::engine::contract::{batch_prompt, token_digest};
    use lily::engine::sampling::{Sampler, SamplingParams};
    use serde_json::json;
    use std::time::Instant;

    /// The N prompts' sequences prefilled up to their last token (returned beside them), all in
    /// one `prefill_pieces` call as the server's prefill rounds do.
    fn prefilled(backend: &mut dyn Backend, n: usize, len: usize, max_seq: usize) -> Result<Vec<(Sequence, u32)>> {
        let vocab = backend.config().vocab_size;
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| batch_prompt(i, len, vocab)).collect();
        let mut seqs = (0..n).map(|_| backend.new_sequence(max_seq)).collect::<Result<Vec<_>>>()?;
        if len > 1 {
            let mut pieces: Vec<PrefillPiece> = seqs.iter_mut().zip(&prompts).map(|(seq, p)| PrefillPiece { seq, tokens: &p[..len - 1] }).collect();
            backend.prefill_pieces(&mut pieces).into_iter().collect::<Result<Vec<()>>>()?;
        }
        Ok(seqs.into_iter().zip(prompts).map(|(seq, p)| (seq, p[len - 1])).collect())
    }

    /// Row i samples with seed + i (distinct streams, reproducible).
    fn rows<'a>(seqs: &'a mut [(Sequence, u32)], steps: usize, params: &SamplingParams) -> Vec<BatchRow<'a>> {
        seqs.iter_mut()
            .enumerate()
            .map(|(i, (seq, first))| {
                let p = SamplingParams { seed: Some(params.seed.unwrap_or(0) + i as u64), ..params.clone() };
                BatchRow { seq, first_token: *first, max_tokens: steps, sampler: Sampler::new(p).snapshot() }
            })
            .collect()
    }

    pub fn run(backend: &mut dyn Backend, args: &Args, n: usize, max_seq: usize, params: &SamplingParams, mut mem: Vec<(u64, u64)>) -> Result<serde_json::Value> {
        let len = args.prompt_len();
        if !args.no_warmup {
            let mut warm = prefilled(backend, n, len, max_seq)?;
            backend.decode_batch(&mut rows(&mut warm, 3, params), &mut |_: usize, _: u32| true)?;
            mem.extend(backend.device_memory());
        }
        let t0 = Instant::now();
        let mut seqs = prefilled(backend, n, len, max_seq)?;
        // Step 0 gives every sequence its first token (the end of the prefill phase); steps
        // 1..=decode_steps are measured. A step ends with its last row's token.
        let mut tokens = vec![Vec::with_capacity(args.decode_steps + 1); n];
        let mut step_ends = Vec::with_capacity(args.decode_steps + 1);
        let produced = backend.decode_batch(&mut rows(&mut seqs, args.decode_steps + 1, params), &mut |i: usize, t: u32| {
            tokens[i].push(t);
            if i + 1 == n {
                step_ends.push(Instant::now());
            }
            true
        })?;
        if produced.iter().any(|&p| p != args.decode_steps + 1) || step_ends.len() != args.decode_steps + 1 {
            bail!("batched decode stopped early ({produced:?} tokens per sequence)");
        }
        mem.extend(backend.device_memory());
        let prefill_secs = step_ends[0].duration_since(t0).as_secs_f64();
        let decode_secs = step_ends[args.decode_steps].duration_since(step_ends[0]).as_secs_f64();
        let step_secs: Vec<f64> = step_ends.windows(2).map(|w| w[1].duration_since(w[0]).as_secs_f64()).collect();
        let firsts: Vec<u32> = tokens.iter().map(|t| t[0]).collect();
        let decoded: Vec<Vec<u32>> = tokens.into_iter().map(|t| t[1..].to_vec()).collect();
        let digests: Vec<String> = decoded.iter().map(|t| format!("{:016x}", token_digest(t))).collect();
        let aggregate = (n * args.decode_steps) as f64 / decode_secs;
        eprintln!(
            "lily-bench: {} batch {n} x prompt {len} -> prefill {:.1} tok/s, decode {:.1} tok/s aggregate ({:.2} per sequence)",
            backend.name(),
            (n * len) as f64 / prefill_secs,
            aggregate,
            aggregate / n as f64
        );
        Ok(json!({
            "batch": n,
            "prefill": {"wall_secs": prefill_secs, "tok_s": (n * len) as f64 / prefill_secs, "first_token_ids": firsts},
            "decode": {
                "wall_secs": decode_secs,
                "aggregate_tok_s": aggregate,
                "tok_s": aggregate / n as f64,
                "step_wall_secs": step_secs,
                "token_digest": digests[0],
                "token_digests": digests,
                "token_ids": decoded,
            },
            "sequence_state_bytes": seqs.iter().map(|(s, _)| s.memory_bytes()).sum::<usize>(),
            "sequence_memory": backend.sequence_memory(),
            "device_memory": super::device_memory_json(&mem, max_seq),
        }))
    }
}

/// `--handover`: one dependent hand-over between decode phases, as a programmatic-dependent kernel
/// boundary and as a readiness flag inside a persistent kernel (lily::backend::cuda::handover).
mod handover {
    use anyhow::{bail, Context, Result};
    use lily::backend::cuda::handover::{Chain, HandoverBench, Way};
    use lily::backend::cuda::Gpu;
    use serde_json::json;
    use std::io::Write;

    /// (rows, columns) of a phase's bf16 weights: the router's half megabyte, an out-projection's
    /// ~4 MB, an in-projection's ~14 MB.
    const SHAPES: [(usize, usize); 3] = [(1024, 256), (2048, 1024), (2048, 3584)];
    /// Weight bytes a chain streams at least (past the 50 MB L2, so every phase reads DRAM).
    const CHAIN_BYTES: usize = 256 << 20;
    const WAYS: [Way; 5] = [
        Way::Launches { prefetch: true },
        Way::Launches { prefetch: false },
        Way::Persistent { prefetch: true, wait: true },
        Way::Persistent { prefetch: false, wait: true },
        Way::Persistent { prefetch: true, wait: false },
    ];

    pub fn sweep(json_out: Option<&std::path::Path>) -> Result<()> {
        let gpu = Gpu::open(0, true)?;
        let resident = HandoverBench::resident_blocks(&gpu)?;
        let mut out = match json_out {
            Some(p) => Some(std::fs::File::create(p).with_context(|| format!("cannot write {}", p.display()))?),
            None => None,
        };
        let sms = gpu.sms as usize;
        for (rows, cols) in SHAPES {
            let phases = CHAIN_BYTES.div_ceil(rows * cols * 2).clamp(32, 512);
            let mut bench = HandoverBench::new(&gpu, Chain { rows, cols, phases, blocks: sms, neighbour: false })?;
            for blocks in [sms, 2 * sms].into_iter().filter(|&b| b <= resident) {
                for neighbour in [false, true] {
                    bench.set_grid(blocks, neighbour)?;
                    let mut chain_digest = None;
                    for way in WAYS {
                        let m = bench.run(way, 2, 5)?;
                        let waits = !matches!(way, Way::Persistent { wait: false, .. });
                        if waits {
                            match chain_digest {
                                None => chain_digest = Some(m.digest),
                                Some(d) if d != m.digest => bail!("{} gave other bits than launches ({rows}x{cols}, {blocks} blocks)", way.label()),
                                Some(_) => {}
                            }
                        }
                        let c = bench.chain();
                        eprintln!(
                            "lily-bench: handover {rows}x{cols} ({:.2} MB) x {phases}, {blocks} blocks{}, {}: {:.2} us per phase, {:.2} TB/s",
                            c.phase_bytes() as f64 / 1e6,
                            if neighbour { ", neighbour" } else { "" },
                            way.label(),
                            m.us_per_phase,
                            m.tb_per_s
                        );
                        let line = json!({
                            "schema_version": 1,
                            "engine": "lily",
                            "source_id": option_env!("LILY_BENCH_SOURCE_ID").unwrap_or("unknown"),
                            "device": gpu.name,
                            "handover": {
                                "way": way.label(), "rows": rows, "cols": cols, "phase_bytes": c.phase_bytes(),
                                "phases": phases, "blocks": blocks, "neighbour": neighbour,
                                "us_per_phase": m.us_per_phase, "tb_per_s": m.tb_per_s,
                                "digest": format!("{:016x}", m.digest), "chain_result": waits,
                            },
                        });
                        let text = serde_json::to_string(&line)?;
                        println!("{text}");
                        if let Some(f) = out.as_mut() {
                            writeln!(f, "{text}")?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
