#!/usr/bin/env python3
"""Data-parallel training on Open MPI (mpirun --oversubscribe -np 2, one Halide thread per rank):
2 ranks x batch B train as one process with batch 2B, the same samples in the same order. Per
step, the losses (and the evaluation loss, each rank evaluating every other batch) agree within
2e-5 relative and, after 10 AdamW steps, the parameters within 1e-4 absolute (seen: 1e-7 for the
MLP, 2e-5 for the GPT with dropout). They are not bit-identical: one process's MKL sums a weight
gradient over 2B rows at once, the ranks over B rows each and the ring adds the two sums, and
AdamW's division by sqrt(v) magnifies the difference where a gradient is near 0. Dropout draws
the same masks (each row's counter is its row in the step's global batch, Scalar::first_row).

Checked under none, full, selective, every_n_layers=2 and a memory budget (the GPT's with dropout
0.1), in bf16 (the GPT: losses within 1e-3, parameters within 2e-3, see the case), for the GPT
with dropout 0.1 and evaluation, with gradient accumulation (2 ranks x B x 2 micro-batches
against B x 4), with --shard-optimizer (ZeRO-1: for 2 ranks the same bits as unsharded ranks,
its snapshot's moments too, and half the moments per rank in the plan report);
REMAT_DATA_PARALLEL=1 (one process through the data-parallel path, as the NCCL check on one GPU
runs) gives one process's bits; a snapshot of 2 ranks at step 5 (sharded or not) resumed by 1
rank with the same global batch (steps 6-10 as the 1-rank run's), and one of 1 rank resumed by
2 sharded ranks; a rank started with other flags: one line naming it, exit 2, no step; a rank
failing alone (no data): its line and the job's end; rank 1 killed (SIGKILL): the job ends
within 60 s, mpirun naming rank 1; a SIGTERM to rank 1 alone: both ranks stop after the same
step, with a snapshot. Every run's planned peak per rank equals its measured one.

    data_parallel.py TRAIN_MLP TRAIN_GPT SCRATCH_DIR"""
import json, os, shutil, signal, subprocess, sys, time

import numpy as np
from safetensors.numpy import load_file

