#!/usr/bin/env bash
# make fuzz: runs each libFuzzer target of BUILD (default build-fuzz) for SECONDS (default 60), one
# after the other, starting from fuzz/seeds/<target>/ and the corpus it grew before
# (BUILD/corpus/<target>/). A crash is written to fuzz/regressions/<target>/ (libFuzzer's
# artifact prefix), where ctest's fuzz_replay_<target> runs it from then on; the run goes on with
# the next target and exits 1 if any crashed. A line per target: seconds, inputs tried, finding.
#   bash fuzz/run.sh [BUILD] [SECONDS] [TARGET...]
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-fuzz}
seconds=${2:-60}
shift 2 2>/dev/null
targets=${*:-idx text tokens data_state flags safetensors}
failed=()
for t in $targets; do
  mkdir -p "$build/corpus/$t" "fuzz/regressions/$t"
  log="$build/corpus/$t.log"
  # -close_fd_mask=1: help texts stay out of the log; scratch files go to /dev/shm (faster)
  TMPDIR=${TMPDIR:-/dev/shm} "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -max_len=16384 -timeout=20 -rss_limit_mb=4096 \
    -close_fd_mask=1 -print_final_stats=1 -artifact_prefix="fuzz/regressions/$t/" \
    "$build/corpus/$t" "fuzz/seeds/$t" >"$log" 2>&1
  status=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  time=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  if [ $status -eq 0 ]; then
    echo "fuzz_$t: ${seconds} s, ${runs:-?} inputs (${time:-?}/s), no crash"
  else
    failed+=("$t")
    echo "fuzz_$t: CRASH after ${runs:-?} inputs: $(grep -m1 -E 'ERROR:|fuzz: |==[0-9]+==' "$log")"
    grep -E "^artifact_prefix|Test unit written to" "$log"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "crashed: ${failed[*]} (inputs in fuzz/regressions/; logs in $build/corpus/<target>.log)"
  exit 1
fi
