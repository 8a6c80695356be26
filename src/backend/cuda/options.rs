//! Every setting of the CUDA backend in one place, read once when the backend is made.
//!
//! User options (README): the KV cache element type, the prefill chunk, cuBLAS on/off; the kernel
//! cache lives under `$LILY_CACHE_DIR/kernels` (the same cache root as the embedded default model).
//! Developer knobs (docs/cuda.md): the phase profile, CUDA graphs off, programmatic dependent
//! launch off, the exact f32 prefill and the decode-step forward (`lily logits` flags). Test-only
//! fields have no environment variable: tests set them on the struct.

/// Tokens per prefill chunk unless `LILY_CUDA_PREFILL_CHUNK` says otherwise. Long chunks fill the
/// grouped expert tiles better (8,192 tokens put ~256 slots, two full 128-slot tiles, on each of
/// 256 experts) and dequantise the dense weights for cuBLAS less often; the scratch is ~2.2 GB for
/// the 35B model at 8,192 (~0.8 GB at 4,096). The server's turns while rows decode stay shorter
/// (`server::worker::PREFILL_CHUNK`), so this bounds a backend call, not a decode stall.
pub const DEFAULT_PREFILL_CHUNK: usize = 8192;

/// Share of the device's memory the backend plans to use (weights, scratch and sequences); the
/// rest is left to the driver and transient allocations.
pub const DEFAULT_MEMORY_FRACTION: f64 = 0.9;

/// Fewest tokens per chunk for which dequantising a dense matrix for cuBLAS beats the fused
/// tensor-core GEMM.
pub const CUBLAS_MIN_TOKENS: usize = 128;

/// 4-bit sets of fewer 16-row tiles than this stay on the CUDA-core GEMV (the tiny model's; the
/// 35B's 2,048-row out-projections, 128 tiles, run on the tensor cores: docs/cuda.md).
pub const GEMV_TC_MIN_TILES: usize = 128;

#[derive(Clone, Debug, PartialEq)]
pub struct CudaOptions {
    /// The GPU to run on, an index among the visible ones (`--gpu`, `LILY_CUDA_DEVICE`).
    pub device: usize,
    /// New sequences keep their attention KV cache in bf16 (`LILY_KV_BF16`, `--kv-cache`;
    /// default on: half the memory and half the long-context attention traffic).
    pub kv_bf16: bool,
    /// The Gated DeltaNet recurrent states are stored in f16 instead of f32 (`LILY_GDN_STATE=f16`,
    /// `--gdn-state`): half the bytes each decode step reads and writes per sequence and layer,
    /// and half a sequence's state memory; the arithmetic stays f32 (default on; the rounding's
    /// cost is measured in docs/correctness.md; `LILY_GDN_STATE=f32` and the exact paths keep f32).
    pub gdn_state_f16: bool,
    /// Share of the device's total memory for weights, scratch and sequences
    /// (`LILY_GPU_MEMORY_FRACTION`, `--gpu-memory-fraction`): sequences draw on what is left of it
    /// after everything else on the device, and work that does not fit waits.
    pub memory_fraction: f64,
    /// Test-only: caps the sequence memory budget at this many bytes.
    pub sequence_memory_cap: Option<usize>,
    /// Tokens per prefill chunk (`LILY_CUDA_PREFILL_CHUNK`).
    pub prefill_chunk: usize,
    /// Dense prefill GEMMs of long chunks through cuBLAS when libcublas loads
    /// (`LILY_CUDA_CUBLAS=0` keeps the built-in kernels).
    pub cublas: bool,
    /// `LILY_CUDA_PROFILE=1`: direct launches with an event after every phase; per-phase GPU time
    /// is printed after each prefill and when the backend is dropped (decode).
    pub profile: bool,
    /// `LILY_CUDA_TIMELINE=1`: kernels compiled with timeline stamps; where a graph step's time
    /// goes per phase and kernel is printed when the backend is dropped (timeline.rs).
    pub timeline: bool,
    /// Decode steps replay captured CUDA graphs (`LILY_CUDA_GRAPH=0` launches directly).
    pub graphs: bool,
    /// Decode kernels launch as programmatic dependents of the previous kernel
    /// (`LILY_CUDA_PDL=0` turns it off; results are identical either way).
    pub pdl: bool,
    /// Prefill GEMMs and attention in f32 FMA kernels that agree with the CPU reference to
    /// rounding (`LILY_PREFILL_F32=1`, `lily logits --exact-prefill`) instead of bf16 tensor cores.
    pub exact_prefill: bool,
    /// Multi-token forwards run the decode step once per token instead of the prefill kernels, so
    /// `lily logits --decode-forward` measures the decode kernels on every position.
    pub decode_forward: bool,
    /// Test-only: false adds the long chunks' MoE output into the residual in a launch of its own
    /// instead of in the next layer's input norm (`moe::combine_norm_bf16`; the same values).
    pub fuse_combine_norm: bool,
    /// Test-only: see [`GEMV_TC_MIN_TILES`] (0 puts every 4-bit set on the tensor-core GEMV).
    pub gemv_tc_min_tiles: usize,
    /// Test-only: see [`CUBLAS_MIN_TOKENS`] (0 sends every dense prefill GEMM to cuBLAS).
    pub cublas_min_tokens: usize,
    /// Test-only: run the CUDA-core MoE decode kernels even where the tensor-core ones apply.
    pub force_cuda_core_moe: bool,
    /// Test-only: see [`super::moe::TCB_PREFILL_TOKENS`] (0 sends every prefill chunk's routed
    /// experts to the wgmma kernels).
    pub tcb_prefill_tokens: usize,
    /// Test-only: the batched GDN step on this many persistent blocks whatever the batch (0:
    /// `gdn_step_batch`, a block per item), instead of [`super::gdn::select_step_batch`]'s choice.
    pub gdn_step_blocks: Option<usize>,
    /// Test-only: the batched decode's attention splits on the CUDA cores even where the
    /// tensor-core kernel applies.
    pub attn_split_cuda_core: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            kv_bf16: true,
            gdn_state_f16: true,
            memory_fraction: DEFAULT_MEMORY_FRACTION,
            sequence_memory_cap: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            cublas: true,
            profile: false,
            timeline: false,
            graphs: true,
            pdl: true,
            exact_prefill: false,
            decode_forward: false,
            fuse_combine_norm: true,
            gemv_tc_min_tiles: GEMV_TC_MIN_TILES,
            cublas_min_tokens: CUBLAS_MIN_TOKENS,
            force_cuda_core_moe: false,
            tcb_prefill_tokens: super::moe::TCB_PREFILL_TOKENS,
            gdn_step_blocks: None,
            attn_split_cuda_core: false,
        }
    }
}

