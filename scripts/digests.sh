#!/usr/bin/env bash
# Behaviour check for refactors: the first step's gradient digest (grad_digest), the parameters'
# digest after two steps (param_digest) and the first loss of every example under every fixed
# policy, fp32 and bf16, with and without dropout, one line each. Run it before and after a
# change on the same machine and diff the outputs (fp32 digests differ between CPU families:
# MKL takes other kernels on Intel and AMD; bf16 ones agree).
#   bash scripts/digests.sh [BUILD_BIN_DIR] > digests.txt
set -euo pipefail
bin=${1:-build/bin}
policies="none selective full every_n_layers=2 sqrt_n every_n_layers=2+selective"
for model in gpt mlp llama; do
  dropouts="0"
  [ "$model" != mlp ] && dropouts="0 0.1"
  for precision in fp32 bf16; do
    flag=""
    [ "$precision" = bf16 ] && flag="--bf16"
    for dropout in $dropouts; do
      for policy in $policies; do
        line=$("$bin/train-$model" --max-steps 2 --eval-samples 0 --json --dropout "$dropout" \
                 --checkpoint-policy "$policy" $flag 2>/dev/null | tail -n 1)
        python3 -c 'import json, sys
j = json.loads(sys.argv[1])
print(sys.argv[2], j["precision"], "dropout=" + sys.argv[3], sys.argv[4], j["grad_digest"], j["param_digest"],
      "%.7f" % j["loss_first"], "planned=%d" % j["planned_peak_bytes"], "measured=%d" % j["measured_peak_bytes"])' \
          "$line" "$model" "$dropout" "$policy"
      done
    done
  done
done
