#!/usr/bin/env bash
# The test command (README.md): every Rust test (unit, integration, CPU model vs transformers
# goldens, server over real HTTP, load test), then the Python suite that drives `lily serve`
# with the official openai client.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --locked --bins
cargo test --locked --no-fail-fast

python3 -m pip install -q --disable-pip-version-check openai pytest
python3 -m pytest -q -p no:cacheprovider tests/openai_client
