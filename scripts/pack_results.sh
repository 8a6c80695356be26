#!/usr/bin/env bash
# Compresses a results directory's files over 64 KB with xz before they are committed: every
# device call carries the whole working tree (64 MiB at most), and raw JSON lines, logs and
# profiles compress ~15x. Read them back with `xzcat`.
# Usage: bash scripts/pack_results.sh docs/results/<date>-<what> [...]
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 DIR [DIR ...]" >&2; exit 2; }
for dir in "$@"; do
    [ -d "$dir" ] || { echo "$0: not a directory: $dir" >&2; exit 2; }
    find "$dir" -type f -size +64k ! -name '*.xz' ! -name '*.gz' ! -name '*.md' ! -name '*.patch' \
        ! -name '*.py' ! -name '*.sh' -print0 | xargs -0 -r xz -9 -T2 -v
done
