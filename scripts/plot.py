#!/usr/bin/env python3
"""remat's plots (matplotlib, in the project's .venv), each one PNG:

  timeline  memory timelines (--memory-timeline FILE: PyTorch memory snapshots) of several runs,
            one panel each: the live bytes over the recorded step, coloured by phase, with the peak
            .venv/bin/python scripts/plot.py timeline none.pickle full.pickle -o timeline.png
  loss      loss curves from --logging-dir folders (trainer_state.json's log_history: training
            loss per logged step, eval_loss where evaluated; metrics.jsonl when there is no state)
            .venv/bin/python scripts/plot.py loss runs/a runs/b -o loss.png
  sweep     the budget sweep (--plan-report --sweep writes <trainer>-sweep.json): predicted (and,
            with --calibrate, measured) step time against the memory budget
            .venv/bin/python scripts/plot.py sweep train-gpt-sweep.json -o sweep.png
"""
import os
import sys
import argparse
import json
import pickle

MiB = 1048576.0
# what the live bytes are, stacked bottom to top: by the phase that allocated them (remat's
# frames say it); a PyTorch snapshot's allocations are "other", and those made before its
# recording started (freed in the trace without an alloc, or still allocated in its segments)
# "before the trace"
KINDS = {
    "before the trace": "#d4d4d4",
    "persistent": "#bab0ab",
    "forward": "#4e79a7",
    "recompute": "#f28e2c",
    "backward": "#59a14f",
    "optimizer": "#af7aa1",
    "other": "#9c755f",
    "arena hole": "#e8e8e8",
    "measured": "#e15759",  # what the measured peak counts beyond the plan's tensors
}


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"plot.py: matplotlib is not installed in {sys.prefix}: `make test` or `make bench-cpu` installs it "
                 "(the Makefile's BENCH_PY_PKGS)")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def kind_of(event):
    """What an allocation is: its phase as remat's frame names it ("s1.b3.h2 (forward)"),
    persistent (what lives through the step), measured (what the measured peak adds), an arena
    hole, or other (a PyTorch allocation)."""
    name = event["frames"][0]["name"] if event.get("frames") else ""
    if name.startswith("arena hole"):
        return "arena hole"
    phase = name[name.rindex("(") + 1 : -1] if name.endswith(")") and "(" in name else ""
    return phase if phase in KINDS else "other"


def live_bytes(snapshot):
    """The live bytes of the trace (its first device with one) by kind, after each moment (ms since
    the first event): ([ms], {kind: [bytes]}), and the peak (over every event)."""
    device = next((d for d, t in enumerate(snapshot["device_traces"]) if t), 0)
    trace = snapshot["device_traces"][device] if snapshot["device_traces"] else []
    # allocated before the trace: freed in it without an alloc, or allocated at the end but never in it
    allocated, before = set(), 0
    for e in trace:
        if e["action"] == "alloc":
            allocated.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in allocated:
                allocated.discard(e["addr"])
            else:
                before += e["size"]
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b.get("address", addr) not in allocated:
                before += b.get("requested_size", b["size"])
            addr += b["size"]
    start = trace[0].get("time_us", 0) if trace else 0
    live = {k: 0 for k in KINDS}
    live["before the trace"] = before
    kind_at = {}
    times, levels, peak = [], {k: [] for k in KINDS}, before
    for e in trace:
        if e["action"] == "alloc":
            kind_at[e["addr"]] = kind_of(e)
            live[kind_at[e["addr"]]] += e["size"]
        elif e["action"] == "free_completed":
            live[kind_at.pop(e["addr"], "before the trace")] -= e["size"]
        else:
            continue
        peak = max(peak, sum(live.values()))
        t = (e.get("time_us", start) - start) / 1000.0
        if times and times[-1] == t:  # one point per moment: the level after its last event
            for k in KINDS:
                levels[k][-1] = live[k]
        else:
            times.append(t)
            for k in KINDS:
                levels[k].append(live[k])
    if times:  # the last level, to the end of the picture
        times.append(times[-1] + max(1.0, 0.01 * times[-1]))
        for k in KINDS:
            levels[k].append(levels[k][-1])
    return times, levels, peak


def label_of(path, snapshot):
    run = snapshot.get("remat")
    if run:
        return f"{run['model']}: {run['policy']}"
    return os.path.splitext(os.path.basename(path))[0]


