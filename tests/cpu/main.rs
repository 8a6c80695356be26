//! Every integration test that needs no GPU, as one test binary: CI links it once (each file
//! under tests/ is a binary linking all of Lily), and its tests run side by side in one libtest
//! process instead of binary after binary. The GPU tests (tests/cuda_*.rs) stay binaries of
//! their own: the GPU machine packs those by name.
//!
//! `cargo test --test cpu server_http::` runs one former file's tests.

#[path = "../common/mod.rs"]
mod common;
#[path = "../fixture/mod.rs"]
mod fixture;
#[path = "../server_support/mod.rs"]
mod server_support;

mod batch_decode;
mod checkpoint_errors;
mod cpu_model;
mod decode_after;
mod fixture_ppl;
mod generate;
mod lily_bench_cli;
mod perplexity;
mod quantize;
mod server_http;
mod server_load;
mod serving;
mod synth;
mod template;
mod tokenizer;

/// Runs `body` (the test `test`, its full name) in a process of its own: this binary again, with
/// only that test selected. For a test that measures the whole process (its RSS), which the
/// tests running beside it here would disturb.
pub fn alone(test: &str, body: impl FnOnce()) {
    const ALONE: &str = "LILY_TEST_ALONE";
    if std::env::var_os(ALONE).is_some_and(|t| t == test) {
        return body();
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe).args([test, "--exact", "--nocapture"]).env(ALONE, test).output().expect("run the test binary");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprint!("{stderr}");
    assert!(out.status.success(), "{test}, in a process of its own, failed:\n{stdout}");
    assert!(stdout.contains("test result: ok. 1 passed"), "{test} did not run in its own process:\n{stdout}");
}
