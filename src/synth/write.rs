//! Planning and streaming the safetensors shards: the headers are computed up front (every shape
//! is known), then tensor bytes are generated in fixed-size chunks in parallel and each chunk is
//! written at its own offset, so memory stays bounded (one chunk per worker) whatever the
//! checkpoint size, and the bytes do not depend on scheduling.

use super::gen::{stream_key, AffineParams, Fill};
use crate::checkpoint::config::ModelConfig;
use crate::checkpoint::layout::{expected_weights, DType, WeightKind};
use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::fs::File;
use std::path::Path;

/// One stored tensor of the checkpoint being written.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub nbytes: u64,
    pub fill: Fill,
    /// Shard index and byte offset inside the shard's data section.
    pub shard: usize,
    pub offset: u64,
}

/// Every stored tensor of `expected_weights(cfg)`, in order, with its generator (shards not yet
/// assigned).
pub fn plan_tensors(cfg: &ModelConfig, seed: u64) -> Vec<PlannedTensor> {
    let group = cfg.quant.group_size;
    let mut out = Vec::new();
    for spec in expected_weights(cfg) {
        let stored = spec.stored(group);
        let fills: Vec<Fill> = match &spec.kind {
            WeightKind::Quantized { bits, .. } => {
                // Scales and biases share one key so each group's bias matches its scale.
                let affine_key = stream_key(seed, &format!("{}.scales", spec.name));
                let params = AffineParams::new(*bits, spec.init);
                vec![
                    Fill::Bits { key: stream_key(seed, &format!("{}.weight", spec.name)) },
                    Fill::Affine { key: affine_key, params, bias: false },
                    Fill::Affine { key: affine_key, params, bias: true },
                ]
            }
            WeightKind::Float { .. } => vec![Fill::Float { key: stream_key(seed, &spec.name), init: spec.init }],
        };
        debug_assert_eq!(fills.len(), stored.len());
        for (st, fill) in stored.into_iter().zip(fills) {
            let nbytes = st.shape.iter().product::<usize>() as u64 * st.dtype.size() as u64;
            out.push(PlannedTensor { name: st.name, dtype: st.dtype, shape: st.shape, nbytes, fill, shard: 0, offset: 0 });
        }
    }
    out
}

/// Greedy sharding in order (as `huggingface_hub` / mlx-lm do): a new shard starts when the next
/// tensor would push the current one past `limit` bytes of tensor data; a tensor larger than the
/// limit gets a shard of its own. Returns the shard index of every tensor.
pub fn assign_shards(sizes: &[u64], limit: u64) -> Vec<usize> {
    let mut shard = 0;
    let mut used = 0u64;
    let mut out = Vec::with_capacity(sizes.len());
    for &s in sizes {
        if used > 0 && used + s > limit {
            shard += 1;
            used = 0;
        }
        used += s;
        out.push(shard);
    }
    out
}

/// Shard file name, Hugging Face style.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Assigns shards and offsets in place; returns the number of shards.
pub fn layout_shards(tensors: &mut [PlannedTensor], limit: u64) -> usize {
    let sizes: Vec<u64> = tensors.iter().map(|t| t.nbytes).collect();
    let shards = assign_shards(&sizes, limit);
    let mut offset = 0u64;
    let mut cur = usize::MAX;
    for (t, s) in tensors.iter_mut().zip(shards) {
        if s != cur {
            cur = s;
            offset = 0;
        }
        t.shard = s;
        t.offset = offset;
        offset += t.nbytes;
    }
    tensors.last().map_or(0, |t| t.shard + 1)
}

/// The full safetensors header of one shard (8-byte length prefix included), padded with spaces
/// so the data section starts 8-byte aligned.
pub fn shard_header(tensors: &[PlannedTensor], shard: usize) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("__metadata__".into(), json!({"format": "mlx"}));
    for t in tensors.iter().filter(|t| t.shard == shard) {
        m.insert(
            t.name.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [t.offset, t.offset + t.nbytes]}),
        );
    }
    let mut text = serde_json::to_vec(&Value::Object(m)).expect("header serialises");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out
}

/// A piece of one tensor's bytes.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    tensor: usize,
    start: u64,
    len: usize,
}

fn chunks(tensors: &[PlannedTensor], chunk_bytes: usize) -> Vec<Chunk> {
    let step = (chunk_bytes.max(8) / 8 * 8) as u64;
    let mut out = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let mut start = 0;
        loop {
            let len = (t.nbytes - start).min(step);
            out.push(Chunk { tensor: i, start, len: len as usize });
            start += len;
            if start >= t.nbytes {
                break;
            }
        }
    }
    out
}

