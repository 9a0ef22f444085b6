#!/usr/bin/env bash
# The one script to run whenever a machine with an NVIDIA GPU is available: builds blockkv with
# CUDA (Release, tests and benchmarks on, its own build directory), runs every GPU test
# (ctest -L cuda: the offload store's cuda_offload_test among them) and every GPU benchmark
# (bench/cuda*_bench: cuda_offload_bench's rows give the offload GB/s and "x pinned", the store's
# rate over the pinned-memory copy of the same bytes), and prints a short table last.
# Takes about a minute on a 16-core machine; every step has a time limit, so it ends within 5.
#
#   scripts/gpu-check.sh [build-dir]     (default build/gpu-check)
#   JOBS=8 scripts/gpu-check.sh          (build parallelism; default: all cores)
#
# Exit status: 0 when every GPU test passed (a test that needs more GPUs than the machine has
# may skip), 1 otherwise: no GPU, a build failure, a failed test, a GPU test skipped because CUDA
# sees no GPU although nvidia-smi does, or a benchmark that failed. Record the table in
# docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
build="${1:-build/gpu-check}"
jobs="${JOBS:-$(nproc)}"
start=$SECONDS
log="$build/gpu-check.log"

die() {
  echo "gpu-check: error: $*" >&2
  [[ -f "$log" ]] && echo "gpu-check: full log: $log" >&2
  exit 1
}
step() { echo "=== gpu-check: $* ($((SECONDS - start)) s)"; }

# --- the machine -------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 ||
  die "nvidia-smi not found: this machine has no NVIDIA driver, so there is no GPU to check"
if ! gpus="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"; then
  die "nvidia-smi failed, so no GPU is usable: $gpus"
fi
[[ -n "$gpus" ]] || die "nvidia-smi lists no GPU"
gpu_count="$(grep -c . <<<"$gpus")"
nvcc="$(command -v nvcc || true)"
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" ]] || die "nvcc not found (on PATH or /usr/local/cuda/bin): install the CUDA toolkit"
nvcc_version="$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
python=/usr/bin/python3
[[ -x "$python" ]] || python="$(command -v python3 || true)"

mkdir -p "$build"
: >"$log"

# --- build -------------------------------------------------------------------------------------
step "configure ($build)"
timeout 120 cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DBLOCKKV_CUDA=ON -DBLOCKKV_BUILD_TESTS=ON \
  -DBLOCKKV_BUILD_BENCH=ON -DBLOCKKV_BUILD_EXAMPLES=OFF >>"$log" 2>&1 ||
  die "configure failed (last lines below)$(echo; tail -20 "$log")"
# Only what the GPU checks run (the library, tests/cuda, bench/): the CPU tests are CI's job.
# Ninja names each folder's targets "<folder>/all"; other generators build everything.
targets=()
((${#generator[@]} > 0)) && targets=(--target tests/cuda/all bench/all)
step "build (-j$jobs)"
timeout 200 cmake --build "$build" -j "$jobs" "${targets[@]}" >>"$log" 2>&1 ||
  die "build failed (last lines below)$(echo; tail -30 "$log")"

# --- GPU tests ---------------------------------------------------------------------------------
step "GPU tests (ctest -L cuda)"
tests_log="$build/gpu-check-tests.log"
set +e
timeout 150 ctest --test-dir "$build" -L cuda --output-on-failure --timeout 120 \
  --no-tests=error >"$tests_log" 2>&1
ctest_status=$?
set -e
cat "$tests_log" >>"$log"
passed="$(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .* +Passed' "$tests_log" || true)"
failed="$(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*\*\*\*(Failed|Timeout|Exception)' "$tests_log" || true)"
skipped="$(grep -cE '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*\*\*\*Skipped' "$tests_log" || true)"
# Why they skipped: "needs 2 CUDA GPU(s), this machine has 1" is fine on a one-GPU machine; "has
# 0" means CUDA cannot use the GPU that nvidia-smi shows (driver/runtime mismatch).
blind=0
if [[ -f "$build/Testing/Temporary/LastTest.log" ]]; then
  blind="$(grep -c 'this machine has 0' "$build/Testing/Temporary/LastTest.log" || true)"
fi
if ((ctest_status == 124)); then
  failed="$failed (ctest timed out)"
fi
grep -E '\*\*\*(Failed|Timeout|Exception)' "$tests_log" || true

# --- GPU benchmarks ----------------------------------------------------------------------------
step "GPU benchmarks"
bench_rows=()
bench_failed=0
shopt -s nullglob
benches=("$build"/bench/cuda*_bench "$build"/bench/gpu*_bench)
shopt -u nullglob
for bench in "${benches[@]}"; do
  [[ -x "$bench" ]] || continue
  name="$(basename "$bench")"
  json="$build/$name.json"
  if timeout 90 "$bench" --benchmark_min_time=0.2 --benchmark_out="$json" \
    --benchmark_out_format=json >>"$log" 2>&1; then
    if [[ -z "$python" ]]; then
      bench_rows+=("$(printf '%-18s ran; no python3 to summarize %s' "$name" "$json")")
      continue
    fi
    while IFS= read -r row; do
      bench_rows+=("$row")
      [[ "$row" == *" ERROR "* ]] && bench_failed=$((bench_failed + 1))
    done < <(
      "$python" - "$json" "$name" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
for b in data["benchmarks"]:
    if b.get("error_occurred"):
        print(f"{sys.argv[2]:<18} {b['name']:<16} ERROR {b.get('error_message', '')}")
        continue
    line = f"{sys.argv[2]:<18} {b['name']:<16} {b['real_time']:>10.1f} {b['time_unit']}/iter"
    if "bytes_per_second" in b:
        line += f"  {b['bytes_per_second'] / 1e9:>7.2f} GB/s"
    if "vs_pinned" in b:  # cuda_offload_bench: store time against the same pinned copy
        line += f"  {b['vs_pinned']:.2f}x pinned"
    print(line)
PY
    )
  else
    bench_failed=$((bench_failed + 1))
    bench_rows+=("$(printf '%-18s FAILED (see %s)' "$name" "$log")")
  fi
done
((${#benches[@]} > 0)) || bench_rows+=("(no GPU benchmark in $build/bench)")

# --- summary: last, so it is what one reads --------------------------------------------------
echo
echo "=================== blockkv gpu-check ==================="
printf '%-10s %s\n' "commit" "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
while IFS= read -r gpu; do printf '%-10s %s\n' "gpu" "$gpu"; done <<<"$gpus"
printf '%-10s %s\n' "nvcc" "$nvcc_version"
printf '%-10s %s passed, %s failed, %s skipped\n' "tests" "$passed" "$failed" "$skipped"
for row in "${bench_rows[@]}"; do printf '%-10s %s\n' "bench" "$row"; done
printf '%-10s %s s\n' "time" "$((SECONDS - start))"
echo "========================================================="

status=0
if [[ "$failed" != 0 ]] || ((ctest_status != 0)); then
  echo "gpu-check: FAILED: GPU tests failed (details above and in $tests_log)" >&2
  status=1
fi
if ((blind > 0)); then
  echo "gpu-check: FAILED: $blind GPU test(s) skipped because CUDA sees no GPU, although" \
    "nvidia-smi lists $gpu_count (driver too old for CUDA $nvcc_version?)" >&2
  status=1
fi
if ((bench_failed > 0)); then
  echo "gpu-check: FAILED: $bench_failed GPU benchmark(s) failed (see $log)" >&2
  status=1
fi
exit "$status"
