#!/usr/bin/env python3
"""make bench-cpu: remat against PyTorch eager (and torch.compile) on this CPU, side by side.

Per model, one remat run writes the initial weights and first batch (--save-initial, dropout 0)
and gives the reference first-step loss. Then, per policy, the systems run alternately, each in
its own process with the same steps: remat (build/bin/train-<model> --json), PyTorch eager and
torch.compile (bench/torch_cpu.py, which checks its first-step loss against remat's before
timing). Reported: median step time after the warm-up steps, tokens/s (token models) or samples/s (mlp),
peak RSS of each process (os.wait4's ru_maxrss), the ratios against remat and against the same
system's `none`. gpt_bpe (the BPE example, vocabulary 4096) adds remat-only `+unfused_head` rows: a
`fused head` line per policy compares remat's fused LM head with the whole one (step time, planned
peak, the logits' bytes); a `bf16` line per (model, policy) gives remat's bf16 step over its fp32 step and PyTorch
autocast's bf16 step over remat's. Writes bench/results/cpu.json and bench/results/cpu.png.
A failing run is a failed row with its reason; the exit code is 1 if a remat or eager run failed.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "bench/cpu.py"
MODELS = {  # the examples' shapes (examples/*/*.cppm); the MLP at batch 256
    "gpt": dict(batch=32, rows_per_sample=64, unit="tokens/s",
                policies=["none", "full", "selective", "every_n_layers=2", "sqrt_n"]),
    "llama": dict(batch=32, rows_per_sample=64, unit="tokens/s",
                  policies=["none", "full", "selective", "every_n_layers=2", "sqrt_n"]),
    "mlp": dict(batch=256, rows_per_sample=1, unit="samples/s", policies=["none", "full", "selective"]),
    # the BPE example's LM head (vocabulary 4096): remat's fused head against +unfused_head (remat only)
    "gpt_bpe": dict(batch=32, rows_per_sample=64, vocab=4096, unit="tokens/s", binary="train-gpt-bpe",
                    data=os.path.join("data", "fortunes-bpe"),
                    policies=["none", "none+unfused_head", "selective", "selective+unfused_head", "full",
                              "full+unfused_head"]),
}
SYSTEMS = ["remat", "pytorch", "torch.compile"]
POLICY = re.compile(r"(none|full|selective|sqrt_n|every_n_layers=[1-9]\d*)(\+unfused_head)?")


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def cpu_info():
    model, flags = platform.processor() or "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    shown = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16") or f.startswith("amx"))
    return {"model": model, "flags": shown, "cores": len(os.sched_getaffinity(0)),
            "bf16": "avx512_bf16" in flags or "amx_bf16" in flags}


def busy_cpu_seconds():  # CPU time of every process on the machine so far (/proc/stat: all but idle, iowait)
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def run(cmd):
    """Runs cmd; returns (exit code, stdout, stderr, peak RSS in bytes of that process, cores that other
    processes kept busy meanwhile)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0, busy0 = time.time(), busy_cpu_seconds()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        _, status, usage = os.wait4(p.pid, 0)
        elsewhere = (busy_cpu_seconds() - busy0 - usage.ru_utime - usage.ru_stime) / max(time.time() - t0, 1e-3)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return (p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                usage.ru_maxrss * 1024, max(0.0, elsewhere))


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def tokens_per_s(model, samples_per_s):  # the token models' samples are sequences of rows_per_sample tokens
    m = MODELS[model]
    return samples_per_s * m["rows_per_sample"] if m["unit"] == "tokens/s" else None


