#!/usr/bin/env bash
# The GPU checks, run on a machine with a CUDA device against a build made elsewhere
# (scripts/device-bundle.sh gathers it into .device/), in the order of what they teach: one
# train-gpt step with every kernel synchronized (a failing kernel named), the GPU tests, short GPT
# training runs on the GPU, then the GPU benchmark (remat, then PyTorch side by side). Results go
# to $OUT (default ./device-results) as files, each written as its stage ends (a call cut short
# keeps the finished stages'); summary.txt has what the terminal shows.
#
#   bash scripts/device-check.sh [--dry-run] [--sync]
#
# One deadline for everything, DEADLINE seconds from the start (default 540, inside a 600 s
# call): each step runs for at most its own cap or the time left, whichever is less, and a step
# that no longer gets its minimum is skipped with a line saying so. Every process runs under
# `timeout -k` (a process stuck in the driver that ignores SIGTERM is killed 10 s later).
# The GPU tests run one case per process (a crash loses only that case), with REMAT_SHOW_ERRORS=1:
# each comparison's worst error against the CPU goes to summary.txt.
# Verdict: every GPU test case passed; per precision, the five train-gpt runs give one gradient
# digest, each a finite first loss and measured peak == planned peak; bench-gpu exits 0 (it fails
# on a measured peak other than the plan's).
# --sync: REMAT_CUDA_SYNC=1, the executor synchronizes after every kernel and names a failing one.
# --dry-run: on a machine without a GPU, every step's plumbing against the same bundle: the GPU
# tests report skips, train-gpt --device cuda fails with its "no usable GPU" line, bench-gpu
# writes its skip record, torch_gpt2.py runs if torch imports; exit 0 when each step behaved as it
# must without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --sync) export REMAT_CUDA_SYNC=1 ;;
    *) echo "usage: $0 [--dry-run] [--sync]" >&2; exit 2 ;;
  esac
done
SECONDS=0
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-device-results}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0
fail() { say "FAILED: $*"; status=1; }
# rc of the step run in $t s (124: timed out; 137: killed 10 s after the timeout)
exited() { echo "exit $rc$( ((rc == 124 || rc == 137)) && echo ", timed out after ${1:-$t} s")"; }
# allow CAP MIN WHAT: sets $t, the seconds the step may run; false (and a line) when fewer than
# MIN seconds are left before the deadline (less the 10 s that `timeout -k 10` may add)
allow() {
  local left=$((DEADLINE - SECONDS - 10))
  if ((left < $2)); then
    say "SKIPPED: $3 (${left} s left before DEADLINE=${DEADLINE} s; it needs ${2} s)"
    status=1
    return 1
  fi
  t=$((left < $1 ? left : $1))
}

