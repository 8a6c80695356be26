//! The kernel registry: one module per op family (`kernels/<family>.cu`, `kernels/common.cuh`
//! prepended), compiled by NVRTC and loaded into a CUDA context on first use, its functions looked
//! up by name and kept.

use super::nvrtc::{cubin_cached, module_source, timeline_source};
use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One op family's kernel source and its entry points.
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// A kernel of a module. `waits`: it executes `griddepcontrol.wait` before touching anything the
/// previous kernel of the stream writes, so it may launch as a programmatic dependent (PDL).
/// `stamps`: its block 0 leaves a decode-timeline stamp (kernels/common.cuh `tl_stamp`; every
/// dependent kernel does in `pdl_wait`, the in-order decode kernels at entry).
#[derive(Clone, Copy)]
pub struct Kernel {
    pub module: &'static Module,
    pub name: &'static str,
    pub waits: bool,
    pub stamps: bool,
}

impl Kernel {
    /// A kernel that waits for its predecessor inside (the decode kernels).
    pub const fn dependent(module: &'static Module, name: &'static str) -> Self {
        Kernel { module, name, waits: true, stamps: true }
    }
    /// A kernel that must start after its predecessor finished (the prefill kernels).
    pub const fn ordered(module: &'static Module, name: &'static str) -> Self {
        Kernel { module, name, waits: false, stamps: false }
    }
    /// An in-order kernel of the decode steps that calls `tl_stamp()` at entry.
    pub const fn ordered_stamping(module: &'static Module, name: &'static str) -> Self {
        Kernel { module, name, waits: false, stamps: true }
    }
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}::{}", self.module.name, self.name)
    }
}

/// Quantised-weight products: decode GEMVs, prefill GEMMs, embedding rows, dequantisation.
pub const QMATMUL: Module = Module {
    name: "qmatmul",
    source: include_str!("../../../kernels/qmatmul.cu"),
    kernels: &[
        "gemv_q",
        "gemv_q_split",
        "gemv_tc",
        "gemv_tc_f",
        "gemv_tcb",
        "gemv_tcb_f",
        "gemv_tcb_w",
        "gemv_tcb_wf",
        "gemv_tcq",
        "stage_tcb",
        "embed_q",
        "pf_gemm",
        "pf_gemm_tc",
        "pf_gemm_skinny",
        "pf_few_tc_4_4",
        "pf_few_tc_4_8",
        "pf_few_tc_8_4",
        "pf_few_tc_8_8",
        "pf_few_tc_s_4_4",
        "pf_few_tc_s_4_8",
        "pf_few_tc_s_8_4",
        "pf_few_tc_s_8_8",
        "pf_dequant_bf16",
        "pf_to_bf16",
        "pf_embed",
    ],
};

/// Gated DeltaNet: the decode step, the prefill conv, norms and scan.
pub const GDN: Module = Module {
    name: "gdn",
    source: include_str!("../../../kernels/gdn.cu"),
    kernels: &[
        "gdn_step",
        "gdn_step_f16",
        "gdn_step_35b",
        "gdn_step_35b_f16",
        "gdn_step_batch",
        "gdn_step_batch_f16",
        "gdn_step_batch_35b",
        "gdn_step_batch_35b_f16",
        "gdn_step_persist",
        "gdn_step_persist_f16",
        "gdn_step_persist_35b",
        "gdn_step_persist_35b_f16",
        "pf_gdn_conv",
        "pf_gdn_conv_bf16",
        "pf_gdn_ring",
        "pf_gdn_conv_qk",
        "pf_gdn_conv_qk_bf16",
        "pf_gdn_scan_32",
        "pf_gdn_scan_64",
        "pf_gdn_scan_128",
        "pf_gdn_scan_32_f16",
        "pf_gdn_scan_64_f16",
        "pf_gdn_scan_128_f16",
        "pf_gdn_chunk_prep_64",
        "pf_gdn_chunk_prep_64_bf16",
        "pf_gdn_chunk_walk_64",
        "pf_gdn_chunk_walk_64_f16",
        "pf_gdn_chunk_prep_128",
        "pf_gdn_chunk_prep_128_bf16",
        "pf_gdn_chunk_walk_128",
        "pf_gdn_chunk_walk_128_f16",
        "pf_gdn_norm",
        "pf_gdn_norm_bf16",
    ],
};

