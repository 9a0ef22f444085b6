#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check in one command, on a machine with an NVIDIA GPU: runs the GPU bundle's run.sh
# (every CUDA test with a time limit, every CUDA benchmark, the Python module's torch CUDA test,
# and a short table last; see scripts/gpu-bundle/run.sh). The bundle is built where blockkv's
# build dependencies are (scripts/gpu-bundle.sh, on a Debian 12 machine with the CUDA toolkit) and
# needs nothing on the GPU machine but a driver, so a GPU machine without a package archive runs
# it as it is:
#   here:            scripts/gpu-bundle.sh          → build/gpu-bundle/blockkv-gpu (~17 MiB)
#   GPU machine:     scripts/gpu-check.sh [bundle]  (or blockkv-gpu/run.sh directly)
# Without a bundle at hand, builds it first (which needs this machine's build dependencies).
# Exit status: run.sh's (0 all passed, 1 a failure, 2 the bundle is broken, 3 no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle="${1:-build/gpu-bundle/blockkv-gpu}"
if [[ ! -x "$bundle/run.sh" ]]; then
  [[ $# -eq 0 ]] || { echo "gpu-check: no bundle at $bundle" >&2; exit 1; }
  scripts/gpu-bundle.sh "$bundle"
fi
exec "$bundle/run.sh"
