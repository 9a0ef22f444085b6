#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# blockkv's GPU check, as bundled by scripts/gpu-bundle.sh: needs an NVIDIA driver and nothing
# else (the Python step also needs a C++20 compiler, python3 and torch with CUDA; without them it
# is reported as not run). In order, each with a time limit:
#   1. every binary starts (its libraries are all in bin/lib)        else exit 2: bundle broken
#   2. gpu_probe: CUDA sees a GPU                                     else exit 3: "no GPU"
#   3. each CUDA test binary (GoogleTest)
#   4. each CUDA benchmark (Google Benchmark; CSV in logs/)
#   5. the Python module compiled for this machine's python3, and its torch CUDA test
#   6. a short table, last
# Exit 0 when every test passed and every benchmark ran, 1 otherwise.
#   blockkv-gpu/run.sh                     logs in blockkv-gpu/logs (LOGS=dir to change)
#   TEST_TIMEOUT=120 BENCH_TIMEOUT=120 PY_TIMEOUT=240 blockkv-gpu/run.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
logs="${LOGS:-$here/logs}"
mkdir -p "$logs"
export LD_LIBRARY_PATH="$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
start=$SECONDS
tests=(cuda_device_test cuda_kv_cache_test cuda_offload_test cuda_kernels_test cuda_ragged_batch_test)
benches=(cuda_kernels_bench cuda_offload_bench cuda_batch_bench cuda_device_bench)
step() { echo "=== run.sh: $* ($((SECONDS - start)) s)"; }

step "1. every binary starts"
# The dynamic loader resolves each binary's libraries without running it (a benchmark's setup
# would already need the GPU); then each test lists its cases, which runs its static setup.
ldso=""
for l in /lib64/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1; do [[ -x "$l" ]] && ldso="$l" && break; done
for b in "${tests[@]}" "${benches[@]}" gpu_probe; do
  if [[ -n "$ldso" ]] && ! "$ldso" --list "$bin/$b" >"$logs/$b.ldd" 2>&1 ||
      grep -q 'not found' "$logs/$b.ldd"; then
    echo "run.sh: the bundle is broken: bin/$b cannot be loaded:" >&2
    grep 'not found' "$logs/$b.ldd" >&2 || tail -3 "$logs/$b.ldd" >&2
    exit 2
  fi
  [[ "$b" == *_test ]] || continue
  if ! timeout 30 "$bin/$b" --gtest_list_tests >"$logs/$b.list" 2>&1; then
    echo "run.sh: the bundle is broken: bin/$b does not start:" >&2
    tail -5 "$logs/$b.list" >&2
    exit 2
  fi
done

step "2. GPU"
probe="$(timeout 60 "$bin/gpu_probe" 2>&1)"
rc=$?
echo "$probe"
if ((rc == 3)); then
  echo "run.sh: every binary of the bundle starts, but there is no GPU to run them on; stopping." >&2
  exit 3
elif ((rc != 0)); then
  echo "run.sh: the bundle is broken: gpu_probe exited $rc" >&2
  exit 2
fi

step "3. tests"
passed=0 failed=0 skipped=0 broken=()
for t in "${tests[@]}"; do
  timeout -k 10 "${TEST_TIMEOUT:-120}" "$bin/$t" --gtest_color=no >"$logs/$t.log" 2>&1
  rc=$?
  p="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$logs/$t.log")"
  f="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*, listed below.*/\1/p' "$logs/$t.log")"
  s="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*, listed below.*/\1/p' "$logs/$t.log")"
  passed=$((passed + ${p:-0})) failed=$((failed + ${f:-0})) skipped=$((skipped + ${s:-0}))
  if ((rc != 0)); then
    why="exit $rc"; ((rc == 124)) && why="timed out after ${TEST_TIMEOUT:-120} s"
    [[ -z "$f" ]] && failed=$((failed + 1))  # a crash or a timeout counts as one failure
    broken+=("$t ($why)")
    grep -E '^\[  FAILED  \] [A-Za-z]' "$logs/$t.log" | sort -u
  fi
  echo "$t: ${p:-0} passed, ${f:-0} failed, ${s:-0} skipped (exit $rc)"
done

step "4. benchmarks"
bench_failed=()
for b in "${benches[@]}"; do
  if ! timeout -k 10 "${BENCH_TIMEOUT:-120}" "$bin/$b" --benchmark_min_time=0.2 \
      --benchmark_out="$logs/$b.csv" --benchmark_out_format=csv >"$logs/$b.log" 2>&1; then
    bench_failed+=("$b")
  fi
  grep -q ',true,' "$logs/$b.csv" 2>/dev/null && bench_failed+=("$b (a case reported an error)")
  cat "$logs/$b.log"
