//! What one output tensor is made of, and the arithmetic that makes it, bit for bit as
//! `mlx_lm.convert -q` does (mlx-lm's qwen3_5 `sanitize`, its dtype cast, then MLX's affine
//! quantizer in `crate::quant`).

use super::source::{HfSource, SrcTensor};
use crate::checkpoint::layout::{DType, WeightKind, WeightSpec};
use crate::quant::{pack_codes, quantize_group};
use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// How the source rows of a quantized weight are picked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rows {
    /// Every row, in order.
    All,
    /// Of a fused `experts.gate_up_proj [E, 2I, H]`: the first (`0`, gate) or second (`1`, up)
    /// I rows of each expert.
    FusedHalf { half: usize, experts: usize, inter: usize },
}

impl Rows {
    /// The source row of output row `r`.
    pub fn source_row(self, r: usize) -> usize {
        match self {
            Rows::All => r,
            Rows::FusedHalf { half, inter, .. } => (r / inter) * 2 * inter + half * inter + r % inter,
        }
    }
}

/// One output weight and its recipe.
#[derive(Debug, Clone)]
pub enum Job {
    /// `<name>.weight` U32 codes, `<name>.scales` / `<name>.biases` bf16.
    Quantize { name: String, src: String, rows: Rows, out_rows: usize, cols: usize, bits: usize, lead: Vec<usize> },
    /// A float tensor stored under `name`: cast to bf16 (A_log keeps its dtype, as mlx-lm's
    /// cast predicate says), plus 1.0 for the zero-centred norms of a raw HF checkpoint.
    Float { name: String, src: String, shape: Vec<usize>, keep_dtype: bool, add_one: bool },
}

/// Norm weights that HF stores zero-centred (applied as 1 + w) and MLX stores as 1 + w.
fn zero_centred(name: &str) -> bool {
    [".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight"]
        .iter()
        .any(|s| name.ends_with(s))
}

/// The jobs for Lily's tensor inventory, checked against the source's shapes and dtypes.
/// `shift_norms`: the source is raw HF (mlx-lm decides that from a conv1d weight whose last
/// dimension is not 1, never from anything else).
pub fn plan(src: &HfSource, specs: &[WeightSpec], group: usize) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    let shift_norms = src.tensors.iter().any(|(n, t)| n.ends_with("conv1d.weight") && t.shape.last() != Some(&1));
    for spec in specs {
        match &spec.kind {
            WeightKind::Quantized { experts, out, inp, bits } => {
                let lead: Vec<usize> = experts.iter().copied().collect();
                let (src_name, rows, want) = match (experts, spec.name.rsplit_once(".switch_mlp.")) {
                    (Some(e), Some((mlp, which))) => {
                        let fused = |n: &str| format!("{mlp}.experts.{n}");
                        match which {
                            "gate_proj" => (fused("gate_up_proj"), Rows::FusedHalf { half: 0, experts: *e, inter: *out }, vec![*e, 2 * out, *inp]),
                            "up_proj" => (fused("gate_up_proj"), Rows::FusedHalf { half: 1, experts: *e, inter: *out }, vec![*e, 2 * out, *inp]),
                            _ => (fused("down_proj"), Rows::All, vec![*e, *out, *inp]),
                        }
                    }
                    _ => (format!("{}.weight", spec.name), Rows::All, vec![*out, *inp]),
                };
                let t = src_tensor(src, &src_name, spec)?;
                check_shape(src, t, &want)?;
                if inp % group != 0 {
                    bail!("tensor {} ({}): input width {inp} is not a multiple of the group size {group}", t.hf_name, src.file_of(t));
                }
                jobs.push(Job::Quantize { name: spec.name.clone(), src: src_name, rows, out_rows: experts.unwrap_or(1) * out, cols: *inp, bits: *bits, lead });
            }
            WeightKind::Float { shape, alt_shapes, .. } => {
                let t = src_tensor(src, &spec.name, spec)?;
                // conv1d: HF [C, 1, K] and MLX [C, K, 1] hold the same bytes (moveaxis of a unit axis).
                if &t.shape != shape && !alt_shapes.contains(&t.shape) {
                    check_shape(src, t, shape)?;
                }
                jobs.push(Job::Float {
                    name: spec.name.clone(),
                    src: spec.name.clone(),
                    shape: shape.clone(),
                    keep_dtype: spec.name.ends_with("A_log"),
                    add_one: shift_norms && zero_centred(&spec.name),
                });
            }
        }
    }
    Ok(jobs)
}

fn src_tensor<'a>(src: &'a HfSource, name: &str, spec: &WeightSpec) -> Result<&'a SrcTensor> {
    src.get(name).map_err(|e| if name.contains(".experts.") && spec.name.contains("switch_mlp") {
        e.context("lily quantize reads fused experts (experts.gate_up_proj / experts.down_proj), as the official checkpoints store them")
    } else {
        e
    })
}

fn check_shape(src: &HfSource, t: &SrcTensor, want: &[usize]) -> Result<()> {
    if t.shape != want {
        bail!("tensor {} ({}): shape {:?}, expected {:?} for this config.json", t.hf_name, src.file_of(t), t.shape, want);
    }
    Ok(())
}

