#!/usr/bin/env bash
# Builds blockkv (Release) and runs the main job:
#  1. examples/quickstart plans a KV cache for Llama-3-8B on a 2 GiB host budget, creates it, and
#     reserves, writes and frees blocks for three sequences. Extra arguments go to it
#     (e.g. --budget-mib 4096 --block-size 32).
#  2. examples/engine_loop drives 40 requests through the state manager and the ragged batch as a
#     continuous-batching engine would (chunked prefill, decode, fork, sliding window, flush).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target quickstart engine_loop
build/default/examples/quickstart "$@"
echo
build/default/examples/engine_loop
