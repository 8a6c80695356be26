//! Token selection: greedy, or temperature / top-k / top-p / min-p sampling with repetition,
//! presence and frequency penalties; seeded for reproducibility.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 selects greedy decoding.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` × the top probability (0 = off).
    pub min_p: f32,
    /// OpenAI presence penalty: subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted per occurrence.
    pub frequency_penalty: f32,
    /// CTRL-style multiplicative penalty on seen tokens (1 = off).
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, presence_penalty: 0.0, frequency_penalty: 0.0, repetition_penalty: 1.0, seed: None }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    /// What an OpenAI-style request that sets nothing gets: temperature 1 over the whole
    /// vocabulary.
    pub fn openai() -> Self {
        SamplingParams { temperature: 1.0, ..Self::default() }
    }
    /// Defaults from a checkpoint's `generation_config.json` (as vLLM takes them): its
    /// temperature, top_p, top_k, min_p and repetition_penalty over [`SamplingParams::openai`];
    /// `do_sample` is not consulted. A value of the wrong type or out of range is an error naming
    /// the key.
    pub fn from_generation_config(cfg: &serde_json::Value) -> Result<Self, String> {
        let mut p = Self::openai();
        let num = |k: &str| -> Result<Option<f64>, String> {
            match cfg.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| format!("generation_config.json: '{k}' must be a number, got {v}")),
            }
        };
        if let Some(t) = num("temperature")? {
            p.temperature = t as f32;
        }
        if let Some(x) = num("top_p")? {
            p.top_p = x as f32;
        }
        if let Some(k) = num("top_k")? {
            if k < 0.0 || k.fract() != 0.0 {
                return Err(format!("generation_config.json: 'top_k' must be a non-negative integer, got {k}"));
            }
            p.top_k = k as usize;
        }
        if let Some(x) = num("min_p")? {
            p.min_p = x as f32;
        }
        if let Some(x) = num("repetition_penalty")? {
            p.repetition_penalty = x as f32;
        }
        p.validate().map_err(|e| format!("generation_config.json: {e}"))?;
        Ok(p)
    }
    /// [`SamplingParams::from_generation_config`] of `dir/generation_config.json`; `None` when
    /// the checkpoint has none.
    pub fn from_checkpoint_dir(dir: &std::path::Path) -> Result<Option<Self>, String> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::from_generation_config(&v).map(Some)
    }
    /// Some penalty changes the logits of tokens already generated.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
    /// Plain greedy: temperature 0 and no penalty, so every token is the argmax of the raw logits.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.has_penalties()
    }
    /// Checks ranges; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |f: &str, v: f32, range: &str| Err(format!("{f} must be {range}, got {v}"));
        if !(0.0..=100.0).contains(&self.temperature) || self.temperature.is_nan() {
            return bad("temperature", self.temperature, "between 0 and 100");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return bad("repetition_penalty", self.repetition_penalty, "in (0, 10]");
        }
        Ok(())
    }
}

/// Index of the largest value; the lowest index wins ties (NaN never wins).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `log_softmax` of one row, in f64 for the normaliser.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m as f64 + logits.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
    logits.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// The sampling flags of `lily run` and `lily-bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The parameters, validated (the message names the offending flag).
    pub fn params(&self) -> Result<SamplingParams, String> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        };
        p.validate().map(|()| p)
    }
}

/// What a backend needs to continue a request's sampling on its own device: the parameters, a
/// seed drawn from the request's sampler (so the same request seed gives the same tokens), and
/// how often each token has been generated so far (for the penalties).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerSnapshot {
    pub params: SamplingParams,
    pub seed: u64,
    /// (token, count), ascending token ids.
    pub counts: Vec<(u32, u32)>,
}

impl SamplerSnapshot {
    /// Draws the token that follows `logits` at sequence position `position` (where the token
    /// that produced them was fed). The draw is keyed by (seed, position), as the device sampler
    /// keys its draws, so a continuation gives the same tokens whether it runs in one call, is
    /// split across calls, or shares its steps with other sequences.
    pub fn sample_at(&self, logits: &mut [f32], position: usize) -> u32 {
        let mut s = Sampler::from_snapshot(self);
        // ChaCha's stream id selects an independent stream of the seed's key: one per position.
        s.rng.set_stream(position as u64);
        s.sample(logits)
    }

    /// Counts a generated token, as the backend that continues this snapshot does (only needed
    /// where a penalty reads the counts), so the snapshot can be handed over again later.
    pub fn observe(&mut self, token: u32) {
        match self.counts.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.counts[i].1 += 1,
            Err(i) => self.counts.insert(i, (token, 1)),
        }
    }
}

