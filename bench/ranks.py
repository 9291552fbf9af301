#!/usr/bin/env python3
"""Data-parallel scaling on this CPU, side by side in one run: one process with every core's
Halide thread and the global batch, against `mpirun --oversubscribe -np N` ranks with one
thread each (cores / ranks) and the global batch split over them. Per configuration and round,
remat's median step; the scaling efficiency (one process's step / the ranks' step: 1.0 is
perfect); the all-reduce time on the ranks' communication thread per step and the fraction of it
hidden behind backward; each run's planned and measured peak per rank, the ranks' also with
--shard-optimizer (ZeRO-1: each rank keeps the AdamW moments of its shard only). Rounds alternate
the configurations.

    .venv/bin/python bench/ranks.py [--models gpt,mlp] [--policies none,full] [--steps 20] [--rounds 2]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from cpu import cpu_info  # noqa: E402

BATCH = {"gpt": 32, "mlp": 64, "llama": 32, "gpt_bpe": 32}  # global batch, as the examples'


def run(args, ranks):
    trainer = str(ROOT / "build" / "bin" / f"train-{args[0].replace('_', '-')}")
    command = [trainer, *args[1:], "--eval-samples", "0", "--json"]
    if ranks > 1:
        command = ["mpirun", "--oversubscribe", "-np", str(ranks)] + (
            ["--allow-run-as-root"] if os.geteuid() == 0 else []) + command
    r = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=1200)
    if r.returncode != 0:
        sys.exit(f"{' '.join(command)}: exit {r.returncode}: {r.stderr.strip()[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--policies", default="none,full")
    ap.add_argument("--ranks", type=int, default=len(os.sched_getaffinity(0)), help="ranks (default: the cores)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ranks.json"))
    a = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags: {' '.join(cpu['flags'])}; {a.ranks} ranks of "
          f"{max(1, cpu['cores'] // a.ranks)} thread(s) against 1 process of {cpu['cores']}")
    rows = []
    for model in a.models.split(","):
        for policy in a.policies.split(","):
            glob = BATCH[model]
            common = [model, "--checkpoint-policy", policy, "--max-steps", str(a.steps)]
            one_ms, many_ms, sharded_ms, reduce_ms, hidden, peaks = [], [], [], [], [], []
            for _ in range(a.rounds):
                one = run(common + ["--batch-size", str(glob)], 1)
                many = run(common + ["--batch-size", str(glob // a.ranks)], a.ranks)
                sharded = run(common + ["--batch-size", str(glob // a.ranks), "--shard-optimizer"], a.ranks)
                sharded_ms.append(statistics.median(sharded["step_ms"][a.warmup:]))
                one_ms.append(statistics.median(one["step_ms"][a.warmup:]))
                many_ms.append(statistics.median(many["step_ms"][a.warmup:]))
                reduce_ms.append(many["allreduce_ms_mean"])
                hidden.append(many["allreduce_hidden"])
                peaks.append((one["planned_peak_bytes"], one["measured_peak_bytes"], many["planned_peak_bytes"],
                              many["measured_peak_bytes"], sharded["planned_peak_bytes"],
                              sharded["measured_peak_bytes"]))
            row = {"model": model, "policy": policy, "global_batch": glob, "ranks": a.ranks,
                   "one_process_ms": statistics.median(one_ms), "ranks_ms": statistics.median(many_ms),
                   "sharded_ms": statistics.median(sharded_ms),
                   "allreduce_ms": statistics.median(reduce_ms), "hidden": statistics.median(hidden),
                   "one_process_ms_rounds": one_ms, "ranks_ms_rounds": many_ms, "peaks": peaks[-1]}
            row["efficiency"] = row["one_process_ms"] / row["ranks_ms"]
            rows.append(row)
            p1, m1, pn, mn, ps, ms = row["peaks"]
            print(f"{model:5} {policy:5} global batch {glob}: 1 process {row['one_process_ms']:.1f} ms, "
                  f"{a.ranks} ranks {row['ranks_ms']:.1f} ms (efficiency {row['efficiency']:.2f}; rounds "
                  f"{' '.join(f'{x:.1f}/{y:.1f}' for x, y in zip(one_ms, many_ms))}); all-reduce "
                  f"{row['allreduce_ms']:.1f} ms per step, {100 * row['hidden']:.0f}% hidden; peak per rank planned "
                  f"{pn} B, measured {mn} B ({'equal' if pn == mn else 'DIFFERENT'}), --shard-optimizer "
                  f"{row['sharded_ms']:.1f} ms, planned {ps} B, measured {ms} B ({'equal' if ps == ms else 'DIFFERENT'}); "
                  f"1 process {p1} B, measured {m1} B")
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"cpu": cpu, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.relpath(a.out)}")


if __name__ == "__main__":
    main()