# The bundle: every binary there, and every library they need found.
for packed in .device/bin/*.gz; do  # scripts/device-bundle.sh gzips the binaries
  [ -e "$packed" ] && gunzip -kf "$packed"
done
bins=(.device/bin/test_cuda .device/bin/train-gpt .device/bin/bench-gpu .device/bin/train-gpt2 .device/bin/train-smollm2)
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for bin in "${bins[@]}"; do
  if [[ ! -x $bin ]]; then
    say "device-check: $bin is missing: the bundle .device/ is incomplete (make build && bash scripts/device-bundle.sh, then carry .device)"
    exit 2
  fi
  if missing=$(ldd "$bin" 2>&1 | grep 'not found'); then
    say "device-check: $bin needs libraries that neither .device/lib nor this machine has: $(echo $missing)"
    exit 2
  fi
done
# .device/lib comes first on the library path: it must not hold a CUDA library that would shadow
# the device's own driver, runtime, cuBLAS or NCCL (the dry run checks it too).
if shadowing=$(ls .device/lib | grep -E '^lib(cuda|cudart|cublas|cublasLt|nccl|nvrtc|nvJitLink)\.'); then
  say "device-check: .device/lib holds CUDA libraries that would shadow the device's: $(echo $shadowing)"
  exit 2
fi

# cuBLASLt (the GEMMs of the CUDA kernels) and NCCL (the data-parallel path) are dlopen'ed at run
# time: pip's nvidia wheels (next to PyTorch), the library path, the CUDA toolkit, or a bounded
# search. REMAT_CUBLASLT / REMAT_NCCL are exported only when a file was found (an empty name would
# make dlopen return the main program).
find_nvidia_library() {  # SONAME
  timeout -k 5 30 python3 - "$1" 2>/dev/null <<'PY' && return
import glob, os, site, sys
roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
for f in (f for r in roots for f in glob.glob(os.path.join(r, "nvidia", "*", "lib", sys.argv[1]))):
    print(f)
    sys.exit(0)
sys.exit(1)
PY
  local f d
  local -a dirs
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do
    [[ -n $d && -f $d/$1 ]] && { echo "$d/$1"; return; }
  done
  f=$(timeout -k 5 10 ldconfig -p 2>/dev/null | awk -v name="$1" '$1 == name {print $NF; exit}')
  [[ -n $f && -f $f ]] && { echo "$f"; return; }
  [[ -f /usr/local/cuda/lib64/$1 ]] && { echo "/usr/local/cuda/lib64/$1"; return; }
  timeout -k 5 20 find / \( -path /proc -o -path /sys \) -prune -o -name "$1" -print -quit 2>/dev/null
}
cublaslt=${REMAT_CUBLASLT:-}
[[ -n $cublaslt && -f $cublaslt ]] || cublaslt=$(find_nvidia_library libcublasLt.so.13)
if [[ -n $cublaslt && -f $cublaslt ]]; then
  export REMAT_CUBLASLT=$cublaslt
else
  unset REMAT_CUBLASLT
  if ((!dry)); then  # every CUDA kernel with a linear layer would fail: stop before spending the time
    others=$(timeout -k 5 20 find / \( -path /proc -o -path /sys \) -prune -o -name 'libcublasLt.so*' -print 2>/dev/null | head -n 5)
    say "device-check: no libcublasLt.so.13 (cuBLASLt, CUDA 13) in pip's nvidia wheels, LD_LIBRARY_PATH, ldconfig, /usr/local/cuda/lib64 or / (found instead: $(echo ${others:-nothing})); the CUDA kernels' GEMMs need it: set REMAT_CUBLASLT=<file> and rerun"
    exit 2
  fi
fi
nccl=${REMAT_NCCL:-}
[[ -n $nccl && -f $nccl ]] || nccl=$(find_nvidia_library libnccl.so.2)
if [[ -n $nccl && -f $nccl ]]; then
  export REMAT_NCCL=$nccl
else  # the NCCL rows of train-gpt fail with the loader's line; everything else runs
  unset REMAT_NCCL
fi
# Halide's PTX (sm_86) is JIT-compiled by the driver for this GPU; a large cache in a writable
# place keeps every kernel's result for the runs after the first (train-gpt's kernels are
# test_cuda's).
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/remat-cuda-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-2147483648}

gpu="no nvidia-smi"
command -v nvidia-smi >/dev/null &&
  gpu=$(timeout -k 5 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
say "== GPU: $gpu; cuBLASLt: ${REMAT_CUBLASLT:-none found (the library path then)}; NCCL: ${REMAT_NCCL:-none found (the wheel of the build or the library path then)}; $( ((dry)) && echo 'dry run (no GPU expected)' || echo 'GPU run'); sync after every kernel: ${REMAT_CUDA_SYNC:-no}; deadline ${DEADLINE} s"

say "== First step: one train-gpt step on the GPU, every kernel synchronized (REMAT_CUDA_SYNC=1 names a failing one)"
mkdir -p /tmp/remat-corpus
timeout -k 5 30 python3 -c "import random; random.seed(1); print(''.join(random.choice('abcdefgh \n') for _ in range(200000)))" >/tmp/remat-corpus/text
if allow 60 20 "the first step"; then
  REMAT_CUDA_SYNC=1 timeout -k 10 "$t" .device/bin/train-gpt --device cuda --data-dir /tmp/remat-corpus --max-steps 1 \
    --eval-samples 0 --json >"$OUT/first-step.json" 2>"$OUT/first-step.log"
  rc=$?
  if ((dry)); then
    grep -q 'train-gpt: error: --device cuda: no usable GPU' "$OUT/first-step.log" && ((rc != 0)) ||
      fail "the first step without a GPU: no 'no usable GPU' error (exit $rc)"
    say "first step: no GPU (as expected in a dry run)"
  elif ((rc == 0)); then
    say "first step: passed: $(tail -n 1 "$OUT/first-step.json" | head -c 400)"
  else
    fail "the first step ($(exited)): $(tail -n 3 "$OUT/first-step.log")"
  fi
fi

say "== GPU tests (one process per case; REMAT_SHOW_ERRORS=1)"
# The cases labelled gpu, from the test binary itself (its DOT listing has each case's labels).
gpu_cases=$(timeout -k 5 30 .device/bin/test_cuda --list_content=DOT 2>&1 | grep -o 'label="[^"]*|labels: [^"]*"' |
  sed 's/^label="//; s/"$//' | awk -F'|' '{n = split(substr($3, 9), l, " "); for (i = 1; i <= n; i++) if (l[i] == "@gpu") print $1}')
mkdir -p "$OUT/gpu-tests"
: >"$OUT/gpu-tests.log"
if [[ -z $gpu_cases ]]; then
  fail "no test case labelled gpu in .device/bin/test_cuda --list_content=DOT"
elif allow 240 60 "the GPU tests"; then  # the first case JIT-compiles the kernels' PTX (cached for the rest)
  tests_end=$((SECONDS + t)) first=1
  for tc in $gpu_cases; do
    left=$((tests_end - SECONDS))
    if ((left < 20)); then
      say "SKIPPED: GPU test $tc (${left} s left of the GPU tests' ${t} s)"
      status=1
      continue
    fi
    cap=$((first ? 150 : 100))  # the first case also JIT-compiles the PTX
    first=0
    ct=$((left - 10 < cap ? left - 10 : cap))  # and up to 10 s for timeout -k 10
    log=$OUT/gpu-tests/$tc.log
    start=$SECONDS
    REMAT_SHOW_ERRORS=1 timeout -k 10 "$ct" .device/bin/test_cuda --run_test="$tc" --log_level=test_suite \
      --report_level=short --color_output=no >"$log" 2>&1
    rc=$?
    { echo "---- $tc (exit $rc)"; cat "$log"; } >>"$OUT/gpu-tests.log"
    # tests/main.cpp: exit 0 when the case ran and passed, 77 when it was skipped
    if ((dry)); then
      if ((rc == 77)) && grep -q '\[SKIP\] no CUDA device' "$log"; then
        say "$tc: skipped (exit 77: no CUDA device)"
      else
        fail "GPU test $tc did not skip cleanly without a GPU (exit $rc): $(tail -n 1 "$log")"
      fi
    elif ((rc == 0)); then
      say "$tc: passed ($((SECONDS - start)) s)"
    else
      case $rc in  # Boost.Test: 201 failed checks, 200 an uncaught exception or a caught signal
        77) why=": skipped" ;; 200) why=": an exception or a signal" ;; 201) why=": checks failed" ;;
        124 | 137) why="" ;; *) why=$( ((rc > 128 && rc < 192)) && echo ": killed by signal $((rc - 128))") ;;
      esac
      fail "GPU test $tc ($(exited "$ct")$why)"
      details=$(grep -E 'error: in|fatal error|\[SKIP\]|what\(\)|terminate called' "$log" | head -n 15)
      details=${details:-$(tail -n 5 "$log")}
      [[ -z $details ]] || say "$details"
    fi
  done
  # each comparison's worst error (REMAT_SHOW_ERRORS=1), the figures the tolerances are set from:
  # every line into summary.txt, the largest fraction of its limit per case on the terminal too
  for tc in $gpu_cases; do
    [[ -f $OUT/gpu-tests/$tc.log ]] || continue
    grep -h 'worst matching error' "$OUT/gpu-tests/$tc.log" | sed "s/^/$tc: /" >>"$summary"
    grep -h 'worst matching error' "$OUT/gpu-tests/$tc.log" | awk -v tc="$tc" '
      match($0, /\(([0-9.e+-]+) of the limit\)/) { n++; f = substr($0, RSTART + 1, RLENGTH - 15) + 0
        if (f >= worst) { worst = f; what = $0; sub(/:.*/, "", what) } }
      END { if (n) printf "%s: %d comparisons (their worst matching errors in summary.txt); closest to its limit: %s, %g of it\n", tc, n, what, worst }' |
      tee -a "$summary"
  done
