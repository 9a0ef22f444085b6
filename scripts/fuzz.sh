#!/usr/bin/env bash
# Builds the libFuzzer targets (CMake preset "fuzz": clang, ASan, UBSan, the library and the tool
# instrumented) and runs each for a bounded time from its seed corpus. Fails on the first crash,
# leak, timeout or out-of-memory input, which is kept under build/fuzz/fuzz-runs/<target>/ (keep it
# as a named regression test; see each target's header).
#   scripts/fuzz.sh              every target, 45 s each
#   scripts/fuzz.sh 300 trace_fuzz    one target, 300 s
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-45}
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(block_allocator_fuzz snapshot_fuzz tool_args_fuzz trace_line_fuzz trace_fuzz)
fi

scripts/deps.sh --fuzz
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j"$(nproc)"

for target in "${targets[@]}"; do
  seeds=tests/fuzz/corpus/$target
  max_len=4096
  case $target in
    snapshot_fuzz) seeds=build/fuzz/tests/fuzz/snapshot_corpus; max_len=65536 ;;
    block_allocator_fuzz) seeds= ;;  # any bytes drive it; it needs no seeds
  esac
  work=build/fuzz/fuzz-runs/$target
  rm -rf "$work"
  mkdir -p "$work/corpus"
  echo "=== fuzz.sh: $target for ${seconds} s"
  # -rss_limit_mb: an input that makes a target hold more than 2 GB is a failure, as it is for
  # the tool under `ulimit -v 2000000` (tests/tool/hostile_inputs.sh).
  build/fuzz/tests/fuzz/"$target" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
    -max_len="$max_len" -print_final_stats=1 -artifact_prefix="$work/" \
    "$work/corpus" ${seeds:+"$seeds"} 2>"$work/log" || {
    tail -60 "$work/log"
    echo "fuzz.sh: $target failed; the input is in $work/"
    exit 1
  }
  grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$work/log" | tr '\n' ' '
  echo
done
echo "fuzz.sh: every target ran ${seconds} s without a failure"
