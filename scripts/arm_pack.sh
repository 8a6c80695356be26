# Helpers for a prepared device call that carries several builds ("arms") side by side, each in
# a folder of its own (.device-NAME/bin, .device-NAME/tests), stripped and xz-compressed as
# scripts/device_unpack.sh expects (scripts/device_pack.sh packs a single build into .device/).
# Source it from the repository root after a `cargo build --release --features cuda-testing`:
#   . scripts/arm_pack.sh; arm_bins .device-x lily lily-bench; arm_test .device-x cuda_prefill
# or, from the committed tree and patches, arm_build (below).

# arm_bins DIR BIN...: the release binaries into DIR/bin.
arm_bins() {
  local dir=$1 b; shift
  mkdir -p "$dir/bin"
  for b in "$@"; do strip -o "$dir/bin/$b" "target/release/$b"; xz -9 -T2 -f "$dir/bin/$b"; done
}

# arm_test DIR SUITE: the suite's test binary (tests/SUITE.rs, GPU tests included) into DIR/tests.
arm_test() {
  local dir=$1 t=$2 f
  mkdir -p "$dir/tests"
  f=$(cargo test --release --features cuda-testing --test "$t" --no-run --message-format=json 2>/dev/null \
    | python3 -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == sys.argv[1]: print(m['executable'])" "$t")
  [ -n "$f" ] || { echo "arm_test: no test binary for $t" >&2; return 1; }
  strip -o "$dir/tests/$t" "$f"; xz -9 -T2 -f "$dir/tests/$t"
}

# arm_build NAME SUITE|- PATCH...: one arm from the committed tree: the patches applied in order
# (plain `git apply`; `--3way` would stage them, and the reset below would then keep them), its
# lily-bench (and SUITE's test binary, unless -) packed into .device-NAME, then the tracked files
# reset to HEAD. It refuses to start over uncommitted edits to tracked files, and anything edited
# while it builds is lost to the reset: commit first, build, then edit.
arm_build() {
  local n=$1 suite=$2 p
  shift 2
  [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "arm_build: commit the tracked edits first" >&2; return 1; }
  rm -rf ".device-$n"
  for p in "$@"; do
    git apply "$p" || { git reset -q --hard HEAD; return 1; }
  done
  cargo build --release --features cuda-testing --bin lily-bench 2>&1 | tail -1
  arm_bins ".device-$n" lily-bench
  [ "$suite" = - ] || arm_test ".device-$n" "$suite"
  git reset -q --hard HEAD
  echo "arm_build: .device-$n"
}
