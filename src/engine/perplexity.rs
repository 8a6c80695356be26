//! Perplexity of a token stream, as llama.cpp's perplexity tool measures it: the text is cut into
//! chunks of `ctx` tokens, each evaluated from an empty context, and only the second half of
//! each chunk is scored (every scored token then has at least ctx/2 tokens of context). Reports
//! PPL with its uncertainty (delta method on the mean negative log-likelihood), per-chunk
//! figures, and optionally the scored positions' log-probabilities for a later comparison
//! (`LogProbFile`): KL divergence, top-1 agreement and the change in the true token's
//! log-probability against a reference run.

use crate::backend::{Backend, LogitsWanted};
use crate::engine::sampling::log_softmax;
use rayon::prelude::*;
use anyhow::{bail, Context, Result};
use half::f16;
use std::io::{Read, Write};
use std::path::Path;

/// Positions scored together (their log-softmax rows live at once when they are saved).
const SCORE_BLOCK: usize = 64;

/// How the text is cut.
#[derive(Clone, Copy, Debug)]
pub struct PplConfig {
    /// Tokens per chunk (each evaluated from an empty context).
    pub ctx: usize,
    /// At most this many chunks (0: every whole chunk of the text).
    pub max_chunks: usize,
}

/// The start of every chunk of `n` tokens (whole chunks only).
pub fn chunks(n: usize, cfg: PplConfig) -> Result<Vec<usize>> {
    if cfg.ctx < 4 {
        bail!("--ctx must be at least 4 tokens");
    }
    let whole = n / cfg.ctx;
    if whole == 0 {
        bail!("the text has {n} tokens; at least one chunk of --ctx {} is needed", cfg.ctx);
    }
    let count = if cfg.max_chunks == 0 { whole } else { whole.min(cfg.max_chunks) };
    Ok((0..count).map(|c| c * cfg.ctx).collect())
}

/// The first scored position of a chunk: predictions of tokens first+1 .. ctx-1 are scored.
pub fn first_scored(ctx: usize) -> usize {
    ctx / 2
}

/// Per-position result: the true next token, its log-probability, and whether it was the argmax.
#[derive(Clone, Copy, Debug)]
pub struct Scored {
    pub token: u32,
    pub logprob: f64,
    pub argmax: u32,
}

/// Summary of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct Ppl {
    pub tokens_scored: usize,
    pub mean_nll: f64,
    /// Standard error of the mean NLL.
    pub nll_stderr: f64,
    pub ppl: f64,
    /// PPL × stderr(NLL): the PPL's uncertainty (delta method).
    pub ppl_stderr: f64,
}

