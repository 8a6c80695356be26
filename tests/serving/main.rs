//! The serving core through the real server on the tiny model (one test binary, so CI links it
//! once): continuous batching, the prefix cache on real conversations, structured output.

#[path = "../server_support/mod.rs"]
mod server_support;

mod batching;
mod prefix_cache;
mod structured_output;