def timeline(args):
    plt = pyplot()
    runs = []
    for path in args.files:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        runs.append((label_of(path, snapshot), *live_bytes(snapshot)))
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.9 * len(runs) + 1.0), sharex=True, sharey=True, squeeze=False)
    for ax, (label, times, levels, peak) in zip(axes[:, 0], runs):
        bottom = [0.0] * len(times)
        for kind, colour in KINDS.items():
            top = [b + v / MiB for b, v in zip(bottom, levels[kind])]
            if any(levels[kind]):
                ax.fill_between(times, bottom, top, step="post", color=colour, linewidth=0, label=kind)
            bottom = top
        ax.plot(times, bottom, drawstyle="steps-post", color="black", lw=0.6)
        ax.axhline(peak / MiB, color="crimson", lw=0.8, ls="--")
        ax.set_title(f"{label}: peak {peak / MiB:.1f} MiB ({peak} B)", fontsize=10, loc="left")
        ax.set_ylabel("live MiB")
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("time in the recorded step (ms); colour: the phase that allocated the bytes")
    shown = {l: h for ax in axes[:, 0] for h, l in zip(*ax.get_legend_handles_labels())}
    kinds = [k for k in KINDS if k in shown]
    fig.legend([shown[k] for k in kinds], kinds, loc="upper right", ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(args.output, dpi=args.dpi)
    for label, _, _, peak in runs:
        print(f"{label}: peak {peak} B ({peak / MiB:.1f} MiB)")


def loss_history(folder):
    """(steps, losses, eval steps, eval losses) of a --logging-dir folder."""
    state = os.path.join(folder, "trainer_state.json")
    if os.path.exists(state):
        with open(state) as f:
            history = json.load(f)["log_history"]
    else:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            history = [json.loads(line) for line in f if line.strip()]
    train = [(h["step"], h["loss"]) for h in history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h and "step" in h]
    return train, evals


def loss(args):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for folder in args.files:
        train, evals = loss_history(folder)
        name = os.path.basename(os.path.normpath(folder))
        if train:
            (line,) = ax.plot(*zip(*train), lw=1.2, label=f"{name}: training loss")
            if evals:
                ax.plot(*zip(*evals), "o--", color=line.get_color(), ms=4, label=f"{name}: eval loss")
        elif evals:
            ax.plot(*zip(*evals), "o--", ms=4, label=f"{name}: eval loss")
        print(f"{name}: {len(train)} logged steps, {len(evals)} evaluations"
              + (f", last loss {train[-1][1]:.4f}" if train else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)


def sweep(args):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for path in args.files:
        with open(path) as f:
            table = json.load(f)
        rows = table["rows"]
        budget = [r["budget_bytes"] / MiB for r in rows]
        name = f"{table['model']} ({table['precision']}, batch {table['batch']}, {table['device']})"
        ax.plot(budget, [r["predicted_ms"] for r in rows], "o-", label=f"{name}: predicted")
        if table.get("measured"):
            ax.plot(budget, [r["measured_ms"] for r in rows], "s--", label=f"{name}: measured")
        for b, r in zip(budget, rows):
            ax.annotate(str(r["launches"]), (b, r["predicted_ms"]), fontsize=7, xytext=(0, 5),
                        textcoords="offset points", ha="center")
        ax.axvline(table["none_peak_bytes"] / MiB, color="grey", lw=0.8, ls=":")
        print(f"{name}: {len(rows)} budgets, {budget[0]:.1f} to {budget[-1]:.1f} MiB")
    ax.set_xlabel("memory budget (MiB); dotted: none's peak; numbers: kernel launches")
    ax.set_ylabel("step time (ms): forward + loss + backward")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["timeline", "loss", "sweep"])
    parser.add_argument("files", nargs="+", help="pickles (timeline), --logging-dir folders (loss), sweep JSON (sweep)")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--dpi", type=int, default=110)
    args = parser.parse_args()
    try:
        {"timeline": timeline, "loss": loss, "sweep": sweep}[args.mode](args)
    except (OSError, KeyError, ValueError, pickle.UnpicklingError) as e:
        sys.exit(f"plot.py {args.mode}: {e.__class__.__name__}: {e}")


if __name__ == "__main__":
    main()
