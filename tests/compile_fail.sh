#!/usr/bin/env bash
# A model mistake must be a compile error with a one-line message, and a short one: build the
# target, which must fail; the compiler's diagnostic (from its first line naming a file to
# "N error(s) generated", with the source folder's path taken out so that the figure is the same
# in every checkout) must match PATTERN and be at most MAX_BYTES long. Prints the diagnostic.
#   tests/compile_fail.sh <cmake> <build dir> <source dir> <target> <pattern> <max bytes>
set -uo pipefail
cmake=$1 build=$2 source=$3 target=$4 pattern=$5 max_bytes=$6
if output=$("$cmake" --build "$build" --target "$target" 2>&1); then
  echo "$target compiled, but it must not"
  exit 1
fi
diagnostic=$(printf '%s\n' "$output" | sed -n '/^In module\|^[^ ]*:[0-9]*:[0-9]*: \(error\|note\|warning\)/,/errors\? generated/p' |
  sed "s|$source/||g")
printf '%s\n' "$diagnostic"
bytes=$(printf '%s' "$diagnostic" | wc -c)
echo "($bytes bytes of diagnostic; at most $max_bytes)"
if ! printf '%s\n' "$diagnostic" | grep -Eq -- "$pattern"; then
  echo "the diagnostic does not say: $pattern"
  printf '%s\n' "$output" | tail -20
  exit 1
fi
if [ "$bytes" -gt "$max_bytes" ] || [ "$bytes" -eq 0 ]; then
  echo "the diagnostic is $bytes bytes: longer than $max_bytes (or empty)"
  exit 1
fi