/// Element `i` of a source tensor as f32 (exact for every source dtype).
#[inline]
fn elem(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        DType::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        DType::U32 => unreachable!("refused when the source is opened"),
    }
}

/// The stored tensors of one quantized job: (U32 codes, bf16 scales, bf16 biases), as bytes.
pub fn quantize(src: &HfSource, job: &Job) -> Result<[Vec<u8>; 3]> {
    let Job::Quantize { src: name, rows, out_rows, cols, bits, .. } = job else { unreachable!("a quantize job") };
    let t = src.get(name)?;
    let (bytes, dtype, cols, bits) = (src.bytes(t), t.dtype, *cols, *bits);
    let group = 64;
    let (wpr, gpr) = (cols * bits / 32, cols / group);
    let src_row = |r: usize| rows.source_row(r);
    let mut words = vec![0u32; out_rows * wpr];
    let mut scales = vec![0u16; out_rows * gpr];
    let mut biases = vec![0u16; out_rows * gpr];
    // Blocks of rows in parallel; each worker owns its slices of the three outputs.
    const BLOCK: usize = 64;
    let bad = words
        .par_chunks_mut(wpr * BLOCK)
        .zip(scales.par_chunks_mut(gpr * BLOCK))
        .zip(biases.par_chunks_mut(gpr * BLOCK))
        .enumerate()
        .map(|(bi, ((w, s), b))| {
            let (mut row, mut codes, mut packed) = (vec![0f32; cols], Vec::with_capacity(cols), Vec::with_capacity(wpr));
            for k in 0..w.len() / wpr {
                let r = src_row(bi * BLOCK + k);
                for (j, v) in row.iter_mut().enumerate() {
                    // mlx-lm casts float weights to bf16 before quantizing (exact for bf16 sources).
                    *v = bf16::from_f32(elem(dtype, bytes, r * cols + j)).to_f32();
                }
                if row.iter().any(|v| !v.is_finite()) {
                    return Some(r);
                }
                codes.clear();
                packed.clear();
                for (g, chunk) in row.chunks(group).enumerate() {
                    let (sc, bi) = quantize_group(chunk, bits, &mut codes);
                    s[k * gpr + g] = sc.to_bits();
                    b[k * gpr + g] = bi.to_bits();
                }
                pack_codes(&codes, bits, &mut packed);
                w[k * wpr..(k + 1) * wpr].copy_from_slice(&packed);
            }
            None
        })
        .find_any(Option::is_some)
        .flatten();
    if let Some(r) = bad {
        bail!("tensor {} ({}): row {r} has a non-finite value", t.hf_name, src.file_of(t));
    }
    let le16 = |v: Vec<u16>| v.into_iter().flat_map(u16::to_le_bytes).collect::<Vec<u8>>();
    Ok([words.into_iter().flat_map(u32::to_le_bytes).collect(), le16(scales), le16(biases)])
}

/// The stored bytes and dtype of one float job.
pub fn float(src: &HfSource, job: &Job) -> Result<(DType, Vec<u8>)> {
    let Job::Float { src: name, keep_dtype, add_one, .. } = job else { unreachable!("a float job") };
    let t = src.get(name)?;
    let bytes = src.bytes(t);
    let n = bytes.len() / t.dtype.size();
    if *keep_dtype {
        return Ok((t.dtype, bytes.to_vec()));
    }
    // mlx-lm adds the 1 in the source dtype (sanitize runs before the cast), then casts to bf16.
    let out: Vec<u8> = (0..n)
        .flat_map(|i| {
            let x = elem(t.dtype, bytes, i);
            let v = if *add_one { plus_one(t.dtype, x) } else { x };
            bf16::from_f32(v).to_le_bytes()
        })
        .collect();
    Ok((DType::BF16, out))
}

/// `x + 1.0` computed in `dtype`, as MLX does (f32 arithmetic, rounded to the dtype).
fn plus_one(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(x + 1.0).to_f32(),
        DType::F16 => f16::from_f32(x + 1.0).to_f32(),
        _ => x + 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_halves_pick_the_right_rows() {
        // 2 experts, 3 rows each half: gate rows of expert 1 are source rows 6, 7, 8.
        let gate = Rows::FusedHalf { half: 0, experts: 2, inter: 3 };
        let up = Rows::FusedHalf { half: 1, experts: 2, inter: 3 };
        assert_eq!((0..6).map(|r| gate.source_row(r)).collect::<Vec<_>>(), vec![0, 1, 2, 6, 7, 8]);
        assert_eq!((0..6).map(|r| up.source_row(r)).collect::<Vec<_>>(), vec![3, 4, 5, 9, 10, 11]);
        assert!(zero_centred("language_model.model.norm.weight") && zero_centred("x.layers.0.self_attn.q_norm.weight"));
        assert!(!zero_centred("x.layers.0.linear_attn.norm.weight"));
        assert_eq!(plus_one(DType::BF16, 0.00390625), 1.0);
    }
}
