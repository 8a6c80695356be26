# Issue 15's table on one H200 with llama-batched-bench in the same call: session 74's call-2.sh
# (the table at 1 / 4 / 16 / 64 clients, ROUNDS=2, 16 client processes, 700-token text prompts,
# 128 out, greedy and sampled; then llama-batched-bench, prebuilt, Q4_0 GGUF of the same
# checkpoint, at 1 / 4 / 16 / 32 / 64 sequences; then the 64-client level once more and a
# prefill profile while DEADLINE allows) on main at 2e8edf8 (the routing kernel's
# reduce-scatter sums on top of session 73's build). Not run in session 75: eight H200 starts
# failed. .device-base: `cargo build --release --features cuda-testing --bin lily --bin
# lily-bench; . scripts/arm_pack.sh; arm_bins .device-base lily lily-bench`.
# Carry [".device-base", ".whl/openai", ".whl/gguf-py.tar.xz", ".whl/llama-bin.tar.xz"]; run as
# `DEADLINE=560 bash docs/results/2026-12-06-session75/table.sh` (~600 s of device time with the
# start; the core, through llama-batched-bench, ~300 s).
exec bash docs/results/2026-12-06-session74/call-2.sh
