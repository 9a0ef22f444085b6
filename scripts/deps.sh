#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs, with apt-get, whatever of blockkv's build and test dependencies is missing on a Debian 12
# machine. Does nothing (and needs no network) when everything is there already.
#   scripts/deps.sh            what building and testing needs
#   scripts/deps.sh --lint     also clang-format and clang-tidy
#   scripts/deps.sh --fuzz     also clang (libFuzzer; scripts/fuzz.sh)
set -euo pipefail

packages=(cmake ninja-build g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev
          libopenmpi-dev openmpi-bin
          pybind11-dev python3-dev python3-numpy python3-pytest python3-torch python3-pydantic
          libdlpack-dev
          libhwy-dev libxxhash-dev nlohmann-json3-dev
          libhiredis-dev redis-server redis-tools libssl-dev openssl
          libzmq3-dev cppzmq-dev python3-zmq python3-msgpack
          libucx-dev ucx-utils)
for arg in "$@"; do
  case $arg in
    --lint) packages+=(clang-format clang-tidy) ;;
    --fuzz) packages+=(clang) ;;
    *) echo "deps.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "deps.sh: installing ${missing[*]}" >&2
sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "deps.sh: run as root or install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
