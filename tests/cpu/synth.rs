//! `lily synth` end to end on the tiny preset: determinism, layout against `expected_weights`,
//! sharding, weight statistics, directory safety. Run in release (`cargo test --release --test
//! cpu synth::`); the tiny checkpoint is ~40 MB.

use half::bf16;
use lily::checkpoint::layout::{expected_weights, Init, WeightKind};
use lily::checkpoint::{Checkpoint, DType, ModelConfig};
use lily::quant::dequantize_row;
use lily::synth::{synthesize, synthesize_with, Preset, SynthOptions, MARKER};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

fn dtype_of(d: Dtype) -> DType {
    match d {
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F32 => DType::F32,
        Dtype::U32 => DType::U32,
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// name -> (shard file, dtype, shape, bytes)
type Tensors = HashMap<String, (String, DType, Vec<usize>, Vec<u8>)>;

fn read_all(dir: &Path) -> Tensors {
    let index: Value = serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut shards: Vec<String> = map.values().map(|v| v.as_str().unwrap().to_string()).collect();
    shards.sort();
    shards.dedup();
    let mut out = Tensors::new();
    let mut total = 0u64;
    for shard in &shards {
        let bytes = std::fs::read(dir.join(shard)).unwrap();
        // header padded so the data section is 8-byte aligned
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "mlx");
        let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{shard}: {e}"));
        for (name, view) in st.tensors() {
            assert_eq!(map[&name].as_str().unwrap(), shard, "{name} listed in the wrong shard");
            total += view.data().len() as u64;
            let prev = out.insert(name.clone(), (shard.clone(), dtype_of(view.dtype()), view.shape().to_vec(), view.data().to_vec()));
            assert!(prev.is_none(), "{name} appears in two shards");
        }
    }
    assert_eq!(out.len(), map.len(), "index lists tensors that are not in the shards");
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    out
}

fn stats(xs: &[f32]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()
}

fn dequantize(t: &Tensors, base: &str, bits: usize, group: usize) -> Vec<f32> {
    let (_, _, wshape, w) = &t[&format!("{base}.weight")];
    let words: Vec<u32> = w.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let s = bf16s(&t[&format!("{base}.scales")].3);
    let b = bf16s(&t[&format!("{base}.biases")].3);
    let wpr = *wshape.last().unwrap();
    let cols = wpr * 32 / bits;
    let gpr = cols / group;
    let rows = words.len() / wpr;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        dequantize_row(&words[r * wpr..(r + 1) * wpr], &s[r * gpr..(r + 1) * gpr], &b[r * gpr..(r + 1) * gpr], bits, group, &mut out[r * cols..(r + 1) * cols]);
    }
    out
}

#[test]
fn tiny_is_deterministic_and_seed_dependent() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny();
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    let t0 = std::time::Instant::now();
    let rep = synthesize(&cfg, &a, 42, false).unwrap();
    eprintln!("{rep} (total {:.2}s)", t0.elapsed().as_secs_f64());
    assert!((30e6..60e6).contains(&(rep.total_bytes as f64)), "{}", rep.total_bytes);
    // single-threaded, with a different chunk size: same bytes
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| synthesize_with(&cfg, &b, 42, &SynthOptions { chunk_bytes: 72, ..SynthOptions::default() }).unwrap());
    synthesize(&cfg, &c, 43, false).unwrap();
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(bytes == &fb[name], "{name} differs between two runs with the same seed");
    }
    let shard = "model-00001-of-00001.safetensors";
    assert_eq!(fa[shard].len(), fc[shard].len());
    assert!(fa[shard] != fc[shard], "a different seed gave the same weights");
    // only the weights differ, never the layout
    assert_eq!(fa["config.json"], fc["config.json"]);
    assert_eq!(fa["model.safetensors.index.json"], fc["model.safetensors.index.json"]);
}

