//! `lily`: synthesize checkpoints, inspect them, run prompts, serve the OpenAI API.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lily::backend::cuda::CudaOptions;
use lily::backend::{open_backend, open_backend_with, BackendKind, KvCache};
use lily::checkpoint::Checkpoint;
use lily::engine::default_model::resolve_model;
use lily::engine::sampling::SamplingArgs;
use lily::engine::{generate, Next, Sampler};
use lily::synth::{synthesize, Preset};
use lily::tokenizer::{ChatTemplate, StreamDecoder, Tokenizer};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "lily", version, about = "Inference server for Qwen3.6-35B-A3B (MLX 4-bit checkpoints): CUDA on Hopper, CPU reference")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a random-weight checkpoint with the exact MLX 4-bit layout.
    Synth {
        /// tiny (4 layers, real vocabulary, ~40 MB) or 35b-a3b (exact real shapes, ~19.4 GB).
        #[arg(long)]
        preset: Preset,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep only the first N layers (same hybrid pattern and dims): a full-width model small
        /// enough for float32 reference runs.
        #[arg(long)]
        layers: Option<usize>,
    },
    /// Convert a Hugging Face bf16 checkpoint (Qwen3.5/3.6 MoE family, fused experts) into the
    /// MLX affine 4-bit layout Lily loads (router and shared-expert gate at 8 bits), tensor for
    /// tensor identical to `mlx_lm.convert -q`; vision and MTP weights are dropped.
    Quantize {
        /// The Hugging Face checkpoint directory (config.json, safetensors shards).
        #[arg(long)]
        hf: PathBuf,
        /// Output directory (must not exist, or be empty).
        #[arg(long)]
        out: PathBuf,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Validate a checkpoint and print its configuration.
    Info {
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Generate text for one prompt, streaming it to stdout.
    Run(RunArgs),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(lily::server::ServeArgs),
    /// Perplexity of a text file (chunks of --ctx tokens, the second half of each scored), with
    /// its uncertainty; --save-logits keeps the scored log-probabilities and --kl-against
    /// compares them with a saved reference run (KL divergence, top-1 agreement). Prints one JSON
    /// line on stdout.
    Perplexity(PerplexityArgs),
    /// Teacher-forced logits of the benchmark prompt (for accuracy comparisons against other
    /// engines): per position the top-20 ids/logits, the logits of a fixed probe set, and the
    /// logsumexp, as JSON (the format of scripts/transformers_goldens.py).
    Logits {
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 192)]
        positions: usize,
        #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
        backend: BackendKind,
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        path: PathArgs,
    },
}

/// Which numerical path `logits` and `perplexity` measure.
#[derive(clap::Args)]
struct PathArgs {
    /// CUDA: every position through the decode step instead of the prefill kernels (measures
    /// the decode kernels on every position).
    #[arg(long)]
    decode_forward: bool,
    /// CUDA: the f32 prefill kernels and f32 GDN states, exact to rounding against the CPU
    /// reference (`--gdn-state` still chooses the states' type).
    #[arg(long)]
    exact_prefill: bool,
    /// Attention KV cache element type (default: the backend's: CUDA bf16, CPU f32).
    #[arg(long, value_enum)]
    kv_cache: Option<KvCache>,
    /// CUDA: the GDN recurrent states' element type (default f16, or LILY_GDN_STATE; f32 with
    /// --exact-prefill).
    #[arg(long, value_enum)]
    gdn_state: Option<GdnState>,
}

/// The GDN recurrent state's element type (`--gdn-state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GdnState {
    F32,
    F16,
}

impl PathArgs {
    /// The backend of `kind` on `ck`, set up for this path.
    fn open(&self, kind: BackendKind, ck: &Checkpoint) -> Result<Box<dyn lily::backend::Backend>> {
        let mut opts = CudaOptions::from_env();
        opts.decode_forward |= self.decode_forward;
        opts.exact_prefill |= self.exact_prefill;
        if self.exact_prefill {
            opts.gdn_state_f16 = false;
        }
        if let Some(s) = self.gdn_state {
            opts.gdn_state_f16 = s == GdnState::F16;
        }
        let mut backend = open_backend_with(kind, ck, opts)?;
        if let Some(kv) = self.kv_cache {
            kv.apply(backend.as_mut());
        }
        Ok(backend)
    }
}

