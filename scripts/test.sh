#!/usr/bin/env bash
# Builds blockkv and runs every test through ctest: unit tests, the model-based random tests, the
# MPI tests (mpirun -np 2 and 3), the install check, and the CUDA tests (which skip without a GPU).
#   scripts/test.sh          Release build, warnings are errors (preset "default")
#   scripts/test.sh asan     Debug build with AddressSanitizer + UndefinedBehaviorSanitizer
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-default}"
scripts/deps.sh
cmake --preset "$preset"
cmake --build --preset "$preset"
ctest --preset "$preset" --no-tests=error
