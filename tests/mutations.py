#!/usr/bin/env python3
"""ctest mutations: faults put in on purpose, each caught by an ordinary test.

  python3 tests/mutations.py <build folder> <scratch folder>

For each fault, $REMAT_MUTATION names it (runtime/mutation.cpp breaks the executor,
tests/io_witness.cpp the snapshot writes) and the ordinary test that must catch it runs as ctest runs it
(the Boost test case, or the script): the fault counts as caught when that test fails saying what the
fault does to it (a message that a fault-free run of the test never prints). A fault no test catches,
or one caught for another reason, fails this test. Every fault is printed with the test that caught it.
"""
import os
import shutil
import subprocess
import sys

build, scratch = sys.argv[1:3]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)


def boost(binary, case):
    return [os.path.join(build, "tests", binary), f"--run_test={case}"]


CRASH_ORDER = [sys.executable, os.path.join(os.path.dirname(__file__), "crash_order.py"),
               os.path.join(build, "bin", "train-gpt2-tiny"), os.path.join(build, "tests", "libremat_io_witness.so"),
               os.path.join(scratch, "crash_order")]

# (REMAT_MUTATION, the fault, the test that must catch it, what its failure must say)
FAULTS = [
    ("skip_recompute", "the first forward rebuilt in backward is not run",
     boost("test_trainer", "gpt_policies_agree_with_dropout"), "changes the gradients"),
    ("swap_saved", "a backward kernel reads two saved tensors of one shape swapped",
     boost("test_model_gradients", "gpt_kernels_match_the_float64_reference"), "outside the tolerance"),
    ("shift_offset", "a backward kernel reads a saved tensor one element off its arena offset",
     boost("test_model_gradients", "gpt_kernels_match_the_float64_reference"), "outside the tolerance"),
    ("drop_accumulate", "a micro-batch's gradients overwrite the previous ones instead of adding",
     boost("test_model_gradients", "gradient_accumulation_adds_micro_batches"), "outside the tolerance"),
    ("reuse_dropout_rows", "every micro-batch's dropout masks restart at row 0 (the first micro-batch's reused)",
     boost("test_trainer", "gradient_accumulation_with_dropout_equals_one_large_batch"), "outside the tolerance"),
    ("flip_snapshot_byte", "a byte of model.safetensors flipped on its way to the disk, after its CRC-32",
     CRASH_ORDER, "CRC-32 mismatch"),
    ("no_fsync", "fsync and fdatasync do nothing", CRASH_ORDER, "never fsync'ed"),
]

missed = []
for name, fault, command, says in FAULTS:
    run = subprocess.run(command, env=dict(os.environ, REMAT_MUTATION=name, BOOST_TEST_COLOR_OUTPUT="no"), capture_output=True, text=True,
                         timeout=600)
    output = run.stdout + run.stderr
    test = " ".join(os.path.basename(part) for part in command[:2])
    if run.returncode != 0 and says in output:
        line = next(line for line in output.splitlines() if says in line)
        print(f"caught  {name}: {fault}\n        by {test}: {line.strip()[:160]}")
    else:
        why = "passed" if run.returncode == 0 else f"failed (exit {run.returncode}) without saying '{says}'"
        print(f"MISSED  {name}: {fault}\n        {test} {why}; its last lines:\n" +
              "\n".join("        | " + line for line in output.splitlines()[-8:]))
        missed.append(name)
print(f"{len(FAULTS) - len(missed)} of {len(FAULTS)} faults caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
sys.exit(1 if missed else 0)
