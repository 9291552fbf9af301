#!/usr/bin/env bash
# The GPU checks, run on a machine with a CUDA device against a build made elsewhere
# (scripts/device-bundle.sh gathers it into .device/). In under 8 minutes: the GPU tests, a short
# GPT training run on the GPU, then the GPU benchmark (remat, then PyTorch side by side).
# Results go to $OUT (default ./device-results) as files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-results}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
status=0
step() { echo "== $*"; }
# cuBLASLt (the GEMMs of the CUDA kernels) is loaded at run time from the machine's CUDA toolkit
if ! ldconfig -p | grep -q 'libcublasLt.so.13 '; then
  export REMAT_CUBLASLT=$(ls /usr/local/cuda/lib64/libcublasLt.so.13 2>/dev/null ||
    find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -n 1)
fi

step "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1); cuBLASLt: ${REMAT_CUBLASLT:-from the library path}" | tee "$OUT/summary.txt"
step "GPU tests" | tee -a "$OUT/summary.txt"
timeout 240 .device/bin/test_cuda --run_test=@gpu --log_level=test_suite --report_level=short > "$OUT/gpu-tests.log" 2>&1 || status=1
tail -n 30 "$OUT/gpu-tests.log" | tee -a "$OUT/summary.txt"

step "train-gpt on the GPU (fortunes are not here: a synthetic corpus), policies' gradient digests" | tee -a "$OUT/summary.txt"
mkdir -p /tmp/remat-corpus
python3 -c "import random; random.seed(1); print(''.join(random.choice('abcdefgh \n') for _ in range(200000)))" > /tmp/remat-corpus/text
for precision in "" --bf16; do
  for policy in none selective full every_n_layers=2 "full --offload"; do
    timeout 45 .device/bin/train-gpt --device cuda --data-dir /tmp/remat-corpus --max-steps 3 --eval-samples 0 \
      --dropout 0.1 --json $precision --checkpoint-policy $policy 2>>"$OUT/train-gpt.log" | tail -n 1 >> "$OUT/train-gpt.jsonl" || status=1
  done
done
python3 - "$OUT/train-gpt.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    print(f"{r['precision']} {r['policy']:<18} grad_digest {r['grad_digest']} planned {r['planned_peak_bytes']} "
          f"measured {r['measured_peak_bytes']} {r['tokens_per_s']:.0f} tokens/s")
for p in ("fp32", "bf16"):
    got = [r for r in rows if r["precision"] == p]
    print(p, "digests identical across the 5 policies:", len({r['grad_digest'] for r in got}) == 1 and len(got) == 5)
PY

step "GPU benchmark (remat)" | tee -a "$OUT/summary.txt"
timeout 240 .device/bin/bench-gpu --precision bf16 --batch-size 4 --steps 2 --out "$OUT/bench-remat.json" 2>&1 | tee -a "$OUT/summary.txt" || status=1
step "GPU benchmark (PyTorch, side by side)" | tee -a "$OUT/summary.txt"
timeout 120 python3 bench/torch_gpt2.py --batch-size 4 --steps 3 --remat "$OUT/bench-remat.json" --out "$OUT/bench-torch.json" 2>&1 | tee -a "$OUT/summary.txt" || status=1
echo "device-check exit status $status" | tee -a "$OUT/summary.txt"
exit $status