#[derive(clap::Args)]
struct PerplexityArgs {
    /// Checkpoint directory (default: the embedded tiny synthetic checkpoint, random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    /// UTF-8 text to score (tokenized as raw text, no chat template).
    #[arg(long)]
    file: PathBuf,
    /// Tokens per chunk; each chunk is evaluated from an empty context.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// At most this many chunks (default: all).
    #[arg(long, default_value_t = 0)]
    chunks: usize,
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    #[command(flatten)]
    path: PathArgs,
    /// Write the scored positions' log-probabilities here (f16; ~0.5 MB per position).
    #[arg(long)]
    save_logits: Option<PathBuf>,
    /// Compare with a reference run saved by --save-logits (same text, --ctx and --chunks).
    #[arg(long)]
    kl_against: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Checkpoint directory (default: the embedded tiny synthetic checkpoint, random weights).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "Write a haiku about the sea.")]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Feed the prompt as raw text instead of a chat turn.
    #[arg(long)]
    raw: bool,
    /// Render the chat turn with thinking disabled (empty think block).
    #[arg(long)]
    no_think: bool,
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    /// Attention KV cache element type (default: the backend's: CUDA bf16, CPU f32).
    #[arg(long, value_enum)]
    kv_cache: Option<KvCache>,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Synth { preset, out, seed, layers } => cmd_synth(preset, out, seed, layers),
        Command::Info { model } => cmd_info(model),
        Command::Run(args) => cmd_run(args),
        Command::Serve(args) => lily::server::run(args),
        Command::Perplexity(args) => cmd_perplexity(args),
        Command::Quantize { hf, out, quiet } => cmd_quantize(hf, out, quiet),
        Command::Logits { model, positions, backend, out, path } => cmd_logits(model, positions, backend, &path, out),
    };
    if let Err(e) = result {
        eprintln!("lily: error: {e:#}");
        std::process::exit(1);
    }
}

fn cmd_synth(preset: Preset, out: PathBuf, seed: u64, layers: Option<usize>) -> Result<()> {
    let mut cfg = preset.config();
    if let Some(n) = layers {
        if n == 0 || n > cfg.num_layers() {
            bail!("--layers must be between 1 and {}", cfg.num_layers());
        }
        cfg.layer_types.truncate(n);
    }
    eprintln!("lily: writing {preset:?} synthetic checkpoint (seed {seed}) to {}", out.display());
    let report = synthesize(&cfg, &out, seed, true)?;
    eprintln!("lily: {report}");
    Ok(())
}

