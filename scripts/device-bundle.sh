#!/usr/bin/env bash
# Gathers what scripts/device-check.sh needs on a GPU machine that has no package registry, from a
# build made here (`make build`): the GPU test and benchmark binaries, train-gpt, and the shared
# libraries they use that such a machine may lack (Boost.Test, fmt, zlib, and Open MPI's, which
# the trainers link and load without calling MPI unless mpirun started them). Writes .device/ (git
# ignores it; about 13 MiB), which travels with the working tree. `bash scripts/device-check.sh
# --dry-run` then runs every GPU check's plumbing against it here, without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rm -rf .device && mkdir -p .device/bin .device/lib
cp "$build/tests/test_cuda" "$build/bin/bench-gpu" "$build/bin/train-gpt" .device/bin/
for bin in .device/bin/*; do
  ldd "$bin" | awk '/=> \// {print $3}' | grep -E 'libboost|libfmt|libz\.|libmpi|libopen-(pal|rte)|libhwloc|libevent' |
    xargs -r -I{} cp -L {} .device/lib/
done
# The binaries carry MKL (linked statically): stripped and gzipped they stay well inside what a
# carry may hold; scripts/device-check.sh unpacks them.
for bin in .device/bin/*; do
  strip "$bin" && gzip -9 "$bin"
done
du -sh .device