#[test]
fn tiny_layout_matches_expected_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = Preset::Tiny.config();
    let dir = tmp.path().join("ckpt");
    let rep = synthesize(&cfg, &dir, 7, false).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors.index.json", MARKER] {
        assert!(dir.join(f).is_file(), "missing {f}");
    }
    assert_eq!(ModelConfig::from_config_json(&dir.join("config.json")).unwrap(), cfg);
    let gen: Value = serde_json::from_slice(&std::fs::read(dir.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(gen["eos_token_id"], serde_json::json!([248046, 248044]));

    let t = read_all(&dir);
    let specs = expected_weights(&cfg);
    let stored: Vec<_> = specs.iter().flat_map(|s| s.stored(cfg.quant.group_size)).collect();
    assert_eq!(t.len(), stored.len());
    assert_eq!(rep.tensors, stored.len());
    for st in &stored {
        let (_, dtype, shape, _) = t.get(&st.name).unwrap_or_else(|| panic!("missing {}", st.name));
        assert_eq!(*dtype, st.dtype, "{}", st.name);
        assert_eq!(*shape, st.shape, "{}", st.name);
    }
    // tensors appear in expected_weights order within the shard, each at least 4-byte aligned
    let bytes = std::fs::read(dir.join("model-00001-of-00001.safetensors")).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut by_offset: Vec<(usize, String)> = meta.tensors().into_iter().map(|(k, v)| (v.data_offsets.0, k)).collect();
    by_offset.sort();
    let names: Vec<String> = by_offset.into_iter().map(|(_, k)| k).collect();
    assert_eq!(names, stored.iter().map(|s| s.name.clone()).collect::<Vec<_>>());
    for (name, info) in meta.tensors() {
        assert_eq!((8 + n + info.data_offsets.0) % 4, 0, "{name} misaligned");
    }
    // the loader accepts it
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.tensor_count(), stored.len());
}

#[test]
fn shard_limit_is_respected() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny();
    let dir = tmp.path().join("sharded");
    let limit = 6_000_000;
    let rep = synthesize_with(&cfg, &dir, 1, &SynthOptions { shard_limit: limit, ..SynthOptions::default() }).unwrap();
    assert!(rep.shards >= 4, "{}", rep.shards);
    let t = read_all(&dir);
    let mut per_shard: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    for (shard, _, _, data) in t.values() {
        let e = per_shard.entry(shard.clone()).or_default();
        e.0 += data.len() as u64;
        e.1 += 1;
    }
    let names: Vec<&String> = per_shard.keys().collect();
    let expect: Vec<String> = (1..=rep.shards).map(|i| format!("model-{i:05}-of-{:05}.safetensors", rep.shards)).collect();
    assert_eq!(names, expect.iter().collect::<Vec<_>>());
    for (shard, (bytes, count)) in &per_shard {
        // a tensor bigger than the limit (the 16 MB embedding) sits alone
        assert!(*bytes <= limit || *count == 1, "{shard}: {bytes} bytes in {count} tensors");
    }
    // the same weights as the single-shard checkpoint
    let single = tmp.path().join("single");
    synthesize(&cfg, &single, 1, false).unwrap();
    let s = read_all(&single);
    for (name, (_, _, _, data)) in &t {
        assert!(data == &s[name].3, "{name}");
    }
    Checkpoint::open(&dir).unwrap();
}

#[test]
fn weights_follow_their_init() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny();
    let dir = tmp.path().join("stats");
    synthesize(&cfg, &dir, 3, false).unwrap();
    let t = read_all(&dir);
    let g = cfg.quant.group_size;
    let mut checked_q = 0;
    for spec in expected_weights(&cfg) {
        match (&spec.kind, spec.init) {
            (WeightKind::Quantized { bits, .. }, Init::Normal(std)) => {
                let w = dequantize(&t, &spec.name, *bits, g);
                if w.len() < 8192 {
                    continue; // too few samples for a 10% test
                }
                let (mean, sd) = stats(&w);
                assert!(mean.abs() < 0.05 * std as f64, "{}: mean {mean} (std {std})", spec.name);
                assert!((sd / std as f64 - 1.0).abs() < 0.10, "{}: std {sd}, want {std}", spec.name);
                checked_q += 1;
            }
            (WeightKind::Quantized { .. }, init) => panic!("{}: unexpected init {init:?}", spec.name),
            (WeightKind::Float { .. }, init) => {
                let (_, dtype, _, bytes) = &t[&spec.name];
                let x = lily::checkpoint::store::to_f32(*dtype, bytes);
                let (lo, hi) = match init {
                    Init::Around { center, spread } => (center - spread, center + spread),
                    Init::Uniform { lo, hi } => (lo, hi),
                    Init::Normal(std) => {
                        let (mean, sd) = stats(&x);
                        if x.len() >= 1000 {
                            assert!(mean.abs() < 0.1 * std as f64, "{}: mean {mean}", spec.name);
                            assert!((sd / std as f64 - 1.0).abs() < 0.10, "{}: std {sd}, want {std}", spec.name);
                        }
                        (-3.47 * std, 3.47 * std)
                    }
                };
                // bf16 rounding may land exactly on (or a hair past) the edge
                let tol = 0.01 * (lo.abs().max(hi.abs()));
                for &v in &x {
                    assert!(v >= lo - tol && v <= hi + tol, "{}: {v} outside [{lo}, {hi}]", spec.name);
                }
                assert!(x.iter().any(|&v| v != x[0]), "{}: constant", spec.name);
            }
        }
    }
    assert!(checked_q > 20, "{checked_q}");
    // 8-bit router and expert stacks explicitly
    let router = dequantize(&t, "language_model.model.layers.0.mlp.gate", 8, g);
    let (_, sd) = stats(&router);
    assert!((sd * (cfg.hidden_size as f64).sqrt() - 1.0).abs() < 0.1, "router std {sd}");
    // the codes use the whole range
    let w = &t["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"].3;
    let mut seen = [0usize; 16];
    for b in w {
        seen[(b & 15) as usize] += 1;
        seen[(b >> 4) as usize] += 1;
    }
    let n = (w.len() * 2) as f64 / 16.0;
    assert!(seen.iter().all(|&c| (c as f64 / n - 1.0).abs() < 0.05), "{seen:?}");
}