def measure(system, model, policy, precision, cmd, args):
    rc, out, err, rss, elsewhere = run(cmd)
    row = {"system": system, "model": model, "policy": policy, "precision": precision, "command": " ".join(cmd),
           "peak_rss_bytes": rss, "other_busy_cores": elsewhere}
    try:
        summary = json.loads(last_line(out)) if rc == 0 else None
    except json.JSONDecodeError:
        summary = None
    if summary is None or len(summary.get("step_ms", [])) != args.steps:
        reason = last_line(err) or f"exit code {rc}, no JSON summary"
        return {**row, "status": "failed", "error": reason}
    timed = summary["step_ms"][args.warmup:]
    median = statistics.median(timed)
    samples_per_s = MODELS[model]["batch"] * 1000 / median
    row.update(status="ok", step_ms=summary["step_ms"], timed_ms=timed, step_ms_median=median, step_ms_min=min(timed),
               samples_per_s=samples_per_s,
               tokens_per_s=tokens_per_s(model, samples_per_s),
               loss_first=summary["loss_first"], loss_last=summary["loss_last"])
    for key in ("planned_peak_bytes", "measured_peak_bytes", "activation_bytes", "rss_after_import_bytes", "threads"):
        if key in summary:
            row[key] = summary[key]
    if "measured_peak_bytes" in summary:  # remat: the arena, measured
        row["train_bytes"] = summary["measured_peak_bytes"]
    elif "rss_after_import_bytes" in summary:  # PyTorch: what training added to the process
        row["train_bytes"] = rss - summary["rss_after_import_bytes"]
    return row


def bench_model(model, policies, precisions, args, workdir):
    m = MODELS[model]
    binary = os.path.join(args.build, "bin", m.get("binary", f"train-{model}"))
    if not os.access(binary, os.X_OK):
        fail(f"{binary} not found (run make build)")
    common = ["--json", "--eval-samples", "0", "--batch-size", str(m["batch"])]
    if "data" in m:
        common += ["--data-dir", os.path.join(args.build, m["data"])]
    init = os.path.join(workdir, f"{model}.safetensors")
    rc, out, err, _, _ = run([binary, *common, "--max-steps", "1", "--checkpoint-policy", "none", "--dropout", "0",
                           "--save-initial", init])
    if rc != 0:
        fail(f"the reference run of train-{model} failed: {last_line(err)}")
    reference = json.loads(last_line(out))["loss_first"]
    print(f"{model}: remat's first-step loss {reference:.7f} (dropout 0); initial weights and batch in {init}",
          file=sys.stderr)
    dropout = ["--dropout", str(args.dropout)] if model != "mlp" else []  # llama: attention dropout only
    rows = {}
    for rnd, precision, policy in ((r, pr, po) for r in range(args.rounds) for pr in precisions for po in policies):
        bf16 = ["--bf16"] if precision == "bf16" else []
        torch_cmd = [sys.executable, os.path.join(ROOT, "bench", "torch_cpu.py"), "--init", init,
                     "--policy", policy, "--steps", str(args.steps), "--expect-loss", repr(reference),
                     *dropout, *bf16]
        cmds = {"remat": [binary, *common, "--max-steps", str(args.steps), "--checkpoint-policy", policy,
                          *dropout, *bf16],
                "pytorch": torch_cmd, "torch.compile": [*torch_cmd, "--compile"]}
        for system in SYSTEMS:
            if (system == "torch.compile" and args.no_compile) or (system != "remat" and "unfused_head" in policy):
                continue
            t0 = time.time()
            row = measure(system, model, policy, precision, cmds[system], args)
            if (system == "remat" and row["status"] == "ok" and precision == "fp32" and args.dropout == 0
                    and abs(row["loss_first"] - reference) > 1e-4):  # the same first step as the reference
                row.update(status="failed", error=f"first-step loss {row['loss_first']:.7f}, "
                                                  f"the reference run's {reference:.7f}")
            note = (f"{row['step_ms_median']:.1f} ms/step, first loss {row['loss_first']:.7f}"
                    if row["status"] == "ok" else f"FAILED: {row['error']}")
            print(f"  round {rnd + 1}: {model} {precision} {policy:<16} {system:<13} {note} ({time.time() - t0:.0f} s)",
                  file=sys.stderr)
            key = (precision, policy, system)
            row["round_ms"] = [row["step_ms_median"]] if row["status"] == "ok" else []
            rows[key] = pooled(rows[key], row, model) if key in rows else row
    return reference, list(rows.values())


