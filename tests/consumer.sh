#!/usr/bin/env bash
# The out-of-tree test: install remat from BUILD into a temporary prefix, configure tests/consumer/
# (a project of its own: a model module and `remat_add_trainer(... DATA tokens)`) against it with
# nothing but -DCMAKE_PREFIX_PATH (and -DREMAT_CUDA_CAPABILITY=0: CPU kernels only, a third less time,
# and what a remat built with CUDA must also link), clang-19 and Ninja, build it, write token files (llm.c's layout
# for train.bin, nanoGPT's raw uint16 for val.bin) and train a few steps. Usage:
#   tests/consumer.sh <remat build dir> <cmake> <c++ compiler>
set -euo pipefail
build=$(cd "$1" && pwd)
cmake=$2
cxx=$3
# mpirun is required (`make` installs Open MPI; the data-parallel half): without it the test fails, naming it.
command -v mpirun > /dev/null || { echo "consumer: mpirun is not on the PATH (Debian: openmpi-bin)" >&2; exit 1; }
source_dir=$(cd "$(dirname "$0")/consumer" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$cmake" --install "$build" --prefix "$work/prefix" > "$work/install.log"
echo "installed remat into a temporary prefix: $(find "$work/prefix" -type f | wc -l) files"
"$cmake" -S "$source_dir" -B "$work/build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DREMAT_CUDA_CAPABILITY=0 > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
"$cmake" --build "$work/build" > "$work/build.log" || { tail -50 "$work/build.log"; exit 1; }
echo "built the consumer project: $(ls "$work/build/train-tinylm")"

# token files from the fortunes text: bytes as tokens (the model's vocabulary is 160)
mkdir "$work/data"
python3 - "$work/data" <<'PY'
import array, os, struct, sys
root = "/usr/share/games/fortunes"
text = b"".join(open(os.path.join(root, f), "rb").read() for f in sorted(os.listdir(root))
                if os.path.isfile(os.path.join(root, f)) and not f.endswith((".dat", ".u8")))
tokens = array.array("H", (b if b < 160 else 63 for b in text[:200000]))
split = len(tokens) * 9 // 10
train, val = tokens[:split], tokens[split:]
with open(os.path.join(sys.argv[1], "train.bin"), "wb") as f:  # llm.c: 256 int32 header
    f.write(struct.pack("<256i", 20240520, 1, len(train), *([0] * 253)))
    f.write(train.tobytes())
with open(os.path.join(sys.argv[1], "val.bin"), "wb") as f:  # nanoGPT: raw uint16
    f.write(val.tobytes())
PY
"$work/build/train-tinylm" --data-dir "$work/data" --max-steps 6 --eval-samples 16 --json > "$work/train.json"
python3 - "$work/train.json" <<'PY'
import json, math, sys
summary = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"train-tinylm: {summary['steps']} steps, loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}, "
      f"eval loss {summary['eval_loss']:.4f}, planned peak {summary['planned_peak_bytes']} B, "
      f"measured {summary['measured_peak_bytes']} B")
assert summary["model"] == "tinylm" and summary["steps"] == 6, summary
assert math.isfinite(summary["loss_last"]) and summary["loss_last"] < summary["loss_first"], "the loss did not fall"
assert summary["planned_peak_bytes"] == summary["measured_peak_bytes"], "planned and measured peaks differ"
PY

# The same model data-parallel (mpirun --oversubscribe -np 2, batch 4 per rank, unsharded and
# with --shard-optimizer) against one process with batch 8: the losses of the same global batches
# agree (tests/data_parallel.py's limit, 2e-5 relative), planned == measured per rank.
mpirun=(mpirun --oversubscribe -np 2)
[[ $(id -u) == 0 ]] && mpirun+=(--allow-run-as-root)
run_tinylm() {  # NAME LAUNCHER... -- FLAGS...
  local name=$1 launcher=()
  shift
  while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
  shift
  "${launcher[@]}" "$work/build/train-tinylm" --data-dir "$work/data" --max-steps 6 --eval-samples 0 \
    --logging-dir "$work/$name" --json "$@" > "$work/$name.json" 2> "$work/$name.log" ||
    { tail -20 "$work/$name.log"; exit 1; }
}
run_tinylm one -- --batch-size 8
run_tinylm ranks "${mpirun[@]}" -- --batch-size 4
run_tinylm sharded "${mpirun[@]}" -- --batch-size 4 --shard-optimizer
python3 - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
def losses(name):
    return [json.loads(l)["loss"] for l in open(os.path.join(work, name, "metrics.jsonl")) if '"loss"' in l]
one = losses("one")
for name in ("ranks", "sharded"):
    summary = json.loads(open(os.path.join(work, name + ".json")).read().splitlines()[-1])
    two = losses(name)
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
    print(f"train-tinylm, 2 ranks{' sharded' if name == 'sharded' else ''}: {len(two)} losses within {worst:.1e} "
          f"relative of one process's; planned peak per rank {summary['planned_peak_bytes']} B, measured "
          f"{summary['measured_peak_bytes']} B")
    assert summary["ranks"] == 2 and len(two) == len(one) == 6, (summary["ranks"], one, two)
    assert worst <= 2e-5, f"2 ranks' losses differ from one process's by {worst:.1e} relative"
    assert summary["planned_peak_bytes"] == summary["measured_peak_bytes"], "planned and measured peaks differ"
PY
