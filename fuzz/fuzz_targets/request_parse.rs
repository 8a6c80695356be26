//! Request bodies: parsing (both endpoints) and chat-template rendering must never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lily::server::fuzz::request_and_template(data);
});