def pooled(first, later, model):
    """One row for a (system, policy) measured in several rounds: every round's timed steps pooled."""
    if first["status"] != "ok" or later["status"] != "ok":
        return first if first["status"] != "ok" else later
    timed = first["timed_ms"] + later["timed_ms"]
    median = statistics.median(timed)
    samples_per_s = MODELS[model]["batch"] * 1000 / median
    return {**first, "step_ms": first["step_ms"] + later["step_ms"], "timed_ms": timed, "step_ms_median": median,
            "round_ms": first["round_ms"] + later["round_ms"],
            "step_ms_min": min(timed), "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s(model, samples_per_s),
            "peak_rss_bytes": max(first["peak_rss_bytes"], later["peak_rss_bytes"]),
            "other_busy_cores": max(first["other_busy_cores"], later["other_busy_cores"])}


def add_ratios(rows):
    ok = {(r["model"], r["precision"], r["policy"], r["system"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        remat = ok.get((r["model"], r["precision"], r["policy"], "remat"))
        none = ok.get((r["model"], r["precision"], "none", r["system"]))
        r["vs_remat"] = r["step_ms_median"] / remat["step_ms_median"] if remat else None
        r["vs_none"] = r["step_ms_median"] / none["step_ms_median"] if none else None


def print_table(rows, cpu, references, args):
    def num(r, key, fmt, scale=1):
        return "-" if r.get(key) is None else fmt.format(r[key] / scale)

    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags: {' '.join(cpu['flags']) or 'none of interest'}; "
          f"torch {torch_version()}; load average before {args.load_before:.2f}, now {os.getloadavg()[0]:.2f}")
    print(f"{args.rounds} rounds of {args.steps} steps per run, median of each run's last {args.steps - args.warmup} "
          f"(after {args.warmup} warm-up), pooled over the rounds; "
          "x remat: step / remat's step; x none: step / the same system's none;\n"
          "train MiB: remat's measured arena peak, PyTorch's peak RSS minus its RSS after import torch; "
          "others: cores other processes kept busy during the run;\n"
          "PyTorch's steps: torch.optim.AdamW(fused=True), F.scaled_dot_product_attention(is_causal=True), "
          "bf16 under torch.autocast (eager and torch.compile), as many threads as remat's")
    print(f"{'model':<7} {'prec':<4} {'policy':<22} {'system':<13} {'step ms':>9} {'min ms':>8} {'tokens/s':>9} "
          f"{'samples/s':>9} {'x remat':>7} {'x none':>7} {'peak RSS MiB':>12} {'train MiB':>9} {'others':>6}")
    last = None
    for r in rows:
        group = (r["model"], r["precision"], r["policy"])
        line = f"{r['model']:<7} {r['precision']:<4} {r['policy']:<22}" if group != last else " " * 35
        last = group
        line += f" {r['system']:<13}"
        if r["status"] == "ok":
            line += (f" {r['step_ms_median']:>9.1f} {r['step_ms_min']:>8.1f} {num(r, 'tokens_per_s', '{:.0f}'):>9}"
                     f" {r['samples_per_s']:>9.1f}"
                     f" {num(r, 'vs_remat', '{:.2f}'):>7} {num(r, 'vs_none', '{:.2f}'):>7}")
        else:
            line += f" {'failed':>9} {'-':>8} {'-':>9} {'-':>9} {'-':>7} {'-':>7}"
        line += (f" {r['peak_rss_bytes'] / 1048576:>12.0f} {num(r, 'train_bytes', '{:.0f}', 1048576):>9}"
                 f" {r['other_busy_cores']:>6.2f}")
        print(line)
    for model, loss in references.items():
        eager = [r["loss_first"] for r in rows if r["model"] == model and r["system"] == "pytorch"
                 and r["precision"] == "fp32" and r["status"] == "ok"]
        if eager:
            print(f"first-step loss, {model}: remat {loss:.7f}, PyTorch {eager[0]:.7f} "
                  f"(|diff| {abs(loss - eager[0]):.1e}, limit 1e-4)")
    print_head(rows)
    print_precision(rows)
    print_rounds(rows)
    for r in rows:
        if r["status"] != "ok":
            print(f"failed: {r['system']} {r['model']} {r['precision']} {r['policy']}: {r['error']}")
    shared = [r["other_busy_cores"] for r in rows if r["other_busy_cores"] > 0.2]
    if shared:
        print(f"warning: {len(shared)} of {len(rows)} runs shared the CPU with other processes (up to "
              f"{max(shared):.2f} cores busy elsewhere): their times are not this machine's; rerun it idle")


def print_head(rows):
    """remat's fused LM head against the same plan with +unfused_head: step time and planned peak."""
    ok = {(r["model"], r["precision"], r["policy"]): r for r in rows if r["system"] == "remat" and r["status"] == "ok"}
    for (model, precision, policy), whole in ok.items():
        if "vocab" not in MODELS[model]:
            continue
        fused = ok.get((model, precision, policy.replace("+unfused_head", "")))
        if not policy.endswith("+unfused_head") or not fused or "planned_peak_bytes" not in fused:
            continue
        m = MODELS[model]
        logits = m["batch"] * m["rows_per_sample"] * m["vocab"] * (2 if precision == "bf16" else 4)
        saved = whole["planned_peak_bytes"] - fused["planned_peak_bytes"]
        print(f"fused head, {model} {precision} {fused['policy']}: {fused['step_ms_median']:.1f} ms/step vs "
              f"{whole['step_ms_median']:.1f} unfused (x {fused['step_ms_median'] / whole['step_ms_median']:.2f}); "
              f"planned peak {fused['planned_peak_bytes'] / 1048576:.1f} MiB vs "
              f"{whole['planned_peak_bytes'] / 1048576:.1f} ({saved / 1048576:.1f} MiB less; the logits are "
              f"{logits / 1048576:.1f} MiB)")


def print_precision(rows):
    """Per (model, policy) with both precisions: remat's bf16 step / its fp32 step (goal <= 0.6 on a CPU with bf16
    arithmetic) and PyTorch autocast's bf16 step / remat's (goal >= 1.3)."""
    ok = {(r["model"], r["precision"], r["policy"], r["system"]): r["step_ms_median"] for r in rows
          if r["status"] == "ok"}
    for (model, precision, policy, system), bf16 in ok.items():
        fp32 = ok.get((model, "fp32", policy, "remat"))
        if precision != "bf16" or system != "remat" or not fp32:
            continue
        line = f"bf16, {model} {policy}: remat bf16 / remat fp32 {bf16 / fp32:.2f} (goal <= 0.6)"
        torch_bf16 = ok.get((model, "bf16", policy, "pytorch"))
        if torch_bf16:
            line += f", PyTorch bf16 / remat bf16 {torch_bf16 / bf16:.2f} (goal >= 1.3)"
        print(line)


def print_rounds(rows):
    """Each round's step ÷ remat's step of the same round: how far the host's drift moves a ratio."""
    remat = {(r["model"], r["precision"], r["policy"]): r["round_ms"] for r in rows
             if r["system"] == "remat" and r["status"] == "ok"}
    for r in rows:
        ours = remat.get((r["model"], r["precision"], r["policy"]))
        if r["system"] == "remat" or r["status"] != "ok" or not ours or len(ours) != len(r["round_ms"]) or len(ours) < 2:
            continue
        ratios = [theirs / mine for theirs, mine in zip(r["round_ms"], ours)]
        print(f"per round, {r['system']} ÷ remat, {r['model']} {r['precision']} {r['policy']}: "
              f"{' '.join(f'{x:.2f}' for x in ratios)} (remat faster in {sum(x > 1 for x in ratios)} of {len(ratios)})")


def torch_version():
    import torch
    return torch.__version__


def plot(rows, cpu, path):  # step time against peak RSS, one point per system and policy
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    colors = {"remat": "tab:blue", "pytorch": "tab:orange", "torch.compile": "tab:green"}
    for ax, model in zip(axes[0], models):
        for system in SYSTEMS:
            pts = [r for r in rows if r["model"] == model and r["system"] == system and r["status"] == "ok"]
            if not pts:
                continue
            xs, ys = [r["peak_rss_bytes"] / 1048576 for r in pts], [r["step_ms_median"] for r in pts]
            shared = [r["other_busy_cores"] > 0.2 for r in pts]  # hollow: the CPU was shared
            ax.scatter(xs, ys, edgecolors=colors[system], marker="o", s=40,
                       facecolors=["none" if sh else colors[system] for sh in shared])
            for i, (r, x, y) in enumerate(sorted(zip(pts, xs, ys), key=lambda p: p[2])):
                label = r["policy"] + (" bf16" if r["precision"] == "bf16" else "")
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 3 if i % 2 else -9), fontsize=8)
        ax.set_title(f"{model} (batch {MODELS[model]['batch']})")
        ax.set_xlabel("peak RSS of the process (MiB); hollow: other processes used the CPU during the run")
        ax.set_ylabel("median step time (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(handles=[Line2D([], [], marker="o", linestyle="", color=c, label=s) for s, c in colors.items()])
    fig.suptitle(f"remat vs PyTorch on the CPU ({cpu['model']}, {cpu['cores']} cores): one point per system and policy",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the median")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over every (policy, system), alternating; each row pools its rounds' timed steps")
    ap.add_argument("--models", default="gpt,llama,mlp,gpt_bpe", help="comma-separated: gpt, llama, mlp, gpt_bpe")
    ap.add_argument("--policies", help="comma-separated (default: gpt and llama none,full,selective,"
                                       "every_n_layers=2,sqrt_n; mlp none,full,selective)")
    ap.add_argument("--precisions", help="comma-separated: fp32, bf16 (default: fp32, and bf16 where the CPU has "
                                         "avx512_bf16 or amx_bf16)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    ap.add_argument("--dropout", type=float, default=0.0, help="gpt and llama dropout while timing, both systems")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build folder (bin/train-*)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="where cpu.json and cpu.png go")
    args = ap.parse_args()
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        fail(f"--models {args.models}: choose from {', '.join(MODELS)}")
    policies = args.policies.split(",") if args.policies else None
    if policies and not all(POLICY.fullmatch(p) for p in policies):
        fail(f"--policies {args.policies}: each one of none, full, selective, every_n_layers=N, sqrt_n "
             "(+unfused_head: remat only)")
    if args.rounds < 1:
        fail(f"--rounds {args.rounds}: need at least 1")
    if args.warmup < 0 or args.steps <= args.warmup:
        fail(f"--steps {args.steps} --warmup {args.warmup}: need steps > warmup >= 0")
    if not 0 <= args.dropout < 1:
        fail(f"--dropout {args.dropout}: not in [0, 1)")
    cpu = cpu_info()
    precisions = args.precisions.split(",") if args.precisions else ["fp32", "bf16"] if cpu["bf16"] else ["fp32"]
    if any(p not in ("fp32", "bf16") for p in precisions):
        fail(f"--precisions {args.precisions}: each one of fp32, bf16")
    if not cpu["bf16"]:
        print("bf16 rows " + ("run on a CPU without bf16 arithmetic (neither avx512_bf16 nor amx_bf16: MKL and PyTorch "
                              "convert to fp32)" if "bf16" in precisions else
                              "skipped: the CPU has neither avx512_bf16 nor amx_bf16 (--precisions fp32,bf16 runs them)"),
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    load = args.load_before = os.getloadavg()[0]
    if load > cpu["cores"] / 2:
        print(f"warning: load average {load:.2f} on {cpu['cores']} cores before the bench: timings will be noisy",
              file=sys.stderr)
    rows, references = [], {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="remat-bench-cpu-") as workdir:
        for model in models:
            references[model], r = bench_model(model, policies or MODELS[model]["policies"], precisions, args, workdir)
            rows += r
    add_ratios(rows)
    print_table(rows, cpu, references, args)
    result = {"cpu": cpu, "torch": torch_version(), "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
              "dropout": args.dropout, "seconds": time.time() - started,
              "load_average_before": args.load_before, "load_average_after": os.getloadavg()[0],
              "first_step_loss_remat": references, "rows": rows}
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, cpu, os.path.join(args.out, "cpu.png"))
    print(f"wrote {os.path.relpath(os.path.join(args.out, 'cpu.json'))} and "
          f"{os.path.relpath(os.path.join(args.out, 'cpu.png'))} ({time.time() - started:.0f} s)")
    essential_failed = any(r["status"] != "ok" and r["system"] != "torch.compile" for r in rows)
    sys.exit(1 if essential_failed else 0)


if __name__ == "__main__":
    main()
