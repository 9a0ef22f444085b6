#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks, without a GPU, that the GPU bundle (scripts/gpu-bundle.sh) carries everything it needs:
# runs its run.sh in a fresh Debian 12 root (debootstrap --variant=minbase, so no compiler, no
# CUDA, none of blockkv's build dependencies), where every binary must start and the run must
# stop at step 2 with "no GPU" (exit 3). Anything else, a missing library above all, fails.
#   scripts/gpu-bundle-check.sh [bundle-dir]    (default build/gpu-bundle/blockkv-gpu)
# The root is kept in build/gpu-bundle/root for the next run (REFRESH=1 makes it anew).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle="${1:-build/gpu-bundle/blockkv-gpu}"
root="build/gpu-bundle/root"
[[ -x "$bundle/run.sh" ]] || { echo "gpu-bundle-check: no bundle at $bundle: run scripts/gpu-bundle.sh" >&2; exit 1; }
[[ "$(id -u)" -eq 0 ]] || { echo "gpu-bundle-check: needs root (debootstrap, chroot)" >&2; exit 1; }

if ! command -v debootstrap >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
if [[ "${REFRESH:-0}" == 1 || ! -f "$root/.complete" ]]; then
  rm -rf "$root"
  # The archive this machine's apt uses (Debian's package archive is the one that is reachable).
  mirror="$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
  [[ -n "$mirror" ]] || mirror="$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list 2>/dev/null)"
  echo "gpu-bundle-check: debootstrap --variant=minbase bookworm from ${mirror:-the default mirror}"
  debootstrap --variant=minbase bookworm "$root" ${mirror:+"$mirror"} >"$root.log" 2>&1 ||
    { tail -20 "$root.log"; echo "gpu-bundle-check: debootstrap failed (log: $root.log)" >&2; exit 1; }
  touch "$root/.complete"
fi
# It must really be bare: none of what the bundle brings is there.
for absent in /usr/local/cuda /usr/bin/c++ /usr/bin/cmake; do
  [[ ! -e "$root$absent" ]] || { echo "gpu-bundle-check: $absent exists in $root: not a bare root" >&2; exit 1; }
done
if ls "$root"/usr/lib/x86_64-linux-gnu/libhwy* "$root"/usr/lib/x86_64-linux-gnu/libbenchmark* >/dev/null 2>&1; then
  echo "gpu-bundle-check: $root has Highway or Google Benchmark: not a bare root" >&2; exit 1
fi

rm -rf "$root/blockkv-gpu"
cp -r "$bundle" "$root/blockkv-gpu"
set +e
output="$(chroot "$root" /blockkv-gpu/run.sh 2>&1)"
rc=$?
set -e
echo "$output"
if ((rc == 3)) && grep -q '^no GPU' <<<"$output"; then
  echo "gpu-bundle-check: passed: in a bare Debian 12 root every binary starts and run.sh stops at \"no GPU\""
  exit 0
fi
echo "gpu-bundle-check: FAILED: run.sh exited $rc (expected 3 with \"no GPU\")" >&2
exit 1