/// Gated attention: norms + RoPE + KV append, split-KV decode and its combine, flash prefill.
pub const ATTENTION: Module = Module {
    name: "attention",
    source: include_str!("../../../kernels/attention.cu"),
    kernels: &[
        "attn_prep",
        "attn_prep_bf16",
        "attn_split_64",
        "attn_split_128",
        "attn_split_256",
        "attn_split_64_bf16",
        "attn_split_128_bf16",
        "attn_split_256_bf16",
        "attn_combine",
        "attn_prep_batch",
        "attn_prep_batch_bf16",
        "attn_split_batch_64",
        "attn_split_batch_128",
        "attn_split_batch_256",
        "attn_split_batch_64_bf16",
        "attn_split_batch_128_bf16",
        "attn_split_batch_256_bf16",
        "attn_split_tc_batch_64",
        "attn_split_tc_batch_128",
        "attn_split_tc_batch_256",
        "attn_combine_batch",
        "pf_attn_prep",
        "pf_attn_prep_bf16",
        "pf_attn_prep_q16",
        "pf_attn_64",
        "pf_attn_128",
        "pf_attn_256",
        "pf_attn_64_bf16",
        "pf_attn_128_bf16",
        "pf_attn_256_bf16",
        "pf_attn_tc_64",
        "pf_attn_tc_128",
        "pf_attn_tc_256",
        "pf_attn_tc_64_bf16",
        "pf_attn_tc_128_bf16",
        "pf_attn_tc_256_bf16",
        "pf_attn_wg_64",
        "pf_attn_wg_128",
        "pf_attn_wg_256",
        "pf_attn_wg_q16_64",
        "pf_attn_wg_q16_128",
        "pf_attn_wg_q16_256",
    ],
};

/// Mixture of experts: decode experts (routing fused), prefill routing, slot lists and combine.
pub const MOE: Module = Module {
    name: "moe",
    source: include_str!("../../../kernels/moe.cu"),
    kernels: &[
        "moe_gate_up",
        "moe_down",
        "moe_gate_up_tc",
        "moe_down_tc",
        "moe_gate_up_tc_f",
        "moe_down_tc_f",
        "moe_tcb",
        "moe_tcp",
        "moe_tcr",
        "moe_tcb_f",
        "moe_tcp_f",
        "moe_tcr_f",
        "moe_tcr_f_35b",
        "moe_tcq_f",
        "moe_tcq_f_35b",
        "stage_wg",
        "pf_moe_wg_glu",
        "pf_moe_wg_glu_f",
        "pf_moe_wg_glu_mc",
        "pf_moe_wg_down_res",
        "pf_moe_wg_down_res_f",
        "moe_route_batch_1",
        "moe_route_batch_4",
        "moe_route_batch_1_35b",
        "moe_route_batch_4_35b",
        "pf_route",
        "pf_scan",
        "pf_scatter",
        "pf_moe_combine",
        "pf_moe_combine_bf16",
        "pf_moe_combine_bf16_sh16",
        "pf_moe_combine_norm_bf16",
        "pf_moe_combine_norm_bf16_sh16",
    ],
};

/// Row-wise and elementwise operations of the layers (RMSNorm, SwiGLU).
pub const OPS: Module = Module {
    name: "ops",
    source: include_str!("../../../kernels/ops.cu"),
    kernels: &["pf_rmsnorm", "pf_swiglu", "readback_words", "copy_words16"],
};

/// Token choice on the device.
pub const SAMPLE: Module = Module {
    name: "sample",
    source: include_str!("../../../kernels/sample.cu"),
    kernels: &["argmax_next", "sample_prep", "sample_select", "sample_draw", "sample_small_k"],
};

/// Every module, in load order.
pub const MODULES: &[&Module] = &[&QMATMUL, &GDN, &ATTENTION, &MOE, &OPS, &SAMPLE];

/// The decode hand-over microbenchmark (`lily-bench --handover`, handover.rs): not a model's
/// kernels, so not in `MODULES` (it loads on first use, never at start-up).
pub const HANDOVER: Module = Module {
    name: "handover",
    source: include_str!("../../../kernels/handover.cu"),
    kernels: &["ho_gemv", "ho_persist"],
};

/// The modules outside `MODULES` (compile-checked with them).
pub const BENCH_MODULES: &[&Module] = &[&HANDOVER];

/// Shared memory (static and dynamic together) a block may use without the opt-in attribute.
const SMEM_DEFAULT_LIMIT: u32 = 48 * 1024;

/// Dynamic shared memory a block may opt into on sm_90 (227 KiB).
pub const SMEM_OPTIN_LIMIT: u32 = 227 * 1024;

/// The loaded modules of one CUDA context.
pub struct Registry {
    ctx: Arc<CudaContext>,
    modules: Mutex<HashMap<&'static str, Loaded>>,
    /// With the decode timeline: its buffer's address, written into each module as it loads
    /// (every module is then compiled with `LILY_TIMELINE`; timeline.rs), and the stream to write
    /// it on.
    timeline: Option<(u64, Arc<CudaStream>)>,
}

struct Loaded {
    module: Arc<CudaModule>,
    /// Functions looked up so far, with the dynamic shared memory each may launch with now.
    funcs: HashMap<&'static str, (CudaFunction, u32)>,
}

