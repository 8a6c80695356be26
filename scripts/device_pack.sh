#!/usr/bin/env bash
# Packs what a device call carries into .device/, small enough for the 64 MiB a call takes with
# the tree: ../shared/tools/device-pack with the given cargo arguments on a stripped release
# build, then the nextest archive without the static libraries and the release binaries it picks
# up, and the binaries and the runner xz-compressed (scripts/device_check.sh decompresses them on
# the GPU machine). Write arms files and call scripts into .device/ after this (it starts afresh).
#   scripts/device_pack.sh --features cuda-testing --test cuda_batch --test cuda_prefill ...
# With --raw-tests first, each test binary goes to .device/tests/NAME(.xz) instead, without the
# nextest archive and cargo-nextest (~8 MB less to carry); on the GPU machine, after
# scripts/device_unpack.sh:  ./.device/tests/NAME --include-ignored --test-threads 2
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
raw=0
if [ "${1:-}" = --raw-tests ]; then
  raw=1
  shift
fi
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
if [ "$raw" = 1 ]; then
  mkdir -p .device/tests
  (
    cd "$tmp"
    rm -rf unpacked && mkdir unpacked && cd unpacked
    zstd -dc "$root/.device/tests.tar.zst" | tar x
    for f in target/release/deps/*; do
      [ -x "$f" ] && [ -f "$f" ] && cp "$f" "$root/.device/tests/$(basename "$f" | sed 's/-[0-9a-f]*$//')"
    done
  )
  rm -f .device/tests.tar.zst .device/cargo-nextest
fi
for f in .device/bin/* .device/tests/* .device/cargo-nextest; do
  [ -f "$f" ] && xz -9 -T0 -f "$f"
done
echo "device_pack: .device is $(du -sb .device | cut -f1) bytes"
