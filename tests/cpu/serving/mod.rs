//! The serving core through the real server on the tiny model: continuous batching, the prefix
//! cache on real conversations, structured output.

mod batching;
mod prefix_cache;
mod structured_output;