done

# field CSV NAME COLUMN: COLUMN of the first row whose name is NAME or starts with NAME/.
field() {
  awk -F, -v want="$2" -v col="$3" '
    $1 == "name" { for (i = 1; i <= NF; i++) { c = $i; gsub(/"/, "", c); h[c] = i }; next }
    !("name" in h) { next }
    { n = $1; gsub(/"/, "", n) }
    (n == want || index(n, want "/") == 1) && (col in h) { print $h[col]; exit }
  ' "$1" 2>/dev/null
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "-"; else printf "%.2f", a / b }'; }
gbs() { awk -v a="$1" 'BEGIN { if (a == "") print "-"; else printf "%.0f GB/s", a / 1e9 }'; }

step "5. Python module and its torch CUDA test"
python_row="not run: no python3 with torch on this machine"
if command -v python3 >/dev/null && python3 -c 'import torch' >/dev/null 2>&1; then
  t0=$SECONDS
  if timeout "${PY_TIMEOUT:-240}" "$here/python/build-python.sh" "$logs/python" >"$logs/python-build.log" 2>&1; then
    built=$((SECONDS - t0))
    if timeout "${PY_TIMEOUT:-240}" env PYTHONPATH="$logs/python" python3 \
        "$here/python/test_torch_cuda.py" >"$logs/python-test.log" 2>&1; then
      python_row="module built in ${built} s; $(tail -1 "$logs/python-test.log")"
    else
      python_row="module built in ${built} s; torch CUDA test FAILED (logs/python-test.log)"
      failed=$((failed + 1)) broken+=("test_torch_cuda.py")
    fi
    cat "$logs/python-test.log"
  else
    python_row="module build FAILED (logs/python-build.log)"
    failed=$((failed + 1)) broken+=("python module build")
    tail -20 "$logs/python-build.log"
  fi
fi

k="$logs/cuda_kernels_bench.csv" o="$logs/cuda_offload_bench.csv" r="$logs/cuda_batch_bench.csv"
echo
echo "=================== blockkv gpu bundle ($(cat "$here/COMMIT" 2>/dev/null)) ==================="
echo "$probe" | sed 's/^/gpu         /'
printf '%-11s %s passed, %s failed, %s skipped%s\n' "tests" "$passed" "$failed" "$skipped" \
  "$( ((${#broken[@]})) && printf ' (%s)' "${broken[*]}")"
for ctx in 1024 4096 16384; do
  copy="$(field "$k" "BM_CudaMemcpyD2D/$ctx" bytes_per_second)"
  for kernel in Paged:warp-per-key HalfWarp:half-warp; do
    paged="$(field "$k" "BM_CudaDecode${kernel%%:*}/$ctx" bytes_per_second)"
    printf '%-11s context %-6s %-14s %s vs D2D copy (read+write) %s: %s (goal >= 0.70)\n' \
      "decode" "$ctx" "${kernel#*:}" "$(gbs "$paged")" "$(gbs "$copy")" "$(ratio "$paged" "$copy")"
  done
done
for c in round_trip d2h; do
  printf '%-11s %-10s %s, %sx a pinned cudaMemcpyAsync (goal >= 0.80)\n' "offload" "$c" \
    "$(gbs "$(field "$o" "offload/$c" bytes_per_second)")" "$(field "$o" "offload/$c" vs_pinned | awk '{ if ($1 == "") print "-"; else printf "%.2f", $1 }')"
done
us() { awk -v a="$1" 'BEGIN { if (a == "") print "-"; else printf "%.1f", a }'; }
for n in 256 1024 4096; do
  cpu="$(field "$r" "step/cpu/$n" real_time)" gpu="$(field "$r" "step/cuda/$n" real_time)"
  mirror=""; [[ -n "$cpu" && -n "$gpu" ]] && mirror="$(awk -v a="$gpu" -v b="$cpu" 'BEGIN { print a - b }')"
  printf '%-11s %4s seqs: step %s us on a GPU cache, %s us on a host cache: mirror %s us; one pinned copy %s us\n' \
    "batch" "$n" "$(us "$gpu")" "$(us "$cpu")" "$(us "$mirror")" "$(us "$(field "$r" "pinned/$n" real_time)")"
done
printf '%-11s %s\n' "python" "$python_row"
((${#bench_failed[@]})) && printf '%-11s FAILED: %s\n' "benchmarks" "${bench_failed[*]}"
printf '%-11s %s s\n' "time" "$((SECONDS - start))"
echo "=========================================================================="
((failed == 0 && ${#bench_failed[@]} == 0))
