#!/usr/bin/env python3
"""ctest outside_witness: the plan's memory seen from outside the process, under every policy.

  python3 tests/outside_witness.py <trainer>...

remat's own accounting says planned peak == measured peak (the arena's high-water mark, found by its
canary) and no heap allocation in a step (its allocation hooks). The kernel's view of the same runs:
each run is a fresh process whose peak resident set (VmHWM, from wait4's rusage: the operating
system's count, not remat's) is taken from outside. What the plan claims, checked against it:
- the peak RSS is at least the planned peak (the arena's pages are really touched), and
- peak RSS - planned peak is the same under every policy and budget (a policy changes the arena
  and nothing else: a hidden allocation, an arena larger than planned or a buffer a policy needs
  outside the plan would show as a difference), within SPREAD_MIB + SPREAD_FRACTION of the largest
  planned peak (page granularity and the allocator's arenas); per precision, since bf16 kernels
  are other code.
Each run also reports remat's own planned == measured and step_heap_allocations == 0.
Each trainer: 2 steps, every policy and a memory budget halfway between full's planned peak and none's, fp32 and bf16. ctest gives it the small
examples; the slow test the full-size trainers (train-gpt2, train-smollm2; docs/tests.md).
"""
import json
import os
import struct
import shutil
import subprocess
import sys
import tempfile
import tempfile

import numpy as np

SPREAD_MIB, SPREAD_FRACTION = 4, 0.002
POLICIES = [["--checkpoint-policy", p] for p in ("none", "full", "selective", "every_n_layers=2", "sqrt_n")]


def main():
    if "ASAN_OPTIONS" in os.environ:  # make test-sanitize: the shadow memory grows with the arena
        print("[SKIP] peak RSS under AddressSanitizer holds shadow memory in proportion to the arena")
        sys.exit(77)
    failures = []
    for trainer in sys.argv[1:]:
        for precision in ([], ["--bf16"]):
            rows = []
            for policy in POLICIES + ["budget"]:
                if policy == "budget":  # halfway between full's planned peak and none's
                    policy = ["--memory-budget", str((rows[0][2]["planned_peak_bytes"] + rows[1][2]["planned_peak_bytes"]) // 2)]
                args = [trainer, "--max-steps", "2", "--json", "--eval-samples", "0", "--sample-length", "0",
                        "--learning-rate", "0", *policy, *precision]
                rss, j = peak_rss(args)
                rows.append((policy[1] if policy[0] == "--checkpoint-policy" else f"budget {policy[1]} B", rss, j))
            failures += judge(os.path.basename(trainer) + (" --bf16" if precision else ""), rows)
    print("every witness agrees with the plan" if not failures else f"{len(failures)} disagreements:\n  " +
          "\n  ".join(failures))
    sys.exit(1 if failures else 0)


def peak_rss(args):
    with tempfile.TemporaryFile(mode="w+") as err:  # a file: a full stderr pipe would block the trainer
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        if status != 0:
            err.seek(0)
            sys.exit(f"{' '.join(args)}: exit status {status}: {err.read().strip()[-300:]}")
    return usage.ru_maxrss * 1024, json.loads(out.strip().splitlines()[-1])


def judge(name, rows):
    failures = []
    largest = max(j["planned_peak_bytes"] for _, _, j in rows)
    limit = SPREAD_MIB * 2**20 + SPREAD_FRACTION * largest
    outside = [rss - j["planned_peak_bytes"] for _, rss, j in rows]
    spread = max(outside) - min(outside)
    for policy, rss, j in rows:
        print(f"{name} {policy}: peak RSS {rss / 2**20:.1f} MiB, planned {j['planned_peak_bytes'] / 2**20:.1f} MiB, "
              f"RSS - planned {(rss - j['planned_peak_bytes']) / 2**20:.1f} MiB; remat's measured peak "
              f"{'==' if j['measured_peak_bytes'] == j['planned_peak_bytes'] else '!='} planned, "
              f"{j['step_heap_allocations']} heap allocations in steps")
        if rss < j["planned_peak_bytes"]:
            failures.append(f"{name} {policy}: peak RSS {rss} B below the planned peak {j['planned_peak_bytes']} B")
        if j["measured_peak_bytes"] != j["planned_peak_bytes"] or j["step_heap_allocations"] != 0:
            failures.append(f"{name} {policy}: remat's own accounting differs from the plan")
    print(f"{name}: RSS - planned spreads {spread / 2**20:.2f} MiB over the policies (limit {limit / 2**20:.1f} MiB)")
    if spread > limit:
        failures.append(f"{name}: RSS - planned spreads {spread / 2**20:.2f} MiB (limit {limit / 2**20:.1f} MiB)")
    return failures


main()
