//! CI check (no GPU needed): every kernel in kernels/*.cu compiles with NVRTC to an sm_90a CUBIN.
//! Needs libnvrtc (CUDA 13) on the loader path; when it cannot be loaded the test prints a
//! notice and passes (skipped). Set LILY_REQUIRE_NVRTC=1 to turn the skip into a failure (CI).

use lily::backend::cuda::context::{
    compile_cubin, module_source, nvrtc_available, nvrtc_version, MODULES,
};
use lily::backend::cuda::prefill;

#[test]
fn every_kernel_compiles_for_sm90a() {
    if !nvrtc_available() {
        if std::env::var_os("LILY_REQUIRE_NVRTC").is_some_and(|v| v == "1") {
            panic!("LILY_REQUIRE_NVRTC=1 but libnvrtc could not be loaded (set LD_LIBRARY_PATH to the nvidia-cuda-nvrtc wheel's nvidia/cu13/lib)");
        }
        eprintln!("SKIPPED: libnvrtc not found; kernels were not compile-checked (set LD_LIBRARY_PATH to a CUDA 13 NVRTC)");
        return;
    }
    let (maj, min) = nvrtc_version().expect("nvrtcVersion");
    eprintln!("NVRTC {maj}.{min}");
    let mut failures = Vec::new();
    // The decode modules, loaded at start-up, and the prefill module, loaded on first use.
    let prefill_module: (&str, &str, &[&str]) = ("prefill", prefill::SOURCE, prefill::ENTRIES);
    for (name, src, entries) in MODULES.iter().chain(std::iter::once(&prefill_module)) {
        match compile_cubin(name, &module_source(src)) {
            Ok(cubin) => {
                assert!(cubin.len() > 64, "{name}: empty cubin");
                // The entry points the backend loads must be present (names are in the ELF symbol table).
                for e in entries.iter() {
                    assert!(
                        cubin.windows(e.len()).any(|w| w == e.as_bytes()),
                        "{name}: entry point {e} missing from the cubin"
                    );
                }
                eprintln!("kernels/{name}.cu: {} bytes of sm_90a cubin", cubin.len());
            }
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
