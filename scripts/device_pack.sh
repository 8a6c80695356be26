#!/usr/bin/env bash
# Packs what a device call carries into .device/, small enough for the 64 MiB a call takes with
# the tree: ../shared/tools/device-pack with the given cargo arguments on a stripped release
# build, then the nextest archive without the static libraries and the release binaries it picks
# up, and the binaries and the runner xz-compressed (scripts/device_check.sh decompresses them on
# the GPU machine). Write arms files and call scripts into .device/ after this (it starts afresh).
#   scripts/device_pack.sh --features cuda-testing --test cuda_batch --test cuda_prefill ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols ../shared/tools/device-pack "$@"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(
  cd "$tmp"
  zstd -dc "$root/.device/tests.tar.zst" | tar x
  find . \( -name '*.a' -o -name '*.rlib' -o -name '*.o' -o -name '*.so' \) -delete  # the tests link std and every crate statically
  rm -f target/release/lily target/release/lily-bench
  # shellcheck disable=SC2046
  tar cf - $(ls -A) | zstd -19 -T0 -q -f -o "$root/.device/tests.tar.zst"
)
for f in .device/bin/* .device/cargo-nextest; do
  [ -f "$f" ] && xz -9 -T0 -f "$f"
done
echo "device_pack: .device is $(du -sb .device | cut -f1) bytes"
