#!/usr/bin/env bash
# Functions (free and member, lambdas counted in the function that holds them) longer than LIMIT
# lines in dsl/ runtime/ trainer/ generators/, longest first: "lines file:line name". Counted by
# universal-ctags (ctags-universal, Debian package universal-ctags): a function's first to last
# line, braces and comments included. Exit code 1 if any is over the limit.
#   bash scripts/function-lengths.sh [LIMIT]   (default 80)
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-80}
files=$(git ls-files 'dsl/*' 'runtime/*' 'trainer/*' 'generators/*' | grep -E '\.(cpp|cppm|h)$')
long=$(ctags-universal --language-force=C++ --kinds-C++=f --fields=+ne -o - $files |
  awk -F'\t' -v limit="$limit" '{
    start = 0; end = 0
    for (i = 4; i <= NF; i++) { if ($i ~ /^line:/) start = substr($i, 6); if ($i ~ /^end:/) end = substr($i, 5) }
    if (end - start + 1 > limit) print end - start + 1, $2 ":" start, $1
  }' | sort -rn)
if [ -n "$long" ]; then echo "$long"; exit 1; fi
echo "no function in dsl/ runtime/ trainer/ generators/ is longer than $limit lines"
