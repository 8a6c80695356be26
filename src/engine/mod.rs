//! Generation: sampling and the prefill/decode loop.
