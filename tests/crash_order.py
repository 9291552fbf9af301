#!/usr/bin/env python3
"""ctest crash_order: how a snapshot save reaches the disk, seen from outside the trainer (the LD_PRELOAD
witness tests/io_witness.cpp), and a crash at each point of it.

  python3 tests/crash_order.py <train-gpt2-tiny> <libremat_io_witness.so> <scratch folder>

1. Two steps of a small GPT-2 with a snapshot after each (--save-steps 1 --save-total-limit 1), under the
   witness. The discipline, in every save: each file is written under a temporary name, fsync'ed after its
   last write and before its rename, and the folder holding it fsync'ed after the rename; the snapshot
   folder snapshot-<n>.tmp is fsync'ed after the rename of its last file and before its own rename to
   snapshot-<n>; the output folder is fsync'ed after that rename and before the older snapshot is removed.
2. For each event of the second save (from its first write to the removal of snapshot-1), the same run
   killed with SIGKILL just before that event: the output folder holds snapshot-1 or snapshot-2 or both,
   nothing else named snapshot-<n>, each byte-equal to the uninterrupted run's; and a run resumed from it
   ends with the uninterrupted run's parameters.
"""
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

trainer, witness, scratch = sys.argv[1:4]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
data = os.path.join(scratch, "data")
os.makedirs(data)
rng = np.random.default_rng(0)
for name, count in (("train.bin", 8 * 1025), ("val.bin", 2 * 1025)):  # llm.c's layout (scripts/bpe.py)
    with open(os.path.join(data, name), "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(rng.integers(0, 37, count, dtype=np.uint16).tobytes())
FLAGS = ["--data-dir", data, "--eval-samples", "0", "--save-steps", "1", "--save-total-limit", "1"]
FILES = ("model.safetensors", "optimizer.safetensors", "trainer_state.json")


def train(out, steps, crash_at=None, log=None, resume=False, extra=()):
    env = dict(os.environ, LD_PRELOAD=witness)
    if log:
        env["REMAT_IO_LOG"] = log
    if crash_at:
        env["REMAT_IO_CRASH_AT"] = str(crash_at)
    args = [trainer, *FLAGS, "--max-steps", str(steps), "--output-dir", out, *extra]
    if resume:
        args += ["--resume-from-snapshot", out]
    return subprocess.run(args, env=env, capture_output=True, text=True)


def events_of(log):
    with open(log) as f:
        return [line.split() for line in f.read().splitlines()]


def snapshots(out):
    return sorted(n for n in os.listdir(out) if n.startswith("snapshot-") and "." not in n)


def contents(folder):
    out = {}
    for f in FILES:
        with open(os.path.join(folder, f), "rb") as fh:
            out[f] = fh.read()
    return out


def check_discipline(events):
    """The violations of the save discipline in one run's events."""
    bad = []

    def first(pred, start=0, end=None):
        return next((i for i in range(start, len(events) if end is None else end) if pred(events[i])), None)
    for r, e in enumerate(events):
        if e[0] != "rename" or not e[1].endswith(".tmp"):
            continue
        tmp, final = e[1], e[2]
        parent = os.path.dirname(final)
        writes = [i for i in range(r) if events[i][:2] == ["write", tmp]]
        inner = [i for i in range(r) if events[i][0] == "rename" and events[i][2].startswith(tmp + "/")]
        last = max(writes + inner, default=None)
        if last is None:
            bad.append(f"{tmp}: renamed with nothing written into it")
            continue
        if first(lambda x: x[:2] == ["fsync", tmp], last + 1, r) is None:
            bad.append(f"{tmp}: renamed to {final} without an fsync after its last "
                       + ("write" if writes and last == writes[-1] else "file's rename"))
        synced = first(lambda x: x[:2] == ["fsync", parent], r + 1)
        if synced is None:
            bad.append(f"{final}: its folder {parent} never fsync'ed after the rename")
        elif os.path.basename(final).startswith("snapshot-"):
            removal = first(lambda x: x[0] in ("rename", "rmdir", "unlink") and x[1] != tmp
                            and os.path.basename(x[1]).startswith("snapshot-") and x[1] != final, r + 1)
            if removal is not None and removal < synced:
                bad.append(f"{' '.join(events[removal])} before the fsync of {parent} after {final}'s rename")
    return bad


# 1. The uninterrupted run and its order.
reference_dir, reference_log = os.path.join(scratch, "reference"), os.path.join(scratch, "reference.log")
r = train(reference_dir, 2, log=reference_log)
if r.returncode:
    sys.exit(f"crash_order: the uninterrupted run failed ({r.returncode}): {r.stderr.strip()[-400:]}")
events = events_of(reference_log)
saves = [e for e in events if e[0] == "rename" and os.path.basename(e[2]).startswith("snapshot-")]
violations = check_discipline(events)
assert snapshots(reference_dir) == ["snapshot-2"], snapshots(reference_dir)
assert [os.path.basename(e[2]) for e in saves if e[1].endswith(".tmp")] == ["snapshot-1", "snapshot-2"], saves
renamed_files = sum(1 for e in events if e[0] == "rename" and os.path.basename(e[2]) in FILES)
assert renamed_files == 2 * len(FILES), f"{renamed_files} files renamed into place, expected {2 * len(FILES)}"
begin = next(i for i, e in enumerate(events) if e[0] == "write" and "/snapshot-2.tmp/" in e[1])
end = next(i for i, e in enumerate(events) if i > begin and e[0] in ("rmdir", "unlink") and "/snapshot-1" in e[1])
print(f"the second save, {end - begin + 1} events (of {len(events)}):")
for i in range(begin, end + 1):
    print(f"  {i + 1:3d} {events[i][0]:<7}", *(os.path.relpath(p, scratch) for p in events[i][1:]))
if violations:
    sys.exit("crash_order: FAILED: the save discipline is broken:\n  " + "\n  ".join(violations))
print(f"discipline: {renamed_files} files and 2 snapshot folders renamed into place, each fsync'ed before its "
      "rename and its folder fsync'ed after it, the output folder before snapshot-1 was removed")
want = {"snapshot-1": None, "snapshot-2": contents(os.path.join(reference_dir, "snapshot-2"))}
first_dir = os.path.join(scratch, "first")  # the same run, stopped after its first step and save
r = train(first_dir, 2, extra=["--exit-interval", "1"])
want["snapshot-1"] = contents(os.path.join(first_dir, "snapshot-1"))

# 2. A crash before each event of the second save.
failures, outcomes = [], {}
for k in range(begin + 1, end + 2):
    out = os.path.join(scratch, f"crash{k}")
    r = train(out, 2, crash_at=k)
    if r.returncode != -9:
        failures.append(f"event {k}: the run was not killed there (exit {r.returncode})")
        continue
    left = snapshots(out)
    outcomes[k] = left
    if not left or not set(left) <= set(want):
        failures.append(f"event {k}: the output folder holds {left}")
    for name in left:
        if contents(os.path.join(out, name)) != want[name]:
            failures.append(f"event {k}: {name} differs from the uninterrupted run's")
    resumed = train(out, 2, resume=True)
    if left == ["snapshot-1"] and resumed.returncode != 0:
        failures.append(f"event {k}: the resume from snapshot-1 failed: {resumed.stderr.strip()[-300:]}")
    if resumed.returncode == 0 and contents(os.path.join(out, "snapshot-2"))["model.safetensors"] != \
            want["snapshot-2"]["model.safetensors"]:
        failures.append(f"event {k}: the resumed run ends with other parameters")
    shutil.rmtree(out)
kinds = {}
for left in outcomes.values():
    kinds[" + ".join(left)] = kinds.get(" + ".join(left), 0) + 1
print(f"killed before each of the {end - begin + 1} events: left " +
      ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())))
if failures:
    sys.exit("crash_order: FAILED:\n  " + "\n  ".join(failures))
if set(kinds) != {"snapshot-1", "snapshot-1 + snapshot-2", "snapshot-2"}:
    sys.exit(f"crash_order: FAILED: the crash points never left each of old, both and new: {kinds}")
print("crash_order: every crash left the old or the new snapshot, whole")