mlp, gpt, scratch = sys.argv[1:4]
if shutil.which("mpirun") is None:  # required (`make` installs Open MPI): a failure naming it, not a skip
    sys.exit("data_parallel: mpirun is not on the PATH (Debian: openmpi-bin; make installs it)")
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
failures = []
MPIRUN = ["mpirun", "--oversubscribe", "-np", "2"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
# make test-sanitize: Open MPI unloads its components before LeakSanitizer looks, so what they keep
# shows as leaks of an unknown module no suppression can name; ranks skip the leak check (the
# 1-rank runs of the same code keep it)
MPI_ENV = {**os.environ, **({"ASAN_OPTIONS": os.environ["ASAN_OPTIONS"] + ":detect_leaks=0"}
                            if "ASAN_OPTIONS" in os.environ else {})}


def run(command, case, env=None):
    env = {**(MPI_ENV if command[0] == "mpirun" else os.environ), **(env or {})}
    r = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=600, env=env)
    if r.returncode != 0:
        failures.append(f"{case}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r


results = {}  # case -> (losses, parameters)


def train(program, args, case, ranks, env=None):
    out = os.path.join(scratch, case)
    command = [program, *args, "--max-steps", "10", "--json", "--logging-dir", out, "--output-dir", out,
               "--sample-length", "0"]  # no sample after training: it would cost more than the steps
    if "--eval-samples" not in args:
        command += ["--eval-samples", "0"]
    r = run(MPIRUN + command if ranks > 1 else command, case, env)
    if r.returncode != 0:
        return None
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    if summary["planned_peak_bytes"] != summary["measured_peak_bytes"]:
        failures.append(f"{case}: planned {summary['planned_peak_bytes']} B, measured {summary['measured_peak_bytes']} B")
    if summary["ranks"] != ranks:
        failures.append(f"{case}: the summary says {summary['ranks']} ranks, not {ranks}")
    if summary["collectives"] != ("MPI ring" if ranks > 1 or env else ""):
        failures.append(f"{case}: the summary's collectives are {summary['collectives']!r}")
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    if summary["eval_loss"] is not None:  # the ranks evaluate every ranks-th batch and sum
        losses.append(summary["eval_loss"])
    results[case] = np.array(losses), load_file(os.path.join(out, "snapshot-10", "model.safetensors"))
    return results[case]


def agree(case, one, two, steps=10, loss_limit=2e-5, param_limit=1e-4):
    (loss1, params1), (loss2, params2) = one, two
    loss1 = loss1[len(loss1) - len(loss2):]
    if len(loss2) < steps:
        failures.append(f"{case}: {len(loss1)} and {len(loss2)} losses, not {steps}")
        return
    worst = np.max(np.abs(loss1 - loss2) / np.abs(loss1))
    if worst > loss_limit:
        failures.append(f"{case}: losses differ by {worst:.2e} relative ({loss1} against {loss2})")
    far = max(float(np.max(np.abs(params1[k] - params2[k]))) for k in params1)
    if far > param_limit:
        failures.append(f"{case}: parameters differ by {far:.2e} after 10 steps")
    print(f"{case}: losses within {worst:.1e} relative, parameters within {far:.1e}")


def compare(program, common, one_args, two_args, case, **limits):
    one = train(program, common + one_args, case + "-1rank", 1)
    two = train(program, common + two_args, case + "-2ranks", 2)
    if one is not None and two is not None:
        agree(case, one, two, **limits)
    return one


for policy in ["none", "full"]:
    reference = compare(mlp, ["--checkpoint-policy", policy], ["--batch-size", "32"], ["--batch-size", "16"],
                        f"mlp-{policy}")
# a snapshot of 2 ranks (sharded or not) at step 5, resumed by 1 rank with the same global batch
for sharding in ([], ["--shard-optimizer"]):
    half = os.path.join(scratch, "resume-2ranks" + "".join(sharding))
    run(MPIRUN + [mlp, "--checkpoint-policy", "full", "--batch-size", "16", "--max-steps", "10", "--save-steps", "5",
                  "--exit-interval", "5", "--eval-samples", "0", "--output-dir", half, *sharding], "resume: 2 ranks")
    resumed = train(mlp, ["--checkpoint-policy", "full", "--batch-size", "32", "--resume-from-snapshot",
                          os.path.join(half, "snapshot-5")], "resume-1rank" + "".join(sharding), 1)
    if reference is not None and resumed is not None:
        agree(f"2 ranks{' sharded' if sharding else ''} to step 5, then 1 rank", reference, resumed, steps=5)
# ... and the other way: 1 rank to step 5, then 2 sharded ranks (each loads its shard of the moments)
half = os.path.join(scratch, "resume-1rank-first")
run([mlp, "--checkpoint-policy", "full", "--batch-size", "32", "--max-steps", "10", "--save-steps", "5",
     "--exit-interval", "5", "--eval-samples", "0", "--output-dir", half], "resume: 1 rank")
resumed = train(mlp, ["--checkpoint-policy", "full", "--batch-size", "16", "--shard-optimizer",
                      "--resume-from-snapshot", os.path.join(half, "snapshot-5")], "resume-2ranks-sharded", 2)
if reference is not None and resumed is not None:
    agree("1 rank to step 5, then 2 sharded ranks", reference, resumed, steps=5)
compare(gpt, ["--checkpoint-policy", "full", "--dropout", "0.1", "--eval-samples", "100"], ["--batch-size", "16"],
        ["--batch-size", "8"], "gpt-full-dropout-eval")
compare(gpt, ["--memory-budget", "70%", "--dropout", "0.1"], ["--batch-size", "16"], ["--batch-size", "8"],
        "gpt-budget-dropout")
# bf16: the fp32 parameters differ as above, and each step rounds the weights to bf16 for the
# GEMMs (2^-8 relative steps), where a difference of 1e-5 can move a weight across a rounding
# boundary; the gradients then differ more, and where one is near 0 AdamW's m / sqrt(v) can step
# the other way: up to a learning rate (2e-3) a step apart (seen: losses 4e-5, parameters 8e-4)
compare(gpt, ["--bf16", "--checkpoint-policy", "every_n_layers=2", "--dropout", "0.1"], ["--batch-size", "16"],
        ["--batch-size", "8"], "gpt-bf16-every_n_layers", loss_limit=1e-3, param_limit=2e-3)
compare(mlp, ["--checkpoint-policy", "selective"], ["--batch-size", "16", "--gradient-accumulation-steps", "4"],
        ["--batch-size", "16", "--gradient-accumulation-steps", "2"], "mlp-accumulation")

# --shard-optimizer (ZeRO-1): each rank updates its shard, then the parameters are gathered. For 2
# ranks the sums are the same additions as the unsharded ranks' (g0 + g1), and AdamW is
# elementwise: the same bits as 2 unsharded ranks, and the per-rank moments halve in the plan.
compare(mlp, ["--checkpoint-policy", "full"], ["--batch-size", "32"], ["--batch-size", "16", "--shard-optimizer"],
        "mlp-full-sharded")
compare(gpt, ["--checkpoint-policy", "full", "--dropout", "0.1"], ["--batch-size", "16", "--gradient-accumulation-steps",
        "2"], ["--batch-size", "8", "--gradient-accumulation-steps", "2", "--shard-optimizer"], "gpt-accumulation-sharded")
if "mlp-full-sharded-2ranks" in results and "mlp-full-2ranks" in results:
    (loss_a, params_a), (loss_b, params_b) = results["mlp-full-2ranks"], results["mlp-full-sharded-2ranks"]
    if not np.array_equal(loss_a, loss_b) or any(not np.array_equal(params_a[k], params_b[k]) for k in params_a):
        failures.append("--shard-optimizer: 2 ranks' losses or parameters differ from 2 unsharded ranks'")

# REMAT_DATA_PARALLEL=1: one process runs the data-parallel path as a world of one rank (how
# scripts/device-check.sh runs NCCL on a machine with one GPU); on the CPU its ring has no peer,
# so the bits are one process's, sharded or not
for sharding in ([], ["--shard-optimizer"]):
    case = "mlp-full-world-of-one" + "".join(sharding)
    alone = train(mlp, ["--checkpoint-policy", "full", "--batch-size", "32", *sharding], case, 1,
                  {"REMAT_DATA_PARALLEL": "1"})
    if alone is not None and "mlp-full-1rank" in results:
        (loss_a, params_a), (loss_b, params_b) = results["mlp-full-1rank"], alone
        if not np.array_equal(loss_a, loss_b) or any(not np.array_equal(params_a[k], params_b[k]) for k in params_a):
            failures.append(f"{case}: losses or parameters differ from one process's")


def moments_per_rank(*flags):
    r = run(MPIRUN + [gpt, "--plan-report", *flags], "plan report " + " ".join(flags))
    line = [l for l in r.stdout.splitlines() if l.startswith("data-parallel, per rank")]
    return int(line[0].split("AdamW moments ")[1].split(" B")[0]) if line else None


whole, shard = moments_per_rank(), moments_per_rank("--shard-optimizer")
if whole is None or shard is None or not whole / 2 <= shard <= whole / 2 + 64:
    failures.append(f"plan report: AdamW moments per rank {shard} B sharded against {whole} B")
# the sharded ranks' snapshot holds every rank's moments, gathered: the unsharded ranks' file's
moments = [load_file(os.path.join(scratch, case, "snapshot-10", "optimizer.safetensors"))
           for case in ("mlp-full-2ranks", "mlp-full-sharded-2ranks")]
if moments[0].keys() != moments[1].keys() or any(not np.array_equal(moments[0][k], moments[1][k]) for k in moments[0]):
    failures.append("--shard-optimizer: the snapshot's AdamW moments differ from 2 unsharded ranks'")

# ranks with other flags: one line naming the rank, exit 2, no step
r = subprocess.run(MPIRUN[:2] + MPIRUN[4:] + ["-np", "1", mlp, "--max-steps", "2", "--batch-size", "16", ":", "-np",
                                              "1", mlp, "--max-steps", "2", "--batch-size", "8"],
                   capture_output=True, text=True, errors="replace", timeout=300, env=MPI_ENV)
named = [line for line in r.stderr.splitlines() if "rank 1 of 2 runs with other builds or flags" in line]
if r.returncode == 0 or not named or "step" in r.stdout:
    failures.append(f"other flags on rank 1: exit {r.returncode}, stderr {r.stderr.strip()[-1500:]}")


# a rank that fails alone (its data folder is missing) ends the job with its line, not a hang
try:
    r = subprocess.run(MPIRUN[:2] + MPIRUN[4:] + ["-np", "1", mlp, "--max-steps", "2", ":", "-np", "1", mlp,
                                                  "--max-steps", "2", "--data-dir", os.path.join(scratch, "none")],
                       capture_output=True, text=True, errors="replace", timeout=60, env=MPI_ENV)
    if r.returncode == 0 or "train-mlp (rank 1 of 2): error: " not in r.stderr:
        failures.append(f"a rank failing alone: exit {r.returncode}, stderr {r.stderr.strip()[-1500:]}")
except subprocess.TimeoutExpired:
    failures.append("a rank failing alone: the job was still running 60 s later")

# a rank that dies ends the job, with the rank named, within a bounded time
def rank_process(rank):
    """The pid of this test's long run's `rank` (its environment says which), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"--max-steps\x00100000" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    return None


def long_job(*flags):
    """A 2-rank run of 100000 steps, once both ranks train: (mpirun's process, rank 1's pid or None)."""
    launcher = subprocess.Popen(MPIRUN + [mlp, "--max-steps", "100000", "--eval-samples", "0", *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                env=MPI_ENV)
    victim = None
    for _ in range(100):  # both ranks up and training
        time.sleep(0.1)
        victim = rank_process(1)
        if victim and launcher.poll() is None:
            break
    time.sleep(2)
    if victim is None:
        launcher.kill()
    return launcher, victim


launcher, victim = long_job()
if victim is None:
    failures.append("a killed rank: rank 1's process never showed")
else:
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    try:
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
        if launcher.returncode == 0 or "rank 1" not in err or "signal 9" not in err:
            failures.append(f"a killed rank: exit {launcher.returncode}, stderr {err.strip()[-1500:]}")
        print(f"rank 1 killed: the job ended after {took:.1f} s, exit {launcher.returncode}")
    except subprocess.TimeoutExpired:
        launcher.kill()
        failures.append("a killed rank: the job was still running 60 s later")

# a SIGTERM to one rank (a scheduler's preemption): every rank stops after the same step (the
# step's sums carry it), rank 0 writes the snapshot, exit 0
preempted = os.path.join(scratch, "sigterm")
launcher, victim = long_job("--output-dir", preempted)
if victim is None:
    failures.append("SIGTERM to rank 1: rank 1's process never showed")
else:
    os.kill(victim, signal.SIGTERM)
    try:
        out, err = launcher.communicate(timeout=60)
        stopped = [line for line in out.split("\x1b[K") if "stopped after step" in line]
        if launcher.returncode != 0 or not stopped or "(SIGTERM)" not in stopped[0]:
            failures.append(f"SIGTERM to rank 1: exit {launcher.returncode}, stderr {err.strip()[-1500:]}")
        else:
            step = stopped[0].split("stopped after step ")[1].split()[0]
            if not os.path.isdir(os.path.join(preempted, f"snapshot-{step}")):
                failures.append(f"SIGTERM to rank 1: no snapshot-{step} in {preempted}")
            print(f"SIGTERM to rank 1: both ranks stopped after step {step}, snapshot written")
    except subprocess.TimeoutExpired:
        launcher.kill()
        failures.append("SIGTERM to rank 1: the job was still running 60 s later")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("data-parallel runs agree with one process")
