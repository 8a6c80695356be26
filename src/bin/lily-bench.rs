//! lily-bench: the measurement contract of the original Lily report, on any backend.
//!
//! Batch 1, greedy; prompt token i = ((i * 2654435761) mod 2^32) mod vocab_size; one process
//! per (context) arm; an exact-shape warmup; one measured prefill that ends when the first
//! token is known (TTFT-style); exactly `--decode-steps` measured decode steps; the 64-bit
//! FNV-1a digest of the decode tokens. Prints one JSON line to stdout (and `--json-out`).

use anyhow::{bail, Context, Result};
use clap::Parser;
use lily::backend::{open_backend, Backend, BackendKind, KvCache, LogitsWanted, Sequence};
use lily::engine::sampling::{Sampler, SamplingArgs, SamplingParams};
use lily::checkpoint::Checkpoint;
use lily::engine::contract::{contract_prompt, token_digest};
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
    #[arg(long)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    /// Capacity of the measured sequence (default: prompt + decode steps + 1). A larger value
    /// allocates the whole KV cache for it up front, e.g. 262144 to show the longest context fits.
    #[arg(long)]
    max_seq: Option<usize>,
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
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("lily-bench: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if args.prompt_len == 0 || args.decode_steps == 0 {
        bail!("--prompt-len and --decode-steps must be positive");
    }
    let dir = lily::engine::default_model::resolve_model(args.model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let mut backend = open_backend(args.backend, &ck)?;
    if let Some(kv) = args.kv_cache {
        kv.apply(backend.as_mut());
    }
    let kv_cache = if backend.kv_bf16() { "bf16" } else { "f32" };
    let vocab = backend.config().vocab_size;
    let needed = args.prompt_len.checked_add(args.decode_steps + 1).context("context too large")?;
    let max_seq = args.max_seq.unwrap_or(needed);
    if max_seq < needed {
        bail!("--max-seq {max_seq} is smaller than prompt + decode steps + 1 = {needed}");
    }
    // Device memory is sampled outside the timed regions: after loading, with the warmup
    // sequence alive, and with the measured sequence alive at the end.
    let mut mem_samples = Vec::new();
    mem_samples.extend(backend.device_memory());
    let prompt = contract_prompt(args.prompt_len, vocab);

    // The last prompt token goes through the decode path (Backend::decode_greedy or
    // decode_sampled), so the first generated token comes out of the same pipelined loop as the
    // decode tokens.
    let params = SamplingParams { seed: Some(args.sampling.seed.unwrap_or(0)), ..args.sampling.params().map_err(anyhow::Error::msg)? };
    let mut sampler = Sampler::new(params.clone());
    let snap = (!sampler.is_plain_greedy()).then(|| sampler.snapshot());
    let decode = |backend: &mut dyn Backend, seq: &mut Sequence, first: u32, steps: usize, on_token: &mut dyn FnMut(u32) -> bool| match &snap {
        None => backend.decode_greedy(seq, first, steps, on_token),
        Some(s) => backend.decode_sampled(seq, first, steps, s, on_token),
    };
    let (prefix, last_prompt) = prompt.split_at(args.prompt_len - 1);
    let last_prompt = last_prompt[0];
    if !args.no_warmup {
        let mut warm = backend.new_sequence(max_seq)?;
        if !prefix.is_empty() {
            backend.forward(&mut warm, prefix, LogitsWanted::None)?;
        }
        decode(backend.as_mut(), &mut warm, last_prompt, 3, &mut |_| true)?;
        mem_samples.extend(backend.device_memory());
    }

    let mut seq = backend.new_sequence(max_seq)?;
    let mut tokens = Vec::with_capacity(args.decode_steps);
    let mut steps = Vec::with_capacity(args.decode_steps);
    let mut first = None;
    let mut prefill_secs = 0.0;
    let t0 = Instant::now();
    let mut t1 = t0;
    let mut last = t0;
    if !prefix.is_empty() {
        backend.forward(&mut seq, prefix, LogitsWanted::None)?;
    }
    // Token 0 ends the prefill (TTFT-style; step 1 is already queued then); tokens 1..=N are the
    // N measured decode steps.
    let produced = decode(backend.as_mut(), &mut seq, last_prompt, args.decode_steps + 1, &mut |t| {
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
    let device_memory = match (mem_samples.first(), mem_samples.iter().map(|m| m.0).max()) {
        (Some(&(loaded, total)), Some(peak)) => {
            json!({"total_bytes": total, "used_after_load_bytes": loaded, "used_max_sampled_bytes": peak})
        }
        _ => serde_json::Value::Null,
    };
    let decode_secs = last.duration_since(t1).as_secs_f64();
    let digest = format!("{:016x}", token_digest(&tokens));
    let line = json!({
        "schema_version": 1,
        "engine": "lily",
        "backend": backend.name(),
        "source_id": option_env!("LILY_BENCH_SOURCE_ID").unwrap_or("unknown"),
        "model": dir.display().to_string(),
        "prompt_len": args.prompt_len,
        "prompt_kind": "u32_golden_ratio_hash_mod_vocab",
        "decode_steps": args.decode_steps,
        "warmup": !args.no_warmup,
        "prefill": {"wall_secs": prefill_secs, "tok_s": args.prompt_len as f64 / prefill_secs, "first_token_id": first},
        "decode": {"wall_secs": decode_secs, "tok_s": args.decode_steps as f64 / decode_secs, "step_wall_secs": steps, "token_digest": digest, "token_ids": tokens},
        "max_seq": max_seq,
        "kv_cache": kv_cache,
        "sampling": if snap.is_some() { json!({"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty, "seed": params.seed}) } else { json!("greedy") },
        "sequence_state_bytes": seq.memory_bytes(),
        "device_memory": device_memory,
    });
    let text = serde_json::to_string(&line)?;
    println!("{text}");
    eprintln!(
        "lily-bench: {} prompt {} -> prefill {:.1} tok/s, decode {:.2} tok/s, digest {digest}",
        backend.name(),
        args.prompt_len,
        args.prompt_len as f64 / prefill_secs,
        args.decode_steps as f64 / decode_secs
    );
    if let Some(peak) = mem_samples.iter().map(|m| m.0).max() {
        eprintln!("lily-bench: device memory in use: {:.2} GiB after loading, {:.2} GiB at most (max-seq {max_seq})", mem_samples[0].0 as f64 / (1u64 << 30) as f64, peak as f64 / (1u64 << 30) as f64);
    }
    if let Some(p) = args.json_out {
        std::fs::write(&p, text + "\n").with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