/// A seeded sampler. One per request.
pub struct Sampler {
    pub params: SamplingParams,
    rng: ChaCha8Rng,
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Sampler { params, rng: ChaCha8Rng::seed_from_u64(seed), counts: HashMap::new() }
    }

    /// Plain greedy: temperature 0 and no penalty, so every token is the argmax of the raw
    /// logits and a backend may pick it on its own device (`Backend::decode_greedy`).
    pub fn is_plain_greedy(&self) -> bool {
        self.params.is_plain_greedy()
    }

    /// Continues a snapshot's sampling on the host (the reference for a device sampler).
    pub fn from_snapshot(snap: &SamplerSnapshot) -> Self {
        Sampler { params: snap.params.clone(), rng: ChaCha8Rng::seed_from_u64(snap.seed), counts: snap.counts.iter().copied().collect() }
    }

    /// Hands the sampling over to a backend: a seed for it is drawn from this sampler's RNG.
    pub fn snapshot(&mut self) -> SamplerSnapshot {
        let mut counts: Vec<(u32, u32)> = self.counts.iter().map(|(&t, &n)| (t, n)).collect();
        counts.sort_unstable();
        SamplerSnapshot { params: self.params.clone(), seed: self.rng.random(), counts }
    }

    /// Records a token of the generated text (penalties apply to generated tokens).
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Applies penalties to `logits` in place.
    pub fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if self.counts.is_empty() || !p.has_penalties() {
            return;
        }
        for (&tok, &n) in &self.counts {
            let Some(l) = logits.get_mut(tok as usize) else { continue };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            *l -= p.presence_penalty + p.frequency_penalty * n as f32;
        }
    }

    /// Picks the next token from one row of logits (modified in place by penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.apply_penalties(logits);
        let p = self.params.clone();
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by logit, highest first; top-k cut before the softmax.
        let mut idx: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()).collect();
        if idx.is_empty() {
            return argmax(logits);
        }
        let k = if p.top_k == 0 { idx.len() } else { p.top_k.min(idx.len()) };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            idx.truncate(k);
        }
        idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f64> = idx.iter().map(|&i| (((logits[i as usize] - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        // min-p relative to the top probability.
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        // top-p: smallest prefix reaching the mass.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &x in &probs[..keep] {
                acc += x;
                n += 1;
                if acc >= p.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f64>() * mass;
        for (j, &x) in probs[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return idx[j];
            }
        }
        idx[keep - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_filters_hold() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
        let params = SamplingParams { temperature: 1.0, top_k: 5, seed: Some(42), ..Default::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
        };
        let a = draw(&params);
        assert_eq!(a, draw(&params));
        let mut top5: Vec<u32> = (0..1000u32).collect();
        top5.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        top5.truncate(5);
        assert!(a.iter().all(|t| top5.contains(t)), "top-k respected");
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "it samples");
        // top_p tiny keeps only the best token.
        let p = SamplingParams { temperature: 1.0, top_p: 1e-6, seed: Some(1), ..Default::default() };
        assert!(draw(&p).iter().all(|&t| t == top5[0]));
        // min_p = 1 keeps only the best token.
        let p = SamplingParams { temperature: 1.0, min_p: 1.0, seed: Some(1), ..Default::default() };
        assert!(draw(&p).iter().all(|&t| t == top5[0]));
    }

    #[test]
    fn penalties_lower_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { presence_penalty: 1.0, frequency_penalty: 0.5, repetition_penalty: 2.0, ..Default::default() });
        s.observe(0);
        s.observe(0);
        s.observe(1);
        let mut l = vec![4.0, -1.0, 2.0];
        s.apply_penalties(&mut l);
        assert_eq!(l, vec![4.0 / 2.0 - 1.0 - 1.0, -2.0 - 1.0 - 0.5, 2.0]);
    }

    #[test]
    fn snapshot_continues_deterministically() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 31) % 97) as f32 / 20.0).collect();
        let params = SamplingParams { temperature: 0.8, top_p: 0.9, presence_penalty: 0.5, seed: Some(7), ..Default::default() };
        let mut a = Sampler::new(params.clone());
        a.observe(3);
        a.observe(3);
        let snap = a.snapshot();
        assert_eq!(snap.counts, vec![(3, 2)]);
        assert_eq!(snap, Sampler::new(params).tap_observe(&[3, 3]).snapshot(), "same seed, same snapshot");
        let draw = |s: &SamplerSnapshot| {
            let mut smp = Sampler::from_snapshot(s);
            (0..20).map(|_| smp.sample(&mut logits.clone())).collect::<Vec<_>>()
        };
        assert_eq!(draw(&snap), draw(&snap));
    }

    impl Sampler {
        fn tap_observe(mut self, toks: &[u32]) -> Self {
            toks.iter().for_each(|&t| self.observe(t));
            self
        }
    }

    #[test]
    fn validate_names_the_field() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err().contains("top_p"));
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err().contains("temperature"));
    }

    #[test]
    fn generation_config_values_become_the_defaults() {
        let p = SamplingParams::from_generation_config(&serde_json::json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.57.0"})).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty), (0.6, 20, 0.95, 0.0, 1.0));
        // Keys it does not set keep OpenAI's defaults.
        assert_eq!(SamplingParams::from_generation_config(&serde_json::json!({"eos_token_id": 1})).unwrap(), SamplingParams::openai());
        for bad in [serde_json::json!({"top_k": 2.5}), serde_json::json!({"temperature": "hot"}), serde_json::json!({"top_p": 0})] {
            assert!(SamplingParams::from_generation_config(&bad).is_err(), "{bad}");
        }
        let dir = std::env::temp_dir().join(format!("lily-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(SamplingParams::from_checkpoint_dir(&dir).unwrap(), None);
        std::fs::write(dir.join("generation_config.json"), "{not json").unwrap();
        assert!(SamplingParams::from_checkpoint_dir(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
