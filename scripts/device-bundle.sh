#!/usr/bin/env bash
# Gathers what scripts/device-check.sh needs on a GPU machine that has no package registry, from a
# build made here (`make device-bundle`): the GPU test and benchmark binaries, train-gpt, the real
# models' train-gpt2 and train-smollm2 (built here if missing) with BPE token files, and the shared
# libraries they use that such a machine may lack (Boost.Test, fmt, zlib, and Open MPI's, which
# the trainers link and load without calling MPI unless mpirun started them). Writes .device/ (git
# ignores it; about 13 MiB), which travels with the working tree. `bash scripts/device-check.sh
# --dry-run` then runs every GPU check's plumbing against it here, without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
rm -rf .device && mkdir -p .device/bin .device/lib .device/data
.venv/bin/cmake --build "$build" --target train-gpt2 train-smollm2  # not in `make build` (full size)
cp "$build/tests/test_cuda" "$build/bin/bench-gpu" "$build/bin/train-gpt" "$build/bin/train-gpt2" \
  "$build/bin/train-smollm2" .device/bin/
tokens=$build/data/fortunes-bpe  # make's $(BPE_DATA): ids below 4096, inside both models' vocabularies
[[ -f $tokens/train.bin && -f $tokens/val.bin ]] || { echo "device-bundle: no $tokens/train.bin (make device-bundle makes it)" >&2; exit 2; }
cp "$tokens/train.bin" "$tokens/val.bin" .device/data/
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
