#!/usr/bin/env python3
"""ctest plots: scripts/plot.py draws the budget sweep (--plan-report --sweep's JSON) and the loss
curves of --logging-dir folders (trainer_state.json, and metrics.jsonl without it); the memory
timelines are drawn in tests/memory_viz.py.

  .venv/bin/python tests/plots.py <train-mlp> <scratch folder>"""
import os
import shutil
import subprocess
import sys

plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "plot.py")


def run(*args, cwd=None):
    p = subprocess.run(args, capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        sys.exit(f"plots: FAILED: {' '.join(args)} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def expect_png(path):
    if not os.path.exists(path) or os.path.getsize(path) < 10000:
        sys.exit(f"plots: FAILED: {path} is not a picture")


def main():
    train_mlp, scratch = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.makedirs(scratch, exist_ok=True)
    out = run(train_mlp, "--plan-report", "--sweep", cwd=scratch)
    if "table: train-mlp-sweep.json" not in out:
        sys.exit(f"plots: FAILED: the sweep names no table:\n{out}")
    printed = run(sys.executable, plot, "sweep", os.path.join(scratch, "train-mlp-sweep.json"), "-o",
                  os.path.join(scratch, "sweep.png"))
    expect_png(os.path.join(scratch, "sweep.png"))
    print(printed, end="")
    runs = []
    for lr in ("1e-3", "3e-3"):
        folder = os.path.join(scratch, f"lr{lr}")
        run(train_mlp, "--max-steps", "6", "--logging-steps", "2", "--eval-steps", "3", "--eval-samples", "256",
            "--learning-rate", lr, "--logging-dir", folder)
        runs.append(folder)
    # a folder with metrics.jsonl only (a run still going, or killed)
    partial = os.path.join(scratch, "partial")
    os.makedirs(partial, exist_ok=True)
    shutil.copy(os.path.join(runs[0], "metrics.jsonl"), partial)
    printed = run(sys.executable, plot, "loss", *runs, partial, "-o", os.path.join(scratch, "loss.png"))
    expect_png(os.path.join(scratch, "loss.png"))
    print(printed, end="")
    # trainer_state.json logs every --logging-steps (2, 4, 6) and evaluations (3, 6); metrics.jsonl every step
    for expected in [f"{os.path.basename(f)}: 3 logged steps, 2 evaluations" for f in runs] + [
            "partial: 6 logged steps, 2 evaluations"]:
        if expected not in printed:
            sys.exit(f"plots: FAILED: expected {expected!r} in:\n{printed}")
    print("plots: sweep and loss drawn")


if __name__ == "__main__":
    main()