/// Writes all shards into `dir`, returning the bytes written (headers included).
///
/// Shards are written concurrently (one file lock each) and every chunk is generated by a
/// rayon worker into its own buffer and written at its precomputed offset (`pwrite`), so no
/// single thread serialises generation and the output bytes do not depend on scheduling.
/// Memory: one chunk buffer per worker.
pub fn write_shards(dir: &Path, tensors: &[PlannedTensor], n_shards: usize, chunk_bytes: usize, progress: bool) -> Result<u64> {
    let headers: Vec<Vec<u8>> = (0..n_shards).map(|s| shard_header(tensors, s)).collect();
    let mut shard_data = vec![0u64; n_shards];
    for t in tensors {
        shard_data[t.shard] += t.nbytes;
    }
    let total: u64 = headers.iter().map(|h| h.len() as u64).sum::<u64>() + shard_data.iter().sum::<u64>();

    let bar = if progress {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{spinner} synth [{elapsed_precise}] [{bar:40}] {bytes}/{total_bytes} ({binary_bytes_per_sec}, eta {eta})")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };

    let all = chunks(tensors, chunk_bytes);
    let result = (0..n_shards).into_par_iter().try_for_each(|s| {
        let path = dir.join(shard_name(s, n_shards));
        let first = all.partition_point(|c| tensors[c.tensor].shard < s);
        let last = all.partition_point(|c| tensors[c.tensor].shard <= s);
        write_one_shard(&path, &headers[s], shard_data[s], tensors, &all[first..last], &bar)
    });
    if result.is_ok() {
        bar.finish_and_clear();
    } else {
        bar.abandon();
    }
    result?;
    Ok(total)
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> anyhow::Error {
    anyhow!("{}: {what}: {e}", path.display())
}

fn write_one_shard(path: &Path, header: &[u8], data_len: u64, tensors: &[PlannedTensor], chunks: &[Chunk], bar: &ProgressBar) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let file = File::create(path).map_err(|e| io_err(path, "cannot create", e))?;
    file.write_all_at(header, 0).map_err(|e| io_err(path, "write failed", e))?;
    bar.inc(header.len() as u64);
    let data_start = header.len() as u64;
    chunks.par_iter().try_for_each_init(Vec::new, |buf: &mut Vec<u8>, c| {
        let t = &tensors[c.tensor];
        buf.clear();
        buf.resize(c.len, 0);
        t.fill.fill(t.dtype, c.start, buf);
        file.write_all_at(buf, data_start + t.offset + c.start).map_err(|e| io_err(path, "write failed", e))?;
        bar.inc(c.len as u64);
        Ok::<(), anyhow::Error>(())
    })?;
    // No fsync: the shards are usually read right back from the page cache, and an interrupted
    // run never leaves a complete-looking directory (see `synthesize`).
    let len = file.metadata().map_err(|e| io_err(path, "cannot stat", e))?.len();
    if len != data_start + data_len {
        return Err(anyhow!("{}: internal error: file is {len} bytes, expected {}", path.display(), data_start + data_len));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_sharding() {
        assert_eq!(assign_shards(&[4, 4, 4, 4], 8), vec![0, 0, 1, 1]);
        assert_eq!(assign_shards(&[4, 5, 4, 4], 8), vec![0, 1, 2, 2]);
        // an oversized tensor sits alone
        assert_eq!(assign_shards(&[4, 20, 4], 8), vec![0, 1, 2]);
        assert_eq!(assign_shards(&[20, 4], 8), vec![0, 1]);
        assert_eq!(assign_shards(&[], 8), Vec::<usize>::new());
    }

    #[test]
    fn header_is_padded_and_parses() {
        let cfg = ModelConfig::tiny();
        let mut t = plan_tensors(&cfg, 0);
        let n = layout_shards(&mut t, 5_000_000_000);
        assert_eq!(n, 1);
        let h = shard_header(&t, 0);
        assert_eq!(h.len() % 8, 0);
        let len = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(len + 8, h.len());
        let v: Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["__metadata__"]["format"], "mlx");
        assert_eq!(v.as_object().unwrap().len(), t.len() + 1);
    }

    #[test]
    fn sharded_write_parses_and_matches_the_plan() {
        let mut cfg = ModelConfig::tiny();
        cfg.vocab_size = 4096; // small and fast; several shards and odd chunk sizes
        let mut t = plan_tensors(&cfg, 5);
        let n = layout_shards(&mut t, 600_000);
        assert!(n > 2);
        let tmp = tempfile::tempdir().unwrap();
        let total = write_shards(tmp.path(), &t, n, 4096 + 8, false).unwrap();
        let mut seen = 0;
        let mut file_bytes = 0;
        for s in 0..n {
            let bytes = std::fs::read(tmp.path().join(shard_name(s, n))).unwrap();
            file_bytes += bytes.len() as u64;
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for x in t.iter().filter(|x| x.shard == s) {
                let v = st.tensor(&x.name).unwrap();
                let mut want = vec![0u8; x.nbytes as usize];
                x.fill.fill(x.dtype, 0, &mut want);
                assert!(v.data() == &want[..], "{}", x.name);
                seen += 1;
            }
        }
        assert_eq!(seen, t.len());
        assert_eq!(file_bytes, total);
    }

    #[test]
    fn real_model_shards_like_the_mlx_community_upload() {
        let cfg = ModelConfig::qwen36_35b_a3b();
        let mut t = plan_tensors(&cfg, 0);
        let n = layout_shards(&mut t, 5_000_000_000);
        let total: u64 = t.iter().map(|t| t.nbytes).sum();
        assert!((19.0e9..20.0e9).contains(&(total as f64)), "{total}");
        assert_eq!(n, 4);
        // every tensor starts 8-byte aligned in the real model (all sizes are multiples of 8)
        assert!(t.iter().all(|t| t.offset % 8 == 0));
        for s in 0..n {
            let data: u64 = t.iter().filter(|x| x.shard == s).map(|x| x.nbytes).sum();
            assert!(data <= 5_000_000_000);
        }
    }
}