impl Ppl {
    pub fn of(nll: &[f64]) -> Ppl {
        let n = nll.len().max(1) as f64;
        let mean = nll.iter().sum::<f64>() / n;
        let var = if nll.len() > 1 { nll.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        let se = (var / n).sqrt();
        let ppl = mean.exp();
        Ppl { tokens_scored: nll.len(), mean_nll: mean, nll_stderr: se, ppl, ppl_stderr: ppl * se }
    }
}

/// Evaluates the chunks of `tokens`; `on_chunk(index, running PPL)` after each; the scored
/// positions' full log-probabilities go to `save` when given.
pub fn evaluate(
    backend: &mut dyn Backend,
    tokens: &[u32],
    cfg: PplConfig,
    mut save: Option<&mut LogProbWriter>,
    mut on_chunk: impl FnMut(usize, &Ppl),
) -> Result<(Ppl, Vec<Scored>)> {
    let vocab = backend.config().vocab_size;
    let first = first_scored(cfg.ctx);
    let mut scored = Vec::new();
    let mut nll = Vec::new();
    for (ci, start) in chunks(tokens.len(), cfg)?.into_iter().enumerate() {
        let chunk = &tokens[start..start + cfg.ctx];
        let mut seq = backend.new_sequence(cfg.ctx)?;
        let logits = backend.forward(&mut seq, chunk, LogitsWanted::All)?;
        if logits.len() != cfg.ctx * vocab {
            bail!("the backend returned {} logits for {} positions", logits.len(), cfg.ctx);
        }
        // Positions are scored in parallel, a block at a time (a block's log-softmax rows are
        // kept only when they are saved), and recorded in order.
        let (end, keep) = (cfg.ctx - 1, save.is_some());
        for b0 in (first..end).step_by(SCORE_BLOCK) {
            let rows: Vec<(Scored, Option<Vec<f32>>)> = (b0..(b0 + SCORE_BLOCK).min(end))
                .into_par_iter()
                .map(|t| {
                    let row = &logits[t * vocab..(t + 1) * vocab];
                    let lp = log_softmax(row);
                    let token = chunk[t + 1];
                    let s = Scored { token, logprob: lp[token as usize] as f64, argmax: crate::engine::sampling::argmax(row) };
                    (s, keep.then_some(lp))
                })
                .collect();
            for (s, lp) in rows {
                nll.push(-s.logprob);
                if let (Some(w), Some(lp)) = (save.as_deref_mut(), lp) {
                    w.push(s.token, &lp)?;
                }
                scored.push(s);
            }
        }
        on_chunk(ci, &Ppl::of(&nll));
    }
    Ok((Ppl::of(&nll), scored))
}

const MAGIC: &[u8; 8] = b"LILYLOGP";
const VERSION: u32 = 1;

/// Writes scored positions' log-probabilities: a header (magic, version, vocabulary), then per
/// position the true next token (u32), its log-probability (f32) and every log-probability (f16),
/// little-endian. f16 keeps KL divergences down to ~1e-6; the true token's f32 keeps its
/// log-probability exact.
pub struct LogProbWriter {
    out: std::io::BufWriter<std::fs::File>,
    vocab: usize,
}

impl LogProbWriter {
    pub fn create(path: &Path, vocab: usize) -> Result<Self> {
        let f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = std::io::BufWriter::new(f);
        out.write_all(MAGIC)?;
        out.write_all(&VERSION.to_le_bytes())?;
        out.write_all(&(vocab as u32).to_le_bytes())?;
        Ok(LogProbWriter { out, vocab })
    }

    fn push(&mut self, token: u32, lp: &[f32]) -> Result<()> {
        debug_assert_eq!(lp.len(), self.vocab);
        self.out.write_all(&token.to_le_bytes())?;
        self.out.write_all(&lp[token as usize].to_le_bytes())?;
        let bytes: Vec<u8> = lp.iter().flat_map(|&x| f16::from_f32(x.max(-65000.0)).to_le_bytes()).collect();
        self.out.write_all(&bytes)?;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        self.out.flush()?;
        Ok(())
    }
}

/// A saved run, per position.
pub struct LogProbFile {
    pub vocab: usize,
    pub positions: Vec<SavedPosition>,
}

pub struct SavedPosition {
    /// The true next token and its log-probability.
    pub token: u32,
    pub logprob: f32,
    /// Every token's log-probability (from f16).
    pub all: Vec<f32>,
}

impl LogProbFile {
    pub fn read(path: &Path) -> Result<Self> {
        let mut f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut head = [0u8; 16];
        f.read_exact(&mut head).with_context(|| format!("{}: not a lily log-probability file (too short)", path.display()))?;
        if &head[..8] != MAGIC {
            bail!("{}: not a lily log-probability file (written by `lily perplexity --save-logits`)", path.display());
        }
        let version = u32::from_le_bytes(head[8..12].try_into().unwrap());
        if version != VERSION {
            bail!("{}: log-probability file version {version}, this lily reads {VERSION}", path.display());
        }
        let vocab = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
        let mut rest = Vec::new();
        f.read_to_end(&mut rest)?;
        let rec = 8 + 2 * vocab;
        if vocab == 0 || rest.len() % rec != 0 {
            bail!("{}: truncated log-probability file", path.display());
        }
        let positions = rest
            .chunks_exact(rec)
            .map(|r| SavedPosition {
                token: u32::from_le_bytes(r[..4].try_into().unwrap()),
                logprob: f32::from_le_bytes(r[4..8].try_into().unwrap()),
                all: r[8..].chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            })
            .collect();
        Ok(LogProbFile { vocab, positions })
    }
}

/// How a run's distributions compare with a reference run's.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    pub positions: usize,
    pub mean_kl: f64,
    pub kl_stderr: f64,
    pub median_kl: f64,
    pub p99_kl: f64,
    pub max_kl: f64,
    /// Fraction of positions whose argmax agrees.
    pub top1_agreement: f64,
    /// Largest |Δ log p| of the true next token.
    pub max_true_logprob_delta: f64,
}

