#!/usr/bin/env bash
# Builds pagedattn's fuzz targets and runs each for SECONDS (libFuzzer's -max_total_time),
# printing one summary line per target (executions, rate, peak memory) and exiting non-zero
# if any target failed (a panic, a sanitizer report, a timeout, an out-of-memory).
#
#   fuzz/run.sh SECONDS [TARGET...]      (default: every target, one after another)
#
# FUZZ_PARALLEL=N runs N targets at a time (one libFuzzer process each, with
# RAYON_NUM_THREADS=1 unless set). FUZZ_TIMEOUT (default 10) is libFuzzer's per-input
# wall-clock limit in seconds: long runs beside other work raise it, since a starved process
# can pass 10 s on an input that takes well under one alone. Each target fuzzes
# its working corpus fuzz/corpus/TARGET/ (created here, not committed; the replay reader's is
# seeded from the repository's replay files by seed-corpus.sh) and leaves what makes it fail
# in fuzz/artifacts/TARGET/. Logs: fuzz/target/fuzz-logs/TARGET.log.
#
# FUZZ_PROFILE=dev builds the targets unoptimized (`cargo fuzz build --dev`: the address
# sanitizer and the coverage instrumentation stay; overflow checks and debug assertions come
# on) for CI: the instrumented optimized build of the library takes over 20 minutes of a
# 2-core Xeon (even at opt-level 1 with 16 codegen units, over 10), the unoptimized one under
# 2, for about a fifth of the executions a second. Default: the release profile (opt-level 3),
# what the long campaigns run.
#
# Toolchain: cargo-fuzz needs nightly features (-Zsanitizer=address). In order: `cargo
# +nightly` where a nightly toolchain is installed; else the stable toolchain with
# RUSTC_BOOTSTRAP=1 (which unlocks them; checked to build and run here with 1.95.0); else
# `rustup toolchain install nightly --profile minimal`. cargo-fuzz itself is installed with
# `cargo install cargo-fuzz --locked` where missing.
set -euo pipefail
cd "$(dirname "$0")"

if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 SECONDS [TARGET...]" >&2
  exit 2
fi
seconds=$1
shift
all_targets=(replay_reader metadata_builder constructors differential gguf_reader)
targets=("${@:-${all_targets[@]}}")
parallel=${FUZZ_PARALLEL:-1}
# Several fuzzers at once: one rayon worker each (the `cpu` backend's idle workers would
# otherwise spin on the cores the other fuzzers need).
if [ "$parallel" -gt 1 ]; then
  export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
fi

# Whether stable rustc builds with the address sanitizer once RUSTC_BOOTSTRAP=1 unlocks -Z.
stable_can_fuzz() {
  local dir
  dir=$(mktemp -d)
  echo 'fn main() {}' >"$dir/probe.rs"
  RUSTC_BOOTSTRAP=1 rustc +stable -Zsanitizer=address "$dir/probe.rs" -o "$dir/probe" \
    >/dev/null 2>&1 && "$dir/probe"
  local ok=$?
  rm -rf "$dir"
  return $ok
}

# The toolchain (cargo's +toolchain argument), with RUSTC_BOOTSTRAP where stable stands in.
if cargo +nightly --version >/dev/null 2>&1; then
  toolchain=(+nightly)
elif stable_can_fuzz; then
  echo "fuzz: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1"
  toolchain=(+stable)
  export RUSTC_BOOTSTRAP=1
elif rustup toolchain install nightly --profile minimal >/dev/null; then
  toolchain=(+nightly)
else
  echo "fuzz: no toolchain builds the fuzz targets (nightly, or stable with RUSTC_BOOTSTRAP=1)" >&2
  exit 1
fi
if ! cargo "${toolchain[@]}" fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

case ${FUZZ_PROFILE:=release} in
  release) build_flags=() profile_dir=release ;;
  dev) build_flags=(--dev) profile_dir=debug ;;
  *)
    echo "FUZZ_PROFILE must be release or dev, not '$FUZZ_PROFILE'" >&2
    exit 2
    ;;
esac
echo "== fuzz: building ${targets[*]} ($FUZZ_PROFILE profile; $(cargo "${toolchain[@]}" --version))"
for t in "${targets[@]}"; do
  # gguf_reader needs the engine, which the others do not build (its `required-features`).
  features=()
  if [ "$t" = gguf_reader ]; then
    features=(--features engine)
  fi
  cargo "${toolchain[@]}" fuzz build "${build_flags[@]}" "${features[@]}" "$t"
done
./seed-corpus.sh >/dev/null

host=$(rustc "${toolchain[@]}" -vV | sed -n 's/^host: //p')
bin=target/$host/$profile_dir
logs=target/fuzz-logs
mkdir -p "$logs"

# Runs one target for $seconds; its log holds libFuzzer's final statistics.
run_one() {
  local t=$1
  mkdir -p "corpus/$t" "artifacts/$t"
  "$bin/$t" "corpus/$t" \
    -artifact_prefix="artifacts/$t/" \
    -max_total_time="$seconds" \
    -rss_limit_mb=2048 \
    -timeout="${FUZZ_TIMEOUT:-10}" \
    -print_final_stats=1 \
    >"$logs/$t.log" 2>&1
}

# One line per target from its log and exit status.
summary() {
  local t=$1 status=$2 log=$logs/$1.log
  local execs rate rss
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -1)
  if [ "$status" = 0 ]; then
    printf 'fuzz %-16s ok      %10s execs in %ss (%s/s, peak %s MB)\n' \
      "$t" "${execs:-?}" "$seconds" "${rate:-?}" "${rss:-?}"
  else
    printf 'fuzz %-16s FAILED  %10s execs (exit %s); log %s\n' "$t" "${execs:-?}" "$status" "$log"
    grep -E -A1 'panicked at' "$log" | head -4 | sed 's/^/    /'
    grep -E 'ERROR: (libFuzzer|AddressSanitizer)|SUMMARY|Test unit written' "$log" | head -6 | sed 's/^/    /'
    # The failing input itself (when small), so that a log is enough to replay it elsewhere:
    # `base64 -d > crash` then `cargo fuzz run TARGET crash`.
    local artifact
    artifact=$(sed -n "s/.*Test unit written to \(artifacts\/[^ ]*\).*/\1/p" "$log" | tail -1)
    if [ -n "$artifact" ] && [ -f "$artifact" ] && [ "$(stat -c %s "$artifact")" -le 16384 ]; then
      echo "    the input, base64 ($(stat -c %s "$artifact") bytes; CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)):"
      base64 -w 100 "$artifact" | sed 's/^/    /'
    fi
  fi
}

failed=0
statuses=()
for ((i = 0; i < ${#targets[@]}; i += parallel)); do
  batch=("${targets[@]:i:parallel}")
  pids=()
  for t in "${batch[@]}"; do
    run_one "$t" &
    pids+=($!)
  done
  for j in "${!batch[@]}"; do
    status=0
    wait "${pids[$j]}" || status=$?
    statuses+=("${batch[$j]}:$status")
  done
done
echo "== fuzz: ${seconds}s per target"
for entry in "${statuses[@]}"; do
  t=${entry%%:*}
  status=${entry##*:}
  summary "$t" "$status"
  [ "$status" = 0 ] || failed=1
done
exit $failed