fi

say "== train-gpt on the GPU (fortunes are not here: a synthetic corpus), the policies' gradient digests"
: >"$OUT/train-gpt.jsonl"
: >"$OUT/train-gpt.log"
# "nccl:" rows: the data-parallel path over one rank (REMAT_DATA_PARALLEL=1, no mpirun: this machine
# has one GPU, and NCCL cannot put two ranks on it): buckets summed by NCCL on the collectives
# stream during backward, ZeRO-1's reduce and broadcast with --shard-optimizer.
for precision in fp32 bf16; do
  nccl_rows=("nccl:full" "nccl:full --shard-optimizer")
  [[ $precision == bf16 ]] && nccl_rows=("nccl:selective")
  for policy in none selective full every_n_layers=2 "full --offload" "${nccl_rows[@]}"; do
    allow 40 15 "train-gpt $precision $policy" || continue
    echo "-- $precision $policy" >>"$OUT/train-gpt.log"
    data_parallel=0
    [[ $policy == nccl:* ]] && data_parallel=1 policy=${policy#nccl:}
    # $policy is two words for offload and sharding
    # shellcheck disable=SC2086
    REMAT_DATA_PARALLEL=$data_parallel timeout -k 10 "$t" .device/bin/train-gpt --device cuda \
      --data-dir /tmp/remat-corpus --max-steps 3 --eval-samples 0 --dropout 0.1 --json \
      $([[ $precision == bf16 ]] && echo --bf16) --checkpoint-policy $policy \
      2>>"$OUT/train-gpt.log" | tail -n 1 >>"$OUT/train-gpt.jsonl"
    rc=$?
    if ((dry)); then
      tail -n 1 "$OUT/train-gpt.log" | grep -q 'train-gpt: error: --device cuda: no usable GPU' && ((rc != 0)) ||
        fail "train-gpt $precision $policy without a GPU: no 'no usable GPU' error (exit $rc)"
    else
      ((rc == 0)) || fail "train-gpt $precision $policy ($(exited)): $(tail -n 1 "$OUT/train-gpt.log")"
    fi
  done
done
# The verdict per row: a finite first loss above 0 (NaN is JSON null) and measured == planned peak (on
# CUDA: the device arena's high-water mark plus Halide's heap); per precision: the 5 policies and
# the NCCL rows (which name NCCL as their collectives) ran and agree on the gradient digest. The host heap during steps is shown, not required to be 0 on
# CUDA (the first step loads the kernels' modules and cuBLASLt).
timeout -k 5 60 python3 - "$OUT/train-gpt.jsonl" "$dry" <<'PY' | tee -a "$summary"
import json, math, sys
rows, ok = [], True
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        if line.strip():
            print("not a JSON result:", line.strip()[:200])
            ok = False
def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
for r in rows:
    g = r.get
    rate = g("tokens_per_s")
    nccl = f" ({g('collectives')}, {g('collectives_device_bytes')} B outside the arena)" if g("collectives") else ""
    print(f"{g('precision')} {str(g('policy')) + nccl:<18} grad_digest {g('grad_digest')} loss_first {g('loss_first')} "
          f"planned {g('planned_peak_bytes')} measured {g('measured_peak_bytes')} "
          f"step heap {g('step_heap_allocations')} allocations / {g('step_heap_bytes')} B "
          f"halide heap {g('halide_heap_peak_bytes')} B {f'{rate:.0f}' if finite(rate) else rate} tokens/s")
    if not finite(g("loss_first")) or g("loss_first") <= 0:  # a cross-entropy: 0 means nothing ran
        print(f"  FAILED: {g('precision')} {g('policy')}: loss_first is {g('loss_first')} (not a finite positive number)")
        ok = False
    if g("measured_peak_bytes") is None or g("measured_peak_bytes") != g("planned_peak_bytes"):
        print(f"  FAILED: {g('precision')} {g('policy')}: measured peak {g('measured_peak_bytes')} != planned {g('planned_peak_bytes')}")
        ok = False
if sys.argv[2] == "1":
    print(f"dry run: {len(rows)} results (none expected without a GPU)")
    sys.exit(0 if not rows else 1)
for p, runs in (("fp32", 7), ("bf16", 6)):
    got = [r for r in rows if r.get("precision") == p]
    through_nccl = sum(str(r.get("collectives", "")).startswith("NCCL") for r in got)
    same = len(got) == runs and len({r.get("grad_digest") for r in got}) == 1 and got[0].get("grad_digest") is not None
    print(p, f"{len(got)} of {runs} runs ({runs - 5} through NCCL: {through_nccl}); digests identical across them:", same)
    ok = ok and same and through_nccl == runs - 5
print("train-gpt verdict:", "passed" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
(($? == 0)) || fail "train-gpt's results (digests, first losses, peaks: see above)"

say "== GPT-2 124M and SmolLM2-135M on the GPU (the bundle's BPE tokens): none and full, their digests"
: >"$OUT/real-models.jsonl"
: >"$OUT/real-models.log"
for model in gpt2 smollm2; do
  for precision in fp32 bf16; do
    for policy in none full; do
      allow 90 30 "train-$model $precision $policy" || continue  # the first of a model JIT-compiles its PTX
      echo "-- $model $precision $policy" >>"$OUT/real-models.log"
      timeout -k 10 "$t" .device/bin/train-$model --device cuda --data-dir .device/data --max-steps 3 \
        --eval-samples 0 --sample-length 0 --json $([[ $precision == bf16 ]] && echo --bf16) \
        --checkpoint-policy $policy 2>>"$OUT/real-models.log" | tail -n 1 >>"$OUT/real-models.jsonl"
      rc=$?
      if ((dry)); then
        tail -n 1 "$OUT/real-models.log" | grep -q "train-$model: error: --device cuda: no usable GPU" && ((rc != 0)) ||
          fail "train-$model $precision $policy without a GPU: no 'no usable GPU' error (exit $rc)"
      else
        ((rc == 0)) || fail "train-$model $precision $policy ($(exited)): $(tail -n 1 "$OUT/real-models.log")"
      fi
    done
  done
done
# Per row a finite first loss and measured == planned peak; per model and precision one digest.
timeout -k 5 60 python3 - "$OUT/real-models.jsonl" "$dry" <<'PY' | tee -a "$summary"
import json, math, sys
rows, ok = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")], True
for r in rows:
    g = r.get
    print(f"{g('model')} {g('precision')} {g('policy')}: grad_digest {g('grad_digest')} loss_first {g('loss_first')} "
          f"planned {g('planned_peak_bytes')} measured {g('measured_peak_bytes')} tokens/s {g('tokens_per_s')}")
    if not (isinstance(g("loss_first"), (int, float)) and math.isfinite(g("loss_first")) and g("loss_first") > 0) or \
            g("measured_peak_bytes") != g("planned_peak_bytes"):
        print("  FAILED: a first loss that is not finite and positive, or measured != planned")
        ok = False
if sys.argv[2] == "1":
    print(f"dry run: {len(rows)} results (none expected without a GPU)")
    sys.exit(0 if not rows else 1)
for key in sorted({(r.get("model"), r.get("precision")) for r in rows}):
    digests = {r.get("grad_digest") for r in rows if (r.get("model"), r.get("precision")) == key}
    print(*key, "digests identical across none and full:", len(digests) == 1)
    ok = ok and len(digests) == 1
ok = ok and len(rows) == 8
print("real models verdict:", "passed" if ok else "FAILED", f"({len(rows)} of 8 runs)")
sys.exit(0 if ok else 1)
PY
(($? == 0)) || fail "the real models' results (see above)"

say "== GPU benchmark (remat)"
rm -f "$OUT/bench-remat.json"
if allow 200 60 "bench-gpu"; then
  timeout -k 10 "$t" .device/bin/bench-gpu --precision bf16 --batch-size 4 --steps 2 --out "$OUT/bench-remat.json" 2>&1 | tee -a "$summary"
  rc=$?
  skipped=$(timeout -k 5 30 python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("skipped", ""))' "$OUT/bench-remat.json" 2>/dev/null)
  if ((dry)); then
    [[ -n $skipped ]] && ((rc == 0)) || fail "bench-gpu without a GPU: no skip record in $OUT/bench-remat.json (exit $rc)"
  else
    ((rc == 0)) && [[ -z $skipped ]] || fail "bench-gpu ($(exited)${skipped:+; skipped: $skipped})"
  fi
fi

say "== GPU benchmark (PyTorch, side by side)"
if ! timeout -k 5 60 python3 -c "import torch" 2>/dev/null; then
  say "SKIPPED: bench/torch_gpt2.py (python3 cannot import torch here, within 60 s)"
  ((dry)) || status=1
elif allow 150 45 "bench/torch_gpt2.py"; then
  timeout -k 10 "$t" python3 bench/torch_gpt2.py --batch-size 4 --steps 3 --remat "$OUT/bench-remat.json" --out "$OUT/bench-torch.json" 2>&1 | tee -a "$summary"
  rc=$?
  ((rc == 0)) || fail "bench/torch_gpt2.py ($(exited))"
fi
say "device-check exit status $status after ${SECONDS} s"
exit $status