#[test]
fn directory_safety() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny();
    // a non-empty foreign directory is refused and left alone
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("config.json"), "{}").unwrap();
    let e = synthesize(&cfg, &foreign, 0, false).unwrap_err().to_string();
    assert!(e.contains("refusing") && e.contains("foreign"), "{e}");
    assert_eq!(std::fs::read_to_string(foreign.join("config.json")).unwrap(), "{}");
    // an empty directory is fine; a previous output is replaced
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    synthesize(&cfg, &out, 0, false).unwrap();
    std::fs::write(out.join("extra.txt"), "x").unwrap();
    synthesize(&cfg, &out, 1, false).unwrap();
    assert!(!out.join("extra.txt").exists());
    // no temporary directories are left behind
    let left: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(left.iter().all(|n| !n.starts_with('.')), "{left:?}");
    // an unwritable location is a one-line error naming the path
    let file = tmp.path().join("plain-file");
    std::fs::write(&file, "x").unwrap();
    let e = synthesize(&cfg, &file.join("sub"), 0, false).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("plain-file") && !msg.contains('\n'), "{msg}");
    let e = synthesize(&cfg, &file, 0, false).unwrap_err().to_string();
    assert!(e.contains("not a directory"), "{e}");
}

/// Throughput of the writer: `cargo test --release --test cpu synth::throughput_tiny -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput_tiny() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny();
    for i in 0..3 {
        let rep = synthesize(&cfg, &tmp.path().join(format!("t{i}")), i, false).unwrap();
        eprintln!("{rep}");
    }
}

/// A preset (`$LILY_SYNTH_PRESET`, default 35b-a3b) into `$LILY_SYNTH_DIR` (default
/// /tmp/synth35), with a progress bar, then opened by the loader:
/// `LILY_SYNTH_DIR=/tmp/synth35 cargo test --release --test cpu synth::synth_preset -- --ignored --nocapture`.
#[test]
#[ignore]
fn synth_preset() {
    let dir = std::env::var("LILY_SYNTH_DIR").unwrap_or_else(|_| "/tmp/synth35".into());
    let preset: Preset = std::env::var("LILY_SYNTH_PRESET").unwrap_or_else(|_| "35b-a3b".into()).parse().unwrap();
    match synthesize(&preset.config(), Path::new(&dir), 0, true) {
        Ok(rep) => eprintln!("{rep}"),
        Err(e) => panic!("synth failed: {e:#}"),
    }
    let t = std::time::Instant::now();
    let ck = Checkpoint::open(Path::new(&dir)).unwrap();
    eprintln!("Checkpoint::open: {} tensors validated in {:.2}s", ck.tensor_count(), t.elapsed().as_secs_f64());
}

/// Throughput on an 8-layer cut of the real model (~3.9 GB, fits in the page cache's dirty
/// budget on most machines): `cargo test --release --test cpu synth::throughput_mid -- --ignored --nocapture`.
#[test]
#[ignore]
fn throughput_mid() {
    let dir = std::env::var("LILY_SYNTH_DIR").unwrap_or_else(|_| "/tmp/synth-mid".into());
    let mut cfg = ModelConfig::qwen36_35b_a3b();
    cfg.layer_types = lily::checkpoint::config::hybrid_layers(8, 4);
    let rep = synthesize(&cfg, Path::new(&dir), 0, false).unwrap();
    eprintln!("{rep}");
    std::fs::remove_dir_all(&dir).unwrap();
}
