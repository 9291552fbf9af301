#!/usr/bin/env bash
# The house style (.clang-format) on every C++ source of the repository: clang-format-19 reports
# each line it would change and the exit code is non-zero. `bash scripts/check-format.sh --fix`
# reformats in place instead.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t sources < <(git ls-files '*.cpp' '*.h' '*.cppm')
if [ "${1:-}" = --fix ]; then
  clang-format-19 -i "${sources[@]}"
else
  clang-format-19 --dry-run -Werror "${sources[@]}"
fi
