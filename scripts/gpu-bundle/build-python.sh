#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Compiles blockkv's Python module for this machine's python3 (the GPU bundle's step 5), from the
# sources scripts/gpu-bundle.sh put beside this script and its prebuilt libblockkv.a (CUDA
# included):   build-python.sh OUT_DIR    then   PYTHONPATH=OUT_DIR python3 -c 'import blockkv'
# pybind11: torch's own copy when torch ships one (recent; Python 3.12 needs pybind11 >= 2.11),
# else the bundled Debian 12 headers (2.10). Needs a C++20 compiler (CXX, or c++ / g++ / clang++).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build-python.sh OUT_DIR}"
py="${PYTHON:-python3}"
cxx="${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}"
[[ -n "$cxx" ]] || { echo "build-python.sh: no C++ compiler (set CXX)" >&2; exit 1; }
pyinc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
ext="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
pybind="$("$py" - <<'PY' 2>/dev/null || true
import os, torch
inc = os.path.join(os.path.dirname(torch.__file__), "include")
print(inc if os.path.exists(os.path.join(inc, "pybind11", "pybind11.h")) else "")
PY
)"
[[ -n "$pybind" ]] || pybind="$here/third_party"
echo "build-python.sh: $cxx for $("$py" --version 2>&1), pybind11 from $pybind"

mkdir -p "$out/blockkv" "$out/obj"
cp -r "$here/pkg/blockkv/." "$out/blockkv/"
flags=(-std=c++20 -O1 -fPIC -fvisibility=hidden -DBLOCKKV_HAVE_CUDA=1 -DBLOCKKV_PYTHON_HAVE_CUDA=1
       -I"$here/include" -I"$here/src" -isystem "$pybind" -isystem "$here/third_party"
       -isystem "$pyinc")
export cxx out
printf '%s\n' "$here"/src/*.cc | xargs -P "$(nproc)" -I{} sh -c \
  '"$cxx" "$@" -c "{}" -o "$out/obj/$(basename "{}" .cc).o"' _ "${flags[@]}"
lib="$here/lib"
"$cxx" -shared -o "$out/blockkv/_blockkv$ext" "$out"/obj/*.o "$here/libblockkv.a" \
  "$lib"/libhwy.so.* "$lib"/libcudart.so.* -lpthread -Wl,-rpath,"$lib"
echo "build-python.sh: $out/blockkv/_blockkv$ext"
