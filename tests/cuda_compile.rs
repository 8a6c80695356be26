//! CI check (no GPU needed): every kernel module (one per op family, kernels/<family>.cu, and the
//! benchmarks' modules) compiles with NVRTC to an sm_90a CUBIN holding every entry point the
//! backend loads. It compiles with device debug (`nvrtc::check_compile_cubin`): the same front
//! end and assembler as the runtime build at a third of the time; the optimised build runs on the
//! GPU machine. Needs libnvrtc (CUDA 13) on the loader path; when it cannot be loaded the test
//! prints a notice and passes (skipped). Set LILY_REQUIRE_NVRTC=1 to turn the skip into a failure (CI).

use lily::backend::cuda::nvrtc::{check_compile_cubin, module_source, nvrtc_available, nvrtc_version, timeline_source};
use lily::backend::cuda::registry::{BENCH_MODULES, MODULES};

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
    // One thread per module: NVRTC compiles separate programs concurrently, and a module takes
    // seconds on one core.
    let results: Vec<_> = std::thread::scope(|scope| {
        let jobs: Vec<_> = MODULES.iter().chain(BENCH_MODULES).map(|m| (m, scope.spawn(move || check_compile_cubin(m.name, &module_source(m.source))))).collect();
        jobs.into_iter().map(|(m, j)| (m, j.join().expect("compile thread panicked"))).collect()
    });
    let mut failures = Vec::new();
    for (m, result) in results {
        match result {
            Ok(cubin) => {
                assert!(cubin.len() > 64, "{}: empty cubin", m.name);
                // The entry points the backend loads must be present (names are in the ELF symbol table).
                for e in m.kernels {
                    assert!(cubin.windows(e.len()).any(|w| w == e.as_bytes()), "{}: entry point {e} missing from the cubin", m.name);
                }
                eprintln!("kernels/{}.cu: {} bytes of sm_90a cubin", m.name, cubin.len());
            }
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The decode timeline's build (`LILY_CUDA_TIMELINE=1`: every module with its stamps) compiles
/// too: the stamp itself lives in kernels/common.cuh, so the smallest modules check it.
#[test]
fn the_timeline_build_compiles() {
    if !nvrtc_available() {
        return; // every_kernel_compiles_for_sm90a says why
    }
    for m in MODULES.iter().filter(|m| m.name == "ops" || m.name == "sample") {
        let cubin = check_compile_cubin(m.name, &timeline_source(m.source)).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(cubin.windows(13).any(|w| w == b"lily_timeline"), "{}: no lily_timeline global", m.name);
    }
}