fn cmd_info(model: Option<PathBuf>) -> Result<()> {
    let dir = resolve_model(model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let c = &ck.config;
    println!("checkpoint   {}", dir.display());
    println!("model        {}", if c.is_35b_a3b() { "Qwen3.6-35B-A3B (exact shapes)" } else { "qwen3_5_moe (custom dims)" });
    println!("layers       {} ({} Gated DeltaNet + {} gated attention)", c.num_layers(), c.layer_types.iter().filter(|k| **k == lily::checkpoint::LayerKind::LinearAttention).count(), c.layer_types.iter().filter(|k| **k == lily::checkpoint::LayerKind::FullAttention).count());
    println!("hidden       {}", c.hidden_size);
    println!("vocab        {}", c.vocab_size);
    println!("attention    {} q heads / {} kv heads x {} dims, rotary {} dims, theta {}", c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim(), c.rope_theta);
    println!("deltanet     {} k heads / {} v heads x {}/{} dims, conv {}", c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim);
    println!("moe          {} experts, top-{}, expert {} / shared {}", c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size);
    println!("max context  {}", c.max_position_embeddings);
    println!("quantization affine {}-bit, group {} (router and shared-expert gate 8-bit)", c.quant.bits, c.quant.group_size);
    println!("eos ids      {:?}", c.eos_token_ids);
    println!("shards       {}", ck.shard_paths().len());
    println!("tensors      {}", ck.tensor_count());
    println!("bytes        {} ({:.2} GB)", ck.total_bytes(), ck.total_bytes() as f64 / 1e9);
    for (dtype, (n, bytes)) in ck.dtype_summary() {
        println!("  {dtype:<5} {n:>6} tensors {:>12.1} MB", bytes as f64 / 1e6);
    }
    Ok(())
}

fn cmd_run(args: RunArgs) -> Result<()> {
    let dir = resolve_model(args.model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let tokenizer = Tokenizer::load(&dir)?;
    let mut backend = open_backend(args.backend, &ck)?;
    if let Some(kv) = args.kv_cache {
        kv.apply(backend.as_mut());
    }
    let text = if args.raw {
        args.prompt.clone()
    } else {
        let template = ChatTemplate::load(&dir)?;
        let messages = serde_json::json!([{"role": "user", "content": args.prompt}]);
        let mut kwargs = serde_json::Map::new();
        if args.no_think {
            kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        }
        template.render(&messages, None, true, &kwargs)?
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let params = args.sampling.params().map_err(anyhow::Error::msg)?;
    let max_seq = prompt.len() + args.max_tokens + 1;
    let mut seq = backend.new_sequence(max_seq)?;
    let mut sampler = Sampler::new(params);
    let eos = ck.config.eos_token_ids.clone();
    let mut stream = StreamDecoder::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let stats = generate(backend.as_mut(), &mut seq, &prompt, args.max_tokens, &mut sampler, &eos, false, |tok, _| {
        let piece = stream.push(&tokenizer, tok);
        if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
            write_error = Some(e);
            return Next::Stop;
        }
        Next::Continue
    })?;
    let tail = stream.finish();
    out.write_all(tail.as_bytes()).ok();
    writeln!(out).ok();
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    eprintln!(
        "\n[{}] prompt {} tokens: prefill {:.1} tok/s | {} generated: decode {:.2} tok/s | finish: {}",
        backend.name(),
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.completion_tokens,
        stats.decode_tok_s(),
        stats.finish.as_openai()
    );
    Ok(())
}

fn cmd_logits(model: Option<PathBuf>, positions: usize, kind: BackendKind, path: &PathArgs, out: PathBuf) -> Result<()> {
    use lily::backend::LogitsWanted;
    let dir = resolve_model(model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let mut backend = path.open(kind, &ck)?;
    let vocab = backend.config().vocab_size;
    // The goldens' prompt: the benchmark formula, kept below the special-token range.
    let ids = lily::engine::contract::contract_prompt(positions, vocab.min(248_044));
    let probes: std::collections::BTreeSet<u32> = (0..256u64).map(|j| ((j * 7919 * 104_729 + 12_345) % vocab as u64) as u32).collect();
    let mut seq = backend.new_sequence(positions + 1)?;
    let t0 = std::time::Instant::now();
    let logits = backend.forward(&mut seq, &ids, LogitsWanted::All)?;
    let secs = t0.elapsed().as_secs_f64();
    let mut rows = Vec::with_capacity(positions);
    for t in 0..positions {
        let row = &logits[t * vocab..(t + 1) * vocab];
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.select_nth_unstable_by(19, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        order.truncate(20);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        rows.push(serde_json::json!({
            "top_ids": order,
            "top_logits": order.iter().map(|&i| row[i as usize]).collect::<Vec<_>>(),
            "probe_logits": probes.iter().map(|&i| row[i as usize]).collect::<Vec<_>>(),
            "logsumexp": lse,
        }));
    }
    let doc = serde_json::json!({
        "source": format!("lily {} backend", backend.name()),
        "checkpoint": dir.display().to_string(),
        "prompt_ids": ids,
        "probe_ids": probes,
        "positions": rows,
        "forward_secs": secs,
    });
    std::fs::write(&out, serde_json::to_string(&doc)?).with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("lily: wrote {} positions of logits to {} ({:.1} s forward)", positions, out.display(), secs);
    Ok(())
}

fn cmd_quantize(hf: PathBuf, out: PathBuf, quiet: bool) -> Result<()> {
    let r = lily::quantize::quantize_checkpoint(&hf, &out, !quiet)?;
    eprintln!(
        "lily: wrote {}: {} tensors, {:.3} GB in {} shard(s) in {:.1} s",
        r.dir.display(),
        r.tensors,
        r.bytes as f64 / 1e9,
        r.shards,
        r.seconds
    );
    Ok(())
}

fn cmd_perplexity(args: PerplexityArgs) -> Result<()> {
    use lily::engine::perplexity::{divergence, evaluate, LogProbFile, LogProbWriter, PplConfig};
    let dir = resolve_model(args.model.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {} as UTF-8 text", args.file.display()))?;
    let tokens = Tokenizer::load(&dir)?.encode(&text)?;
    let mut backend = args.path.open(args.backend, &ck)?;
    let cfg = PplConfig { ctx: args.ctx, max_chunks: args.chunks };
    let n_chunks = lily::engine::perplexity::chunks(tokens.len(), cfg)?.len();
    eprintln!(
        "lily: perplexity of {} ({} tokens) on {}: {n_chunks} chunks of {} tokens, the last {} predictions of each scored",
        args.file.display(),
        tokens.len(),
        backend.name(),
        args.ctx,
        args.ctx - 1 - lily::engine::perplexity::first_scored(args.ctx)
    );
    // The run's log-probabilities: where asked, else a temporary file when comparing.
    let tmp = std::env::temp_dir().join(format!("lily-ppl-{}.logp", std::process::id()));
    let save_path = args.save_logits.clone().or_else(|| args.kl_against.as_ref().map(|_| tmp.clone()));
    let mut writer = save_path.as_deref().map(|p| LogProbWriter::create(p, backend.config().vocab_size)).transpose()?;
    let t0 = std::time::Instant::now();
    let result = evaluate(backend.as_mut(), &tokens, cfg, writer.as_mut(), |i, p| eprint!("[{}]{:.4},", i + 1, p.ppl));
    eprintln!();
    let (ppl, scored) = result?;
    if let Some(w) = writer {
        w.finish()?;
    }
    let top1 = scored.iter().filter(|s| s.argmax == s.token).count() as f64 / scored.len().max(1) as f64;
    eprintln!(
        "lily: PPL = {:.4} +/- {:.4} over {} scored tokens (mean NLL {:.5}, {:.1} s)",
        ppl.ppl,
        ppl.ppl_stderr,
        ppl.tokens_scored,
        ppl.mean_nll,
        t0.elapsed().as_secs_f64()
    );
    let mut line = json!({
        "file": args.file.display().to_string(),
        "model": dir.display().to_string(),
        "backend": backend.name(),
        "kv_cache": if backend.kv_bf16() { "bf16" } else { "f32" },
        "ctx": args.ctx,
        "chunks": n_chunks,
        "tokens_scored": ppl.tokens_scored,
        "ppl": ppl.ppl,
        "ppl_stderr": ppl.ppl_stderr,
        "mean_nll": ppl.mean_nll,
        "nll_stderr": ppl.nll_stderr,
        "top1_is_next_token": top1,
    });
    if let Some(reference) = &args.kl_against {
        let cmp = LogProbFile::read(reference).and_then(|r| Ok((r, LogProbFile::read(save_path.as_deref().expect("set with --kl-against"))?)));
        if args.save_logits.is_none() {
            let _ = std::fs::remove_file(&tmp);
        }
        let (r, this) = cmp?;
        let d = divergence(&r, &this)?;
        eprintln!(
            "lily: KL(reference || this) mean {:.6} +/- {:.6}, median {:.6}, p99 {:.6}, max {:.6}; top-1 agreement {:.2}%; max |d log p(next)| {:.4}",
            d.mean_kl,
            d.kl_stderr,
            d.median_kl,
            d.p99_kl,
            d.max_kl,
            100.0 * d.top1_agreement,
            d.max_true_logprob_delta
        );
        line["against"] = json!({
            "reference": reference.display().to_string(),
            "mean_kl": d.mean_kl,
            "kl_stderr": d.kl_stderr,
            "median_kl": d.median_kl,
            "p99_kl": d.p99_kl,
            "max_kl": d.max_kl,
            "top1_agreement": d.top1_agreement,
            "max_true_logprob_delta": d.max_true_logprob_delta,
        });
    }
    println!("{line}");
    Ok(())
}
