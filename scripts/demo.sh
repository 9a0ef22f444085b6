#!/usr/bin/env bash
# Builds blockkv (Release) and runs the main job: examples/quickstart, which plans a KV cache for
# Llama-3-8B on a 2 GiB host budget, creates it, and reserves, writes and frees blocks for three
# sequences. Extra arguments go to quickstart (e.g. --budget-mib 4096 --block-size 32).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target quickstart
exec build/default/examples/quickstart "$@"
