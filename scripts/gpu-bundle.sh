#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds, on this machine (CUDA toolkit, Debian's packages), everything a GPU machine needs to test
# and benchmark blockkv's CUDA code, into one folder that needs nothing there but an NVIDIA
# driver (and, for the Python step, a C++20 compiler and the machine's own python3 + torch):
#
#   bin/          the CUDA tests (tests/cuda), the CUDA benchmarks (bench/cuda_*), gpu_probe
#   bin/lib/      every shared library ldd names that is not the C library or the driver
#                 (libstdc++, Highway, Google Benchmark, the CUDA runtime, ...), found through
#                 the binaries' RUNPATH $ORIGIN/lib
#   python/       the Python module's sources, blockkv's public headers, a static libblockkv.a,
#                 pybind11's and DLPack's headers, and build.sh that compiles the module for the
#                 GPU machine's python3 (this machine's Python is 3.11; the module is ABI-bound)
#   run.sh        the one command to run there (see scripts/gpu-bundle/run.sh)
#
#   scripts/gpu-bundle.sh [out-dir]     (default build/gpu-bundle/blockkv-gpu)
#   GPU_ARCHS="90" JOBS=2 scripts/gpu-bundle.sh
#
# Then copy the folder to the GPU machine and run `blockkv-gpu/run.sh`; it prints a short table
# last. scripts/gpu-bundle-check.sh runs the bundle in a fresh Debian root without any build
# dependency, where it must get as far as "no GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${1:-build/gpu-bundle/blockkv-gpu}"
build="build/gpu-bundle/build"
archs="${GPU_ARCHS:-90}"  # H200 / H100: sm_90; add 80 for A100
jobs="${JOBS:-$(nproc)}"
max_mib=64
mkdir -p "$build"

die() { echo "gpu-bundle: error: $*" >&2; exit 1; }

scripts/deps.sh
[[ -x /usr/local/cuda/bin/nvcc ]] || command -v nvcc >/dev/null ||
  die "nvcc not found: the bundle is built where the CUDA toolkit is (/usr/local/cuda)"

# RUNPATH $ORIGIN/lib in the build tree already, so what is built is what is bundled. Tests are
# listed when ctest runs (PRE_TEST), not after linking: a binary whose libraries are not beside
# it yet cannot be run at build time.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBLOCKKV_WERROR=ON \
  -DBLOCKKV_CUDA=ON -DBLOCKKV_NCCL=OFF -DBLOCKKV_MPI=OFF -DBLOCKKV_PYTHON=OFF \
  -DBLOCKKV_BUILD_TOOLS=OFF -DBLOCKKV_BUILD_EXAMPLES=OFF -DBLOCKKV_BUILD_TESTS=ON \
  -DBLOCKKV_BUILD_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN/lib' \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >"$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; die "configure failed (log: $build.configure.log)"; }

tests=(cuda_device_test cuda_kv_cache_test cuda_offload_test cuda_kernels_test cuda_ragged_batch_test)
benches=(cuda_device_bench cuda_kernels_bench cuda_offload_bench cuda_batch_bench)
cmake --build "$build" -j "$jobs" --target blockkv gpu_probe "${tests[@]}" "${benches[@]}"

rm -rf "$out"
mkdir -p "$out/bin/lib" "$out/python"
for t in gpu_probe "${tests[@]}"; do cp "$build/tests/cuda/$t" "$out/bin/"; done
for b in "${benches[@]}"; do cp "$build/bench/$b" "$out/bin/"; done

# Shared libraries: whatever the loader resolves here, except what every Linux machine has (the C
# library and its loader) and what must come from the GPU machine (the driver, libcuda).
copy_libs() {
  local lines
  lines="$(LD_LIBRARY_PATH=/usr/local/cuda/lib64 ldd "$1")"
  if grep -q 'not found' <<<"$lines"; then die "$1: $(grep 'not found' <<<"$lines")"; fi
  awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' <<<"$lines" | while read -r name path; do
    case "$name" in
      libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | librt.so.* | ld-linux* | libcuda.so.*) ;;
      *) [[ -f "$out/bin/lib/$name" ]] || cp -L "$path" "$out/bin/lib/$name" ;;
    esac
  done
}
for f in "$out"/bin/*; do [[ -f "$f" ]] && copy_libs "$f"; done

# The Python module, as sources to compile on the GPU machine against its own python3.
cp -r python/src "$out/python/src"
# Under pkg/, not beside test_torch_cuda.py: python puts a script's own folder first on sys.path,
# and a blockkv/ there (without the compiled module) would shadow the one build-python.sh makes.
mkdir -p "$out/python/pkg"
cp -r python/blockkv "$out/python/pkg/blockkv"
find "$out/python/pkg/blockkv" -name '__pycache__' -prune -exec rm -rf {} +
cp -r include "$out/python/include"
cp "$build/src/libblockkv.a" "$out/python/"
# The module's own shared libraries (not bin/lib's libstdc++: python and torch bring their own).
mkdir -p "$out/python/lib"
for lib in libhwy.so.1 libcudart.so.13; do cp -L "$out/bin/lib/$lib" "$out/python/lib/"; done
mkdir -p "$out/python/third_party"
cp -r /usr/include/pybind11 "$out/python/third_party/pybind11"
cp -r /usr/include/dlpack "$out/python/third_party/dlpack"
cp scripts/gpu-bundle/build-python.sh scripts/gpu-bundle/test_torch_cuda.py "$out/python/"
cp scripts/gpu-bundle/run.sh "$out/run.sh"
chmod +x "$out/run.sh" "$out/python/build-python.sh"
git -C "$root" rev-parse --short HEAD >"$out/COMMIT" 2>/dev/null || echo unknown >"$out/COMMIT"
git -C "$root" diff --quiet HEAD 2>/dev/null || echo "$(cat "$out/COMMIT")+dirty" >"$out/COMMIT"

mib=$(( $(du -sk "$out" | cut -f1) / 1024 ))
((mib < max_mib)) || die "the bundle is $mib MiB, over the $max_mib MiB limit: $(du -sh "$out"/bin/lib/* | sort -h | tail -3 | tr '\n' ' ')"
echo "gpu-bundle: $out ($mib MiB, commit $(cat "$out/COMMIT")): copy it to the GPU machine and run $(basename "$out")/run.sh"
