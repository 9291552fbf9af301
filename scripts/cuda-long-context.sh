#!/usr/bin/env bash
# The CUDA launch check at long contexts, outside ctest (a full-size model's kernels take about a
# minute each to generate): GPT-2 124M and SmolLM2-135M as the bench's context sweep generates them
# (bench/CMakeLists.txt, train-gpt2-t<T> / train-smollm2-t<T>: CPU kernels only there), generated
# here with CUDA too. The model compiler refuses a CUDA kernel that cannot launch on an H100
# (generators/cuda_launches.h); per model this prints the most threads and shared memory a block
# of its launches, or the refusal.
#
#   bash scripts/cuda-long-context.sh [CONTEXT...]     (default: 2048 4096 8192, after `make build`)
set -euo pipefail
cd "$(dirname "$0")/.."
contexts=("$@")
((${#contexts[@]})) || contexts=(2048 4096 8192)
baseline=$(sed -n 's/^REMAT_CPU_TARGET:STRING=//p' build/CMakeCache.txt)
capability=$(sed -n 's/^REMAT_CUDA_CAPABILITY:STRING=//p' build/CMakeCache.txt)
((capability > 0)) || { echo "cuda-long-context: this build generates no CUDA kernels (REMAT_CUDA_CAPABILITY 0)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for t in "${contexts[@]}"; do
  for model in gpt2_t$t smol_t$t; do
    if ! .venv/bin/cmake --build build --target "$model-modelc" >"$out/build.log" 2>&1; then
      echo "$model: no such sweep model (contexts: REMAT_SWEEP_CONTEXTS in bench/CMakeLists.txt)"
      status=1
      continue
    fi
    if build/bench/"$model"-modelc --out "$out" --cpu-targets "$baseline" --cuda-capability "$capability" \
      >"$out/$model.log" 2>&1; then
      awk -v m="$model" '{t = $8 * $9 * $10; if (t > threads) threads = t; if ($NF > shared) shared = $NF}
        END {printf "%s: %d launches fit an H100; at most %d threads and %d bytes of shared memory a block\n",
             m, NR - 1, threads, shared}' "$out/$model.cuda-launches.txt"
    else
      echo "$model: refused: $(tail -n 1 "$out/$model.log")"
      status=1
    fi
  done
done
exit $status
