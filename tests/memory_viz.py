#!/usr/bin/env python3
"""ctest memory_viz: PyTorch's own memory-snapshot tools read what --memory-timeline writes.

  .venv/bin/python tests/memory_viz.py <train-gpt> <scratch folder>

Runs the GPT for one step under two policies with --memory-timeline and --json, then on each file:
pickle.load; torch/cuda/_memory_viz.py's trace_plot and segment_plot (HTML embedding the snapshot,
as pytorch.org/memory_viz opens it), stats (segsum) and trace; its memory() and segments()
flamegraph input (the flamegraph script itself is a download, so not run); the live bytes of the
trace peak at the run's measured_peak_bytes. Then scripts/plot.py timeline draws both. Fails, not
skips, without torch: `make test` installs it into .venv (the Makefile's BENCH_PY_PKGS)."""
import base64
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        sys.exit(f"memory_viz: FAILED: {what}")


def run(*args):
    p = subprocess.run(args, capture_output=True, text=True)
    check(p.returncode == 0, f"{' '.join(args)} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def viz_tool():
    spec = importlib.util.find_spec("torch")
    if spec is None:
        sys.exit(f"memory_viz: torch is not installed in {sys.prefix}: `make test` installs it (the Makefile's "
                 "BENCH_PY_PKGS), or: .venv/bin/pip install torch==2.15.0")
    tool = os.path.join(spec.submodule_search_locations[0], "cuda", "_memory_viz.py")
    check(os.path.exists(tool), f"{tool} is missing")
    return tool


def live_peak(trace):
    live, peak = 0, 0
    for e in trace:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    return peak


def check_file(tool, path, summary):
    with open(path, "rb") as f:
        data = pickle.load(f)
    trace = data["device_traces"][0]
    check(set(data) >= {"segments", "device_traces"}, f"{path}: keys {sorted(data)}")
    check(live_peak(trace) == summary["measured_peak_bytes"],
          f"{path}: the trace peaks at {live_peak(trace)} B, the run measured {summary['measured_peak_bytes']} B")

    # trace_plot / segment_plot: an HTML page that embeds the snapshot (base64 of its pickle)
    for command, kind in (("trace_plot", "Active Memory Timeline"), ("segment_plot", "Allocator State History")):
        html = path + f".{command}.html"
        run(sys.executable, tool, command, path, "-o", html)
        with open(html) as f:
            page = f.read()
        check(kind in page, f"{command}: the page does not say {kind!r}")
        embedded = json.loads(re.search(r"const local_files = (\[.*\])", page).group(1))[0]["base64"]
        check(pickle.loads(base64.b64decode(embedded)) == data, f"{command}: the embedded snapshot differs")

    # stats (segsum): one segment, the arena with its guard; what is allocated at the end is the
    # persistent tensors; it checks itself that blocks add up to the segment
    from torch.cuda import _memory_viz as viz

    stats = run(sys.executable, tool, "stats", path)
    arena = data["segments"][0]
    check("segments: 1" in stats, f"stats:\n{stats}")
    check(f"total_reserved: {viz.Bytes(arena['total_size'])}" in stats, f"stats: reserved\n{stats}")
    check(f"total_allocated: {viz.Bytes(arena['allocated_size'])}" in stats, f"stats: allocated\n{stats}")

    # trace: one line per allocation, each in the arena's segment (seg_0) or past its allocated size
    printed = run(sys.executable, tool, "trace", path)
    check(f"{len(trace)} entries" in printed, f"trace: {printed[:200]}")
    allocs = sum(e["action"] == "alloc" for e in trace)
    check(len(re.findall(r"^\w+ = (seg_0|MEM)\[", printed, re.M)) == allocs, "trace: not one line per allocation")
    check(printed.count("\ndel ") == sum(e["action"] == "free_requested" for e in trace), "trace: frees")

    # memory / segments: the flamegraph input (frames innermost last) of what is allocated at the end
    lines = viz.memory(data, format_flamegraph=lambda text: text).splitlines()
    names = {"params", "grads", "adam_m", "adam_v"}
    for name in names:
        check(any(f"{name} (persistent)" in line for line in lines), f"memory: no {name}:\n" + "\n".join(lines))
    allocated = sum(int(line.rsplit(" ", 1)[1]) for line in lines if ";active_allocated;" in line)
    check(allocated == arena["allocated_size"], f"memory: {allocated} B allocated, the segment says otherwise")
    check(viz.segments(data, format_flamegraph=lambda text: text).startswith("stream_0;seg_"), "segments")
    return data


def main():
    train_gpt, scratch = sys.argv[1], sys.argv[2]
    tool = viz_tool()
    os.makedirs(scratch, exist_ok=True)
    files = []
    for policy in ("none", "full"):
        path = os.path.join(scratch, f"gpt-{policy}.pickle")
        out = run(train_gpt, "--max-steps", "1", "--eval-samples", "0", "--json", "--checkpoint-policy", policy,
                  "--memory-timeline", path)
        summary = json.loads(out.strip().splitlines()[-1])
        data = check_file(tool, path, summary)
        print(f"{policy}: {len(data['device_traces'][0])} trace entries, peak {summary['measured_peak_bytes']} B "
              "= measured_peak_bytes; trace_plot, segment_plot, stats, trace, memory, segments read it")
        files.append((path, summary))
    png = os.path.join(scratch, "timeline.png")
    printed = run(sys.executable, os.path.join(here, "..", "scripts", "plot.py"), "timeline",
                  *[p for p, _ in files], "-o", png)
    for _, summary in files:
        check(f"peak {summary['measured_peak_bytes']} B" in printed, f"plot.py: {printed}")
    check(os.path.getsize(png) > 10000, "plot.py wrote no picture")
    print(f"memory_viz: {checks} checks passed")


if __name__ == "__main__":
    main()
