#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT: the last step of a call packs everything
# the call wrote there into one $OUT/out.tar.xz (what the call printed stays in its output).
# Unpack here with `tar -xJf out.tar.xz -C DIR`.
set -u
out=${OUT:-/tmp/out}
cd "$out" || exit 1
mapfile -t files < <(ls -A | grep -vx 'out.tar.xz')
[ "${#files[@]}" -gt 0 ] || exit 0
tar -cJf out.tar.xz "${files[@]}" && rm -rf "${files[@]}"