/// KL(reference ‖ run) per position and the summary; the runs must score the same tokens.
pub fn divergence(reference: &LogProbFile, run: &LogProbFile) -> Result<Divergence> {
    if reference.vocab != run.vocab || reference.positions.len() != run.positions.len() {
        bail!(
            "the runs differ in shape: {} positions x {} vocabulary against {} x {} (same text, --ctx and --chunks?)",
            reference.positions.len(),
            reference.vocab,
            run.positions.len(),
            run.vocab
        );
    }
    let mut kls = Vec::with_capacity(run.positions.len());
    let (mut agree, mut max_delta) = (0usize, 0.0f64);
    for (i, (r, t)) in reference.positions.iter().zip(&run.positions).enumerate() {
        if r.token != t.token {
            bail!("position {i} scores token {}, the reference {}: not the same text", t.token, r.token);
        }
        let kl: f64 = r.all.iter().zip(&t.all).map(|(&a, &b)| (a as f64).exp() * (a as f64 - b as f64)).sum();
        kls.push(kl.max(0.0));
        let am = |v: &[f32]| crate::engine::sampling::argmax(v);
        agree += (am(&r.all) == am(&t.all)) as usize;
        max_delta = max_delta.max((r.logprob as f64 - t.logprob as f64).abs());
    }
    let n = kls.len().max(1) as f64;
    let mean = kls.iter().sum::<f64>() / n;
    let var = if kls.len() > 1 { kls.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    let mut sorted = kls.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |q: f64| sorted.get(((q * (sorted.len() as f64 - 1.0)).round()) as usize).copied().unwrap_or(0.0);
    Ok(Divergence {
        positions: kls.len(),
        mean_kl: mean,
        kl_stderr: (var / n).sqrt(),
        median_kl: pct(0.5),
        p99_kl: pct(0.99),
        max_kl: sorted.last().copied().unwrap_or(0.0),
        top1_agreement: agree as f64 / n,
        max_true_logprob_delta: max_delta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_and_capped() {
        let c = PplConfig { ctx: 10, max_chunks: 0 };
        assert_eq!(chunks(35, c).unwrap(), vec![0, 10, 20]);
        assert_eq!(chunks(35, PplConfig { max_chunks: 2, ..c }).unwrap(), vec![0, 10]);
        assert!(chunks(9, c).unwrap_err().to_string().contains("at least one chunk"));
        assert!(chunks(100, PplConfig { ctx: 2, max_chunks: 0 }).is_err());
        assert_eq!(first_scored(512), 256);
    }

    #[test]
    fn ppl_and_its_uncertainty() {
        let p = Ppl::of(&[1.0, 1.0, 1.0, 1.0]);
        assert!((p.ppl - std::f64::consts::E).abs() < 1e-12 && p.ppl_stderr == 0.0);
        let p = Ppl::of(&[0.0, 2.0]);
        assert!((p.mean_nll - 1.0).abs() < 1e-12);
        // sd = sqrt(2), se = sd / sqrt(2) = 1.
        assert!((p.nll_stderr - 1.0).abs() < 1e-12 && (p.ppl_stderr - p.ppl).abs() < 1e-12);
    }

    #[test]
    fn divergence_of_a_run_with_itself_and_with_another() {
        let lp = |token: u32, row: &[f32]| {
            let all = log_softmax(row);
            SavedPosition { token, logprob: all[token as usize], all }
        };
        let a = LogProbFile { vocab: 3, positions: vec![lp(0, &[2.0, 1.0, 0.0]), lp(2, &[0.0, 0.5, 3.0])] };
        let d = divergence(&a, &a).unwrap();
        assert_eq!((d.mean_kl, d.top1_agreement, d.max_true_logprob_delta), (0.0, 1.0, 0.0));
        let b = LogProbFile { vocab: 3, positions: vec![lp(0, &[1.0, 2.0, 0.0]), lp(2, &[0.0, 0.5, 3.0])] };
        let d = divergence(&a, &b).unwrap();
        assert_eq!(d.top1_agreement, 0.5);
        assert!(d.mean_kl > 0.0 && d.max_kl > d.median_kl.min(d.max_kl) - 1e-12);
        let c = LogProbFile { vocab: 3, positions: vec![lp(1, &[1.0, 2.0, 0.0]), lp(2, &[0.0, 0.5, 3.0])] };
        assert!(divergence(&a, &c).unwrap_err().to_string().contains("not the same text"));
    }
}
