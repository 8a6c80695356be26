//! Deterministic, counter-based generation of tensor bytes.
//!
//! Every byte of a synthetic tensor is a pure function of `(seed, tensor name, element index)`:
//! random words come from splitmix64 evaluated at an arbitrary counter position, so any chunking
//! (and any number of threads) produces the same bytes. Only IEEE-exact float operations are used
//! (`+ - * /` and `sqrt`), never `ln`/`cos`/`exp`, so the output is identical on every libm.

use crate::checkpoint::layout::{DType, Init};
use half::{bf16, f16};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 output function (a bijective 64-bit mixer).
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Word `i` of the random stream `key` (splitmix64 at position `i`, random access).
#[inline(always)]
pub fn word(key: u64, i: u64) -> u64 {
    mix64(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// The stream key of one named stream under `seed` (FNV-1a of the name, mixed with the seed).
pub fn stream_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(mix64(seed ^ 0x6c69_6c79_5f73_796e) ^ mix64(h))
}

/// Uniform in [0, 1) with 24 random bits (exact in f32).
#[inline(always)]
fn unit24(x: u64) -> f32 {
    (x >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// Approximately standard normal: Irwin–Hall sum of four 16-bit uniforms, centred and scaled to
/// unit variance (range ±2√3). Every intermediate is exact in f32.
#[inline(always)]
fn normal_ih4(x: u64) -> f32 {
    let u = |k: u32| ((x >> (16 * k)) & 0xFFFF) as f32 + 0.5;
    let sum = (u(0) + u(1)) + (u(2) + u(3)); // in [2, 262142], multiples of 0.5: exact
    (sum * (1.0 / 65_536.0) - 2.0) * SQRT_3
}

const SQRT_3: f32 = 1.732_050_8;

/// A sample of `init` from one random word.
#[inline(always)]
fn sample(init: Init, x: u64) -> f32 {
    match init {
        Init::Normal(std) => std * normal_ih4(x),
        Init::Around { center, spread } => center + spread * (2.0 * unit24(x) - 1.0),
        Init::Uniform { lo, hi } => lo + (hi - lo) * unit24(x),
    }
}

/// `v` rounded to `dtype` and back (what a reader will see).
#[inline(always)]
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::F32 | DType::U32 => v,
    }
}

#[inline(always)]
fn put(dtype: DType, v: f32, out: &mut [u8]) {
    match dtype {
        DType::BF16 => out.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DType::F16 => out.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        DType::F32 => out.copy_from_slice(&v.to_le_bytes()),
        DType::U32 => out.copy_from_slice(&(v as u32).to_le_bytes()),
    }
}

/// Mean of the squared scale jitter `j ~ U(0.75, 1.25)`: `1 + 0.25²/3 = 49/48`.
const JITTER_SQ_MEAN: f64 = 49.0 / 48.0;

/// Per-group scale and bias of an affine-quantized weight whose codes are uniform over
/// `0..2^bits`, so that `scale*q + bias` follows `init` in mean and standard deviation.
#[derive(Debug, Clone, Copy)]
pub struct AffineParams {
    bits: usize,
    init: Init,
    /// Base scale (Normal) or the exact scale (Around/Uniform).
    base: f32,
}

impl AffineParams {
    pub fn new(bits: usize, init: Init) -> Self {
        let levels = (1u64 << bits) as f64;
        let base = match init {
            // Var(q) = (L² - 1)/12 for q uniform on 0..L; E[scale²] = base² · 49/48.
            Init::Normal(std) => std as f64 / ((levels * levels - 1.0) / 12.0 * JITTER_SQ_MEAN).sqrt(),
            Init::Around { spread, .. } => 2.0 * spread as f64 / levels,
            Init::Uniform { lo, hi } => (hi as f64 - lo as f64) / levels,
        };
        AffineParams { bits, init, base: base as f32 }
    }

    /// (scale, bias) of group `g` as stored in `dtype` (the bias is derived from the rounded
    /// scale, so the group mean is ~0 after rounding).
    #[inline(always)]
    pub fn group(&self, key: u64, g: u64, dtype: DType) -> (f32, f32) {
        let mid = ((1u32 << self.bits) - 1) as f32 * 0.5;
        match self.init {
            Init::Normal(_) => {
                let jitter = 0.75 + 0.5 * unit24(word(key, g));
                let s = round_to(dtype, self.base * jitter);
                (s, round_to(dtype, -s * mid))
            }
            // Codes cover [lo, hi) in 2^bits equal cells; each code sits at its cell centre.
            Init::Around { center, spread } => {
                let s = round_to(dtype, self.base);
                (s, round_to(dtype, center - spread + 0.5 * s))
            }
            Init::Uniform { lo, .. } => {
                let s = round_to(dtype, self.base);
                (s, round_to(dtype, lo + 0.5 * s))
            }
        }
    }
}

/// How the bytes of one stored tensor are produced.
#[derive(Debug, Clone, Copy)]
pub enum Fill {
    /// Uniformly random bytes: packed quantization codes, uniform over all `2^bits` codes.
    Bits { key: u64 },
    /// Per-group scales (`bias == false`) or biases of an affine-quantized weight; both use the
    /// same `key` so they agree group by group.
    Affine { key: u64, params: AffineParams, bias: bool },
    /// A float tensor drawn element-wise from `init`.
    Float { key: u64, init: Init },
}

impl Fill {
    /// Writes the bytes `[byte_start, byte_start + out.len())` of the tensor (stored as
    /// `dtype`) into `out`. `byte_start` must be a multiple of 8 and `out.len()` a multiple of
    /// the element size.
    pub fn fill(&self, dtype: DType, byte_start: u64, out: &mut [u8]) {
        debug_assert_eq!(byte_start % 8, 0);
        let es = dtype.size();
        debug_assert_eq!(out.len() % es, 0);
        match *self {
            Fill::Bits { key } => {
                let first = byte_start / 8;
                let mut chunks = out.chunks_exact_mut(8);
                let mut i = first;
                for c in &mut chunks {
                    c.copy_from_slice(&word(key, i).to_le_bytes());
                    i += 1;
                }
                let rest = chunks.into_remainder();
                if !rest.is_empty() {
                    let n = rest.len();
                    rest.copy_from_slice(&word(key, i).to_le_bytes()[..n]);
                }
            }
            Fill::Affine { key, params, bias } => {
                let first = byte_start / es as u64;
                // Two loops so the unused half of `group` is optimised away.
                if bias {
                    for (i, c) in out.chunks_exact_mut(es).enumerate() {
                        put(dtype, params.group(key, first + i as u64, dtype).1, c);
                    }
                } else {
                    for (i, c) in out.chunks_exact_mut(es).enumerate() {
                        put(dtype, params.group(key, first + i as u64, dtype).0, c);
                    }
                }
            }
            Fill::Float { key, init } => {
                let first = byte_start / es as u64;
                for (i, c) in out.chunks_exact_mut(es).enumerate() {
                    put(dtype, sample(init, word(key, first + i as u64)), c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_does_not_change_bytes() {
        let fills = [
            (Fill::Bits { key: 7 }, DType::U32),
            (Fill::Affine { key: 9, params: AffineParams::new(4, Init::Normal(0.02)), bias: true }, DType::BF16),
            (Fill::Float { key: 11, init: Init::Normal(0.5) }, DType::BF16),
            (Fill::Float { key: 13, init: Init::Uniform { lo: -3.0, hi: 1.0 } }, DType::F32),
        ];
        for (f, dt) in fills {
            let n = 1000 * dt.size() + 4; // not a multiple of 8
            let mut whole = vec![0u8; n];
            f.fill(dt, 0, &mut whole);
            let mut pieces = vec![0u8; n];
            let mut start = 0;
            for step in [8usize, 64, 24, 400].iter().cycle() {
                if start >= n {
                    break;
                }
                let end = (start + step).min(n);
                f.fill(dt, start as u64, &mut pieces[start..end]);
                start = end;
            }
            assert_eq!(whole, pieces);
        }
    }

    #[test]
    fn normal_is_centred_with_unit_variance() {
        let key = stream_key(1, "x");
        let n = 200_000;
        let (mut s1, mut s2) = (0f64, 0f64);
        for i in 0..n {
            let z = normal_ih4(word(key, i)) as f64;
            s1 += z;
            s2 += z * z;
        }
        let mean = s1 / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0).abs() < 0.02, "{var}");
    }

    #[test]
    fn known_answer() {
        // Pins the generator: a change here changes every synthetic checkpoint.
        assert_eq!(mix64(0), 0);
        assert_eq!(word(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_ne!(stream_key(0, "a"), stream_key(1, "a"));
        assert_ne!(stream_key(0, "a"), stream_key(0, "b"));
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    #[test]
    #[ignore]
    fn fill_speed() {
        let mut buf = vec![0u8; 64 << 20];
        for (name, f, dt) in [
            ("bits", Fill::Bits { key: 1 }, DType::U32),
            ("affine", Fill::Affine { key: 2, params: AffineParams::new(4, Init::Normal(0.02)), bias: true }, DType::BF16),
            ("float", Fill::Float { key: 3, init: Init::Normal(0.5) }, DType::BF16),
        ] {
            let t = std::time::Instant::now();
            for i in 0..4 {
                f.fill(dt, i * buf.len() as u64, &mut buf);
            }
            let s = t.elapsed().as_secs_f64();
            eprintln!("{name}: {:.2} GB/s", 4.0 * buf.len() as f64 / s / 1e9);
        }
        let t = std::time::Instant::now();
        for _ in 0..4 {
            buf.clear();
            buf.resize(64 << 20, 0);
        }
        eprintln!("memset: {:.2} GB/s", 4.0 * (64u64 << 20) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
}
