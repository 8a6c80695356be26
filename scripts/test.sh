#!/usr/bin/env bash
# The test command (README.md): every Rust test (unit, integration, CPU model vs transformers
# goldens), then the Python suite that drives the server with the official openai client.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --locked --bins
cargo nextest run --locked --no-fail-fast
