#!/usr/bin/env bash
# The GPU checks, run on a machine with a CUDA device against a build made elsewhere
# (scripts/device-bundle.sh gathers it into .device/): the GPU tests, short GPT training runs on
# the GPU, then the GPU benchmark (remat, then PyTorch side by side). Results go to $OUT (default
# ./device-results) as files; summary.txt has what the terminal shows.
#
#   bash scripts/device-check.sh [--dry-run] [--sync]
#
# One deadline for everything, DEADLINE seconds from the start (default 540, inside a 600 s
# call): each step runs for at most its own cap or the time left, whichever is less, and a step
# that no longer gets its minimum is skipped with a line saying so.
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
exited() { echo "exit $rc$( ((rc == 124)) && echo ", timed out after $t s")"; }  # rc of the step run in $t s
# allow CAP MIN WHAT: sets $t, the seconds the step may run; false (and a line) when fewer than
# MIN seconds are left before the deadline
allow() {
  local left=$((DEADLINE - SECONDS))
  if ((left < $2)); then
    say "SKIPPED: $3 (${left} s left before DEADLINE=${DEADLINE} s; it needs ${2} s)"
    status=1
    return 1
  fi
  t=$((left < $1 ? left : $1))
}

# The bundle: every binary there, and every library they need found.
bins=(.device/bin/test_cuda .device/bin/train-gpt .device/bin/bench-gpu)
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

# cuBLASLt (the GEMMs of the CUDA kernels) is dlopen'ed at run time: pip's nvidia wheels (next to
# PyTorch), the library path, the CUDA toolkit, or a bounded search. REMAT_CUBLASLT is exported
# only when a file was found (an empty name would make dlopen return the main program).
find_cublaslt() {
  python3 - 2>/dev/null <<'PY' && return
import glob, os, site, sys
roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
for f in (f for r in roots for f in glob.glob(os.path.join(r, "nvidia", "*", "lib", "libcublasLt.so.13"))):
    print(f)
    sys.exit(0)
sys.exit(1)
PY
  local f
  f=$(ldconfig -p 2>/dev/null | awk '/libcublasLt\.so\.13 / {print $NF; exit}')
  [[ -n $f && -f $f ]] && { echo "$f"; return; }
  [[ -f /usr/local/cuda/lib64/libcublasLt.so.13 ]] && { echo /usr/local/cuda/lib64/libcublasLt.so.13; return; }
  timeout 20 find / \( -path /proc -o -path /sys \) -prune -o -name libcublasLt.so.13 -print -quit 2>/dev/null
}
cublaslt=$(find_cublaslt)
if [[ -n $cublaslt && -f $cublaslt ]]; then
  export REMAT_CUBLASLT=$cublaslt
else
  unset REMAT_CUBLASLT
fi
# Halide's PTX (sm_86) is JIT-compiled by the driver for this GPU; a large cache in a writable
# place keeps every kernel's result for the runs after the first (train-gpt's kernels are
# test_cuda's).
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/remat-cuda-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-2147483648}

gpu="no nvidia-smi"
command -v nvidia-smi >/dev/null && gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
say "== GPU: $gpu; cuBLASLt: ${REMAT_CUBLASLT:-none found (the library path then)}; $( ((dry)) && echo 'dry run (no GPU expected)' || echo 'GPU run'); sync after every kernel: ${REMAT_CUDA_SYNC:-no}; deadline ${DEADLINE} s"

say "== GPU tests"
if allow 240 60 "the GPU tests"; then  # the first use JIT-compiles every kernel's PTX
  timeout "$t" .device/bin/test_cuda --run_test=@gpu --log_level=test_suite --report_level=short --color_output=no \
    >"$OUT/gpu-tests.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/gpu-tests.log" | tee -a "$summary"
  # tests/main.cpp: exit 0 when every case ran and passed, 77 when some were skipped and none failed
  if ((dry)); then
    ((rc == 77)) && grep -q '\[SKIP\] no CUDA device' "$OUT/gpu-tests.log" ||
      fail "the GPU tests did not skip cleanly without a GPU (exit $rc)"
  else
    ((rc == 0)) || fail "the GPU tests ($(exited)$( ((rc == 77)) && echo ': cases were skipped'))"
  fi
fi

say "== train-gpt on the GPU (fortunes are not here: a synthetic corpus), the policies' gradient digests"
mkdir -p /tmp/remat-corpus
python3 -c "import random; random.seed(1); print(''.join(random.choice('abcdefgh \n') for _ in range(200000)))" >/tmp/remat-corpus/text
: >"$OUT/train-gpt.jsonl"
: >"$OUT/train-gpt.log"
for precision in fp32 bf16; do
  for policy in none selective full every_n_layers=2 "full --offload"; do
    allow 40 15 "train-gpt $precision $policy" || continue
    echo "-- $precision $policy" >>"$OUT/train-gpt.log"
    # $policy is two words for offload
    # shellcheck disable=SC2086
    timeout "$t" .device/bin/train-gpt --device cuda --data-dir /tmp/remat-corpus --max-steps 3 --eval-samples 0 \
      --dropout 0.1 --json $([[ $precision == bf16 ]] && echo --bf16) --checkpoint-policy $policy \
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
python3 - "$OUT/train-gpt.jsonl" "$dry" <<'PY' | tee -a "$summary"
import json, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        if line.strip():
            print("not a JSON result:", line.strip()[:200])
for r in rows:
    print(f"{r['precision']} {r['policy']:<18} grad_digest {r['grad_digest']} planned {r['planned_peak_bytes']} "
          f"measured {r['measured_peak_bytes']} {r['tokens_per_s']:.0f} tokens/s")
if sys.argv[2] == "1":
    print(f"dry run: {len(rows)} results (none expected without a GPU)")
    sys.exit(0)
ok = True
for p in ("fp32", "bf16"):
    got = [r for r in rows if r["precision"] == p]
    same = len({r['grad_digest'] for r in got}) == 1 and len(got) == 5
    print(p, "digests identical across the 5 policies:", same)
    ok = ok and same
sys.exit(0 if ok else 1)
PY
(($? == 0)) || fail "train-gpt's gradient digests"

say "== GPU benchmark (remat)"
rm -f "$OUT/bench-remat.json"
if allow 200 60 "bench-gpu"; then
  timeout "$t" .device/bin/bench-gpu --precision bf16 --batch-size 4 --steps 2 --out "$OUT/bench-remat.json" 2>&1 | tee -a "$summary"
  rc=$?
  skipped=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("skipped", ""))' "$OUT/bench-remat.json" 2>/dev/null)
  if ((dry)); then
    [[ -n $skipped ]] && ((rc == 0)) || fail "bench-gpu without a GPU: no skip record in $OUT/bench-remat.json (exit $rc)"
  else
    ((rc == 0)) && [[ -z $skipped ]] || fail "bench-gpu ($(exited)${skipped:+; skipped: $skipped})"
  fi
fi

say "== GPU benchmark (PyTorch, side by side)"
if ! python3 -c "import torch" 2>/dev/null; then
  say "SKIPPED: bench/torch_gpt2.py (python3 cannot import torch here)"
  ((dry)) || status=1
elif allow 150 45 "bench/torch_gpt2.py"; then
  timeout "$t" python3 bench/torch_gpt2.py --batch-size 4 --steps 3 --remat "$OUT/bench-remat.json" --out "$OUT/bench-torch.json" 2>&1 | tee -a "$summary"
  rc=$?
  ((rc == 0)) || fail "bench/torch_gpt2.py ($(exited))"
fi
say "device-check exit status $status after ${SECONDS} s"
exit $status