impl CudaOptions {
    /// The defaults with the documented environment variables applied.
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] over any variable source (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let d = CudaOptions::default();
        let flag = |k: &str, default: bool| match get(k).as_deref() {
            Some("1") => true,
            Some("0") => false,
            _ => default,
        };
        CudaOptions {
            device: get("LILY_CUDA_DEVICE").and_then(|v| v.parse().ok()).unwrap_or(d.device),
            kv_bf16: flag("LILY_KV_BF16", d.kv_bf16),
            gdn_state_f16: match get("LILY_GDN_STATE").as_deref() {
                Some("f16") => true,
                Some("f32") => false,
                _ => d.gdn_state_f16,
            },
            memory_fraction: get("LILY_GPU_MEMORY_FRACTION")
                .and_then(|v| v.parse().ok())
                .filter(|f| valid_memory_fraction(*f))
                .unwrap_or(d.memory_fraction),
            prefill_chunk: get("LILY_CUDA_PREFILL_CHUNK")
                .and_then(|v| v.parse().ok())
                .filter(|&c: &usize| c > 0)
                .unwrap_or(d.prefill_chunk),
            cublas: flag("LILY_CUDA_CUBLAS", d.cublas),
            profile: flag("LILY_CUDA_PROFILE", d.profile),
            timeline: flag("LILY_CUDA_TIMELINE", d.timeline),
            graphs: flag("LILY_CUDA_GRAPH", d.graphs),
            pdl: flag("LILY_CUDA_PDL", d.pdl),
            exact_prefill: flag("LILY_PREFILL_F32", d.exact_prefill),
            ..d
        }
    }
}

/// A usable `memory_fraction`: above 0, at most 1.
pub fn valid_memory_fraction(f: f64) -> bool {
    f > 0.0 && f <= 1.0
}

/// `--gpu-memory-fraction` as clap parses it.
pub fn parse_memory_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if valid_memory_fraction(f) => Ok(f),
        _ => Err(format!("{s:?} is not a fraction in (0, 1]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> CudaOptions {
        CudaOptions::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn defaults_without_environment() {
        assert_eq!(with(&[]), CudaOptions::default());
        let d = CudaOptions::default();
        assert!(d.kv_bf16 && d.cublas && d.graphs && d.pdl);
        assert!(!d.profile && !d.timeline && !d.exact_prefill && !d.decode_forward && !d.force_cuda_core_moe);
        assert_eq!(d.prefill_chunk, 8192);
    }

    #[test]
    fn documented_variables_apply() {
        let o = with(&[
            ("LILY_KV_BF16", "0"),
            ("LILY_CUDA_PREFILL_CHUNK", "512"),
            ("LILY_CUDA_CUBLAS", "0"),
            ("LILY_CUDA_PROFILE", "1"),
            ("LILY_CUDA_TIMELINE", "1"),
            ("LILY_CUDA_GRAPH", "0"),
            ("LILY_CUDA_PDL", "0"),
            ("LILY_PREFILL_F32", "1"),
            ("LILY_GPU_MEMORY_FRACTION", "0.5"),
            ("LILY_GDN_STATE", "f16"),
        ]);
        assert_eq!(o.memory_fraction, 0.5);
        assert!(o.gdn_state_f16 && !with(&[("LILY_GDN_STATE", "f32")]).gdn_state_f16);
        assert!(!o.kv_bf16 && !o.cublas && o.profile && o.timeline && !o.graphs && !o.pdl && o.exact_prefill);
        assert_eq!(o.prefill_chunk, 512);
    }

    #[test]
    fn bad_values_keep_the_default() {
        let o = with(&[("LILY_CUDA_PREFILL_CHUNK", "0"), ("LILY_CUDA_PDL", "maybe"), ("LILY_GPU_MEMORY_FRACTION", "1.5"), ("LILY_GDN_STATE", "bf16")]);
        assert_eq!(o, CudaOptions::default());
        let o = with(&[("LILY_CUDA_PREFILL_CHUNK", "lots"), ("LILY_GPU_MEMORY_FRACTION", "0")]);
        assert_eq!(o.prefill_chunk, DEFAULT_PREFILL_CHUNK);
        assert_eq!(o.memory_fraction, DEFAULT_MEMORY_FRACTION);
    }
}
