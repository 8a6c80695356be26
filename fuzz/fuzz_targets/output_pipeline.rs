//! Generated text through stop strings, reasoning split and tool-call parsing, cut at arbitrary
//! points: must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lily::server::fuzz::output_pipeline(data);
});
