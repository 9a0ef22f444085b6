#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds blockkv (Release) and runs the main job:
#  1. `blockkv demo`: a tiny Llama-style model (random weights from a fixed seed) generates for 16
#     requests sharing 4 system prompts through the library's real path — state manager, prefix
#     cache, chunked prefill, AppendKV, PagedAttention, preemption to the host tier — and checks
#     its greedy tokens against the same model over a dense cache; it exits 1 if they differ.
#     Extra arguments go to it (e.g. --requests 32 --blocks 64, --model model.bin; docs/tool.md).
#  2. examples/quickstart (plan, create, write and free a Llama-3-8B cache on a 2 GiB budget) and
#     examples/engine_loop (40 requests through the state manager, bookkeeping only) and
#     examples/own_page_table (the kernels over the engine's own block tables): the API by
#     example, a second each.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target blockkv_cli quickstart engine_loop own_page_table
build/default/tools/blockkv demo "$@"
echo
build/default/examples/quickstart
echo
build/default/examples/engine_loop
echo
build/default/examples/own_page_table
