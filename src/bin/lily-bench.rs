//! lily-bench: the measurement contract of the original Lily report, on any backend.
//!
//! Batch 1, greedy; prompt token i = ((i * 2654435761) mod 2^32) mod vocab_size; one process
//! per (context) arm; an exact-shape warmup; one measured prefill that ends when the first
//! token is known (TTFT-style); exactly `--decode-steps` measured decode steps; the 64-bit
//! FNV-1a digest of the decode tokens. Prints one JSON line to stdout (and `--json-out`).

use anyhow::{bail, Context, Result};
use clap::Parser;
use lily::backend::{open_backend, BackendKind, LogitsWanted};
use lily::checkpoint::Checkpoint;
use lily::engine::sampling::argmax;
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
    /// Skip the exact-shape warmup (CPU smoke runs in CI).
    #[arg(long)]
    no_warmup: bool,
    /// Also write the JSON line here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

/// The contract's deterministic prompt.
fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (((i * 2_654_435_761) % (1u64 << 32)) % vocab as u64) as u32).collect()
}

/// 64-bit FNV-1a over whole u32 token values.
fn fnv1a(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf29ce484222325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100000001b3))
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
    let vocab = backend.config().vocab_size;
    let max_seq = args.prompt_len.checked_add(args.decode_steps + 1).context("context too large")?;
    let prompt = prompt_tokens(args.prompt_len, vocab);

    if !args.no_warmup {
        let mut warm = backend.new_sequence(max_seq)?;
        let logits = backend.forward(&mut warm, &prompt, LogitsWanted::Last)?;
        let t = argmax(&logits);
        let logits = backend.forward(&mut warm, &[t], LogitsWanted::Last)?;
        backend.forward(&mut warm, &[argmax(&logits)], LogitsWanted::Last)?;
    }

    let mut seq = backend.new_sequence(max_seq)?;
    let t0 = Instant::now();
    let logits = backend.forward(&mut seq, &prompt, LogitsWanted::Last)?;
    let first = argmax(&logits);
    let prefill_secs = t0.elapsed().as_secs_f64();

    let mut tokens = Vec::with_capacity(args.decode_steps);
    let mut steps = Vec::with_capacity(args.decode_steps);
    let mut cur = first;
    let t1 = Instant::now();
    let mut last = t1;
    for _ in 0..args.decode_steps {
        let logits = backend.forward(&mut seq, &[cur], LogitsWanted::Last)?;
        cur = argmax(&logits);
        tokens.push(cur);
        let now = Instant::now();
        steps.push(now.duration_since(last).as_secs_f64());
        last = now;
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    let digest = format!("{:016x}", fnv1a(&tokens));
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
        "sequence_state_bytes": seq.memory_bytes(),
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
    if let Some(p) = args.json_out {
        std::fs::write(&p, text + "\n").with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_prompt_and_digest() {
        let p = prompt_tokens(4, 248_320);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], (2_654_435_761u64 % 248_320) as u32);
        assert_eq!(fnv1a(&[]), 0xcbf29ce484222325);
        assert_eq!(fnv1a(&[1]), (0xcbf29ce484222325u64 ^ 1).wrapping_mul(0x100000001b3));
    }
}
