#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds blockkv and runs every test through ctest: unit tests, the model-based random tests, the
# MPI tests (mpirun -np 2 and 3), the install check, and the CUDA tests (which skip without a GPU).
#   scripts/test.sh          Release build, warnings are errors (preset "default")
#   scripts/test.sh asan     Debug build with AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/test.sh tsan     Debug build with ThreadSanitizer: only the tests that run threads
#                            (ctest labels offload and threads), and only their targets (~1.5 min
#                            on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-default}"
scripts/deps.sh
cmake --preset "$preset"
cmake --build --preset "$preset"
run=()
# GCC 12's ThreadSanitizer cannot map its shadow memory on kernels that randomize mmap with more
# than 28 bits ("unexpected memory mapping"); without address randomization it always can.
if [[ "$preset" == tsan ]] && setarch "$(uname -m)" -R true 2>/dev/null; then
  run=(setarch "$(uname -m)" -R)
fi
"${run[@]}" ctest --preset "$preset" --no-tests=error