impl Registry {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Registry { ctx, modules: Mutex::new(HashMap::new()), timeline: None }
    }

    /// Compiles every module from now on with the timeline's stamps, pointed at the buffer at
    /// `addr` (before any module loads).
    pub fn set_timeline(&mut self, addr: u64, stream: Arc<CudaStream>) {
        self.timeline = Some((addr, stream));
    }

    /// The source of module `m` as compiled here.
    fn source(&self, m: &Module) -> String {
        if self.timeline.is_some() {
            timeline_source(m.source)
        } else {
            module_source(m.source)
        }
    }

    /// Compiles (or reads from the cubin cache) and loads every module of `MODULES` that is not
    /// loaded, the compilations side by side (NVRTC takes ~45 s for all of them one after
    /// another on a cold cache, the MoE module ~19 s alone).
    pub fn load_all(&self) -> Result<()> {
        let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let missing: Vec<&'static Module> = MODULES.iter().copied().filter(|m| !mods.contains_key(m.name)).collect();
        let cubins: Vec<Result<Vec<u8>>> = missing.par_iter().map(|m| cubin_cached(m.name, &self.source(m))).collect();
        for (m, cubin) in missing.into_iter().zip(cubins) {
            self.load_locked(&mut mods, m, Some(cubin?))?;
        }
        Ok(())
    }

    fn load_locked<'a>(
        &self,
        mods: &'a mut HashMap<&'static str, Loaded>,
        m: &'static Module,
        cubin: Option<Vec<u8>>,
    ) -> Result<&'a mut Loaded> {
        if !mods.contains_key(m.name) {
            let cubin = match cubin {
                Some(c) => c,
                None => cubin_cached(m.name, &self.source(m))?,
            };
            let module = self
                .ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| anyhow!("loading kernels/{}.cu: {e:?}", m.name))?;
            if let Some((addr, stream)) = &self.timeline {
                let mut global = module
                    .get_global("lily_timeline", stream)
                    .map_err(|e| anyhow!("kernels/{}.cu: no lily_timeline: {e:?}", m.name))?;
                stream
                    .memcpy_htod(&addr.to_le_bytes(), &mut global)
                    .map_err(|e| anyhow!("kernels/{}.cu: setting lily_timeline: {e:?}", m.name))?;
            }
            mods.insert(m.name, Loaded { module, funcs: HashMap::new() });
        }
        Ok(mods.get_mut(m.name).expect("inserted above"))
    }

    /// The function of `k`, loading its module on first use, opted in to `smem` bytes of dynamic
    /// shared memory when that and its static shared memory together pass the default limit.
    pub fn function(&self, k: Kernel, smem: u32) -> Result<CudaFunction> {
        let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = self.load_locked(&mut mods, k.module, None)?;
        if !loaded.funcs.contains_key(k.name) {
            let f = loaded.module.load_function(k.name).map_err(|e| {
                anyhow!("kernel {} missing from kernels/{}.cu: {e:?}", k.name, k.module.name)
            })?;
            let allowed = dynamic_smem_allowed(SMEM_DEFAULT_LIMIT, static_smem(&f, k)?);
            loaded.funcs.insert(k.name, (f, allowed));
        }
        let (f, optin) = loaded.funcs.get_mut(k.name).expect("inserted above");
        if smem > *optin {
            f.set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| anyhow!("{k:?}: {smem} bytes of shared memory: {e:?}"))?;
            *optin = smem;
        }
        Ok(f.clone())
    }
}

/// The static shared memory of `f` (its `__shared__` arrays).
fn static_smem(f: &CudaFunction, k: Kernel) -> Result<u32> {
    let bytes = f
        .get_attribute(sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .map_err(|e| anyhow!("{k:?}: its static shared memory: {e:?}"))?;
    Ok(u32::try_from(bytes).unwrap_or(0))
}

/// The dynamic shared memory a launch may ask for under a block limit of `limit` bytes: the
/// limit is on static and dynamic together.
fn dynamic_smem_allowed(limit: u32, static_bytes: u32) -> u32 {
    limit.saturating_sub(static_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_shared_memory_counts_against_the_default_limit() {
        assert_eq!(dynamic_smem_allowed(SMEM_DEFAULT_LIMIT, 0), 48 * 1024);
        // A kernel with 10 KB static and 40 KB dynamic passes 48 KB only together: it needs the
        // opt-in although its dynamic part alone is under the line.
        assert!(40 * 1024 > dynamic_smem_allowed(SMEM_DEFAULT_LIMIT, 10 * 1024));
        assert_eq!(dynamic_smem_allowed(SMEM_DEFAULT_LIMIT, 64 * 1024), 0);
    }

    #[test]
    fn module_names_and_entry_points_are_unique() {
        let mut names = std::collections::HashSet::new();
        for m in MODULES.iter().chain(BENCH_MODULES) {
            assert!(names.insert(m.name), "module {} twice", m.name);
            for k in m.kernels {
                assert!(names.insert(k), "kernel {k} in two modules");
            }
        }
    }
}
