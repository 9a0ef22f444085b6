#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The `blockkv` tool on hostile inputs under `ulimit -v 2000000` (2 GB of address space): each run
# must exit 0, 1 or 2 with a message on stderr, never die of a signal (a bad_alloc abort is 134,
# the kernel's OOM kill 137) nor run past a minute. Issue 17's list: huge --requests and sizes,
# huge lines and prompt lengths, a NaN model, directories, empty strings.
#   tests/tool/hostile_inputs.sh path/to/blockkv [scratch dir]
set -uo pipefail
tool=${1:?usage: hostile_inputs.sh path/to/blockkv [scratch dir]}
dir=${2:-$(mktemp -d)}
mkdir -p "$dir"
failures=0

run() {  # run ARGS...: one hostile invocation
  local out="$dir/out" code
  (ulimit -v 2000000; exec timeout 60 "$tool" "$@") >"$out" 2>&1
  code=$?
  if [[ $code -gt 2 ]]; then
    echo "FAIL (exit $code): blockkv $*"; head -c 600 "$out"; echo
    failures=$((failures + 1))
  elif [[ $code -ne 0 && ! -s "$out" ]]; then
    echo "FAIL (exit $code, no message): blockkv $*"
    failures=$((failures + 1))
  elif grep -q -e "std::" -e "what()" -e "terminate called" "$out"; then
    echo "FAIL (exception text reached the user): blockkv $*"; head -c 600 "$out"; echo
    failures=$((failures + 1))
  else
    echo "ok (exit $code): blockkv $*"
  fi
}

# Inputs, made here so that the test needs nothing checked in.
python3 - "$dir" <<'PY'
import struct, sys
d = sys.argv[1]
def w(name, text, mode="w"):
    with open(f"{d}/{name}", mode) as f: f.write(text)
w("huge_prompt_len.jsonl", '{"prompt_len": 16777216, "output_len": 1}\n' * 100)
w("huge_output_len.jsonl", '{"prompt_len": 8, "output_len": 1000000000000000}\n')
w("token_line.jsonl", '{"prompt": [' + ",".join(["7"] * 10_000_000) + '], "output_len": 1}\n')
w("long_line.jsonl", '{"id": "' + "a" * (70 << 20) + '"}\n')
w("members.jsonl", '{"prompt_len": 8, "output_len": 1, "id": {' +
  ",".join(f'"k{i}": 1' for i in range(200_000)) + "}}\n")
w("deep.jsonl", '{"prompt_len": 8, "output_len": 1, "id": ' + "[" * 1_000_000 + "]" * 1_000_000 + "}\n")
w("numbers.jsonl", '{"prompt_len": 64, "prefix_group": 1e19, "prefix_len": 64, "output_len": 1}\n')
w("leading_zero.jsonl", '{"prompt_len": 08, "output_len": 1}\n')
w("utf8.jsonl", b'{"prompt_len": 8, "output_len": 1, "id": "\xff\xfe"}\n', "wb")
w("nul.jsonl", b'{"prompt_len": 8, "output_len": 1}\x00garbage\n', "wb")
w("binary.jsonl", bytes(range(256)) * 64, "wb")
w("empty.jsonl", "")
# llama2.c checkpoints: NaN weights, a header of INT32_MIN, a header promising terabytes.
dim, hidden, layers, heads, kv, vocab, seq = 64, 96, 1, 1, 1, 32, 64
floats = (vocab * dim + layers * (dim + 4 * dim * dim + dim + 3 * hidden * dim) + dim
          + seq * (dim // heads))
w("nan.bin", struct.pack("7i", dim, hidden, layers, heads, kv, vocab, seq) +
  struct.pack(f"{floats}f", *([float("nan")] * floats)), "wb")
w("vocab_min.bin", struct.pack("7i", dim, hidden, layers, heads, kv, -2**31, seq), "wb")
w("huge.bin", struct.pack("7i", 2**30, 2**30, 2**30, 1, 1, 2**30, 2**30), "wb")
PY

run simulate --requests 2147483647
run demo --requests 2147483647
run demo --system-len 2147483647
run demo --output-len 2147483647
run demo --prompt-groups 2147483647
run simulate --blocks 2147483647
run simulate --host-blocks 2147483647
run simulate --token-budget 2147483647
run simulate --max-seqs 2147483647 --token-budget 2147483647
run simulate --max-context 9223372036854775807
run simulate --max-context 2147483647 --block-size 1
run simulate --block-size 2147483647
run simulate --prefix-groups 9223372036854775807
run demo --blocks 2147483647
run demo --block-size 2147483647
run demo --token-budget 2147483647 --max-seqs 2147483647
run plan --model Llama-3-8B --memory 80GiB --block-size 3000000000
run plan --layers 2147483647 --kv-heads 2147483647 --head-size 2147483647 --memory 1TiB
run plan --model Llama-3-8B --memory 99999999TiB --slack 0
run plan --model Llama-3-8B --memory 0
for trace in huge_prompt_len huge_output_len token_line long_line members deep numbers \
             leading_zero utf8 nul binary empty; do
  run simulate --trace "$dir/$trace.jsonl"
done
run demo --model "$dir/nan.bin"
run demo --model "$dir/vocab_min.bin"
run demo --model "$dir/huge.bin"
run demo --model "$dir"
run simulate --trace "$dir"
run simulate --requests 5 --plot "$dir"
run simulate --trace ""
run simulate --requests 5 --plot ""
run demo --model ""
run ""
run plan ""
run simulate --requests 5 --plot /nonexistent-dir/x.svg

if [[ $failures -ne 0 ]]; then
  echo "hostile_inputs.sh: $failures failures"
  exit 1
fi
echo "hostile_inputs.sh: every run exited 0, 1 or 2 with a message"
