#!/usr/bin/env python3
"""remat's GPT-2 124M and SmolLM2-135M trainers beside Transformers' own training, one fresh process a row.

remat: build/bin/train-gpt2 and train-smollm2 under every named policy and under budget plans (--memory-budget at
50% and 25% of the none plan's activations above what every plan holds: weights, gradients, AdamW moments), planned
with kernel costs measured at this size first (the trainer's --calibrate, a process per model and precision), each
against the fastest named policy whose planned peak fits its budget.
Transformers (the pinned package: GPT2LMHeadModel / LlamaForCausalLM at the same configs, SDPA attention,
torch.optim.AdamW(fused=True), the same learning rate and weight decay) with gradient checkpointing off and on
(use_reentrant=False). Both read batch-1 windows of the same token file (make train-gpt2's BPE tokens), fp32 and
bf16 (remat --bf16; Transformers under torch.autocast(bfloat16) on fp32 weights), on all cores. Each row runs in a
process of its own, whose peak RSS this script reads from outside it (wait4's ru_maxrss); its step time is the
median of --steps steps after one warm-up step.

Prints the CPU, then per model and precision a table: every row's median step and peak RSS, the ratio
Transformers / remat of step times (remat's none against checkpointing off, every other plan against
checkpointing on; goal >= 1.0) and of peak RSS above the floor both share (16 bytes a parameter). Writes
bench/results/hf.json and a plot of step time against peak RSS (--plot).

--sweep (make bench-hf-context) instead: the longest context each side trains at batch 1 under each RSS cap
(--caps, GiB): Transformers with checkpointing on and remat's full plan (build/bin/train-<model>-t<T>, generated
for each context by bench/CMakeLists.txt) at --contexts, shortest first, 2 steps a process (the second step's peak
holds AdamW's moments), until a process's RSS passes the largest cap (a watchdog stops it there). Writes
bench/results/hf-context.json.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gemm import cpu_line  # noqa: E402

MODELS = {"gpt2": "GPT-2 124M", "smollm2": "SmolLM2-135M"}
POLICIES = ["none", "selective", "every_n_layers=2", "sqrt_n", "full"]
BUDGETS = [50, 25]  # percent of the none plan's activations
LR, WEIGHT_DECAY = 6e-4, 0.01


def hf_config(model, context):
    from transformers import GPT2Config, LlamaConfig
    if model == "gpt2":
        return GPT2Config(n_positions=max(1024, context), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          use_cache=False)
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=max(8192, context), tie_word_embeddings=True,
                       use_cache=False)


def token_windows(path, context, count, seed=0):
    """count windows of context + 1 tokens from an llm.c token file (a 1 KiB header, then uint16)."""
    import numpy as np
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=1024)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - context - 1, size=count)
    return [np.asarray(tokens[s:s + context + 1], dtype=np.int64) for s in starts]


def hf_worker(args):
    """One Transformers row, in this process: prints {"step_ms": [...], "params": n, "loss": [...]}."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(args.model, args.context), attn_implementation="sdpa")
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, fused=True)
    step_ms, losses = [], []
    for window in token_windows(args.tokens, args.context, args.steps):
        x = torch.from_numpy(window[None, :])
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    print(json.dumps({"step_ms": step_ms, "loss": losses, "params": sum(p.numel() for p in model.parameters())}))


def spawn(cmd, kill_above=None, timeout=None):
    """Runs cmd in a fresh process: (exit code, stdout, stderr, its peak RSS in bytes, from wait4). With kill_above
    (bytes), a watchdog reading /proc/<pid>/status kills the process once its RSS passes that; with timeout
    (seconds), once it runs longer: the exit code is then "killed: rss" or "killed: time"."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err, out, killed = [], [], []
    readers = [threading.Thread(target=lambda: err.append(p.stderr.read())),
               threading.Thread(target=lambda: out.append(p.stdout.read()))]
    for r in readers:
        r.start()
    start = time.monotonic()
    while kill_above or timeout:
        if not any(r.is_alive() for r in readers):
            break
        rss = current_rss(p.pid)
        if (kill_above and rss > kill_above) or (timeout and time.monotonic() - start > timeout):
            killed.append("rss" if kill_above and rss > kill_above else "time")
            p.kill()
            break
        time.sleep(0.05)
    for r in readers:
        r.join()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    code = f"killed: {killed[0]}" if killed else p.returncode
    return code, out[0], err[0], usage.ru_maxrss * 1024


def current_rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def median_after_warmup(step_ms):
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms
    return statistics.median(timed)


def remat_row(args, model, precision, plan_flags, label, context=1024, steps=None, **limits):
    trainer = f"train-{model}" if context == 1024 else f"train-{model}-t{context}"
    cmd = [str(ROOT / "build/bin" / trainer), "--data-dir", args.data_dir, "--max-steps",
           str((steps or args.steps) + 1), "--eval-samples", "0", "--sample-length", "0", "--warmup-steps", "0",
           "--json", *plan_flags]
    if precision == "bf16":
        cmd.append("--bf16")
    code, out, err, rss = spawn(cmd, **limits)
    if code:
        return {"system": "remat", "plan": label, "error": failure(code, err), "rss": rss}
    s = json.loads(out.strip().splitlines()[-1])
    return {"system": "remat", "plan": label, "step_ms": median_after_warmup(s["step_ms"]), "rss": rss,
            "planned": s["planned_peak_bytes"], "measured": s["measured_peak_bytes"],
            "activations": s["activation_bytes"], "heap": s["step_heap_allocations"], "params": s["param_count"],
            "grad_digest": s["grad_digest"], "loss_first": s["loss_first"], "costs": s["kernel_costs"]}


def calibrate(args, model, precision):
    """Times every kernel of the model at this size (the trainer's --calibrate: the plans of none, selective and full)
    into args.cost_table, which the budget rows' planner then reads; None, or the failure."""
    cmd = [str(ROOT / "build/bin" / f"train-{model}"), "--data-dir", args.data_dir, "--calibrate", "--cost-table",
           args.cost_table, "--max-steps", "1", "--eval-samples", "0", "--sample-length", "0", "--json"]
    if precision == "bf16":
        cmd.append("--bf16")
    code, _, err, _ = spawn(cmd)
    return failure(code, err) if code else None


def hf_row(args, model, precision, checkpointing, context=1024, steps=None, **limits):
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--precision", precision, "--steps",
           str((steps or args.steps) + 1), "--context", str(context), "--tokens", args.tokens]
    if checkpointing:
        cmd.append("--checkpointing")
    label = "checkpointing " + ("on" if checkpointing else "off")
    code, out, err, rss = spawn(cmd, **limits)
    if code:
        return {"system": "Transformers", "plan": label, "error": failure(code, err), "rss": rss}
    s = json.loads(out.strip().splitlines()[-1])
    return {"system": "Transformers", "plan": label, "step_ms": median_after_warmup(s["step_ms"]), "rss": rss,
            "params": s["params"]}


def failure(code, err):
    if code == "killed: rss":
        return "over the largest RSS cap (stopped)"
    if code == "killed: time":
        return "over the time limit (stopped)"
    return (err.strip().splitlines() or [f"exit {code}"])[-1]


def context_sweep(args, model, precision):
    """The longest context Transformers with checkpointing on and remat's full plan train under each RSS cap, at
    batch 1: each side at args.contexts, shortest first, 2 steps a process (the second step's peak holds AdamW's
    moments, made at the first), until its peak RSS passes the largest cap (the process is stopped there)."""
    caps = [int(c * 2**30) for c in args.caps]
    limits = {"kill_above": max(caps), "timeout": args.sweep_timeout}
    rows = []
    for system in ("Transformers", "remat"):
        for context in args.contexts:
            if system == "Transformers":
                r = hf_row(args, model, precision, True, context=context, steps=1, **limits)
            else:
                r = remat_row(args, model, precision, ["--checkpoint-policy", "full"], "full", context=context,
                              steps=1, **limits)
            rows.append(dict(r, context=context, model=model, precision=precision))
            print(f"  {system} {r['plan']} at {context}: " + (r["error"] if "error" in r else
                  f"{r['rss'] / 2**20:.0f} MiB, {r['step_ms']:.0f} ms"), file=sys.stderr, flush=True)
            if "error" in r or r["rss"] > max(caps):  # a longer context needs more
                break
    return rows


def sweep_table(model, precision, rows, args):
    mib = 1 << 20
    lines = [f"\n**{MODELS[model]}, {precision}: peak RSS by context, batch 1**\n",
             "| context | Transformers, checkpointing on: peak RSS MiB | step ms "
             "| remat full: peak RSS MiB | step ms |",
             "|---|---|---|---|---|"]
    by = {(r["system"], r["context"]): r for r in rows}

    def cells(system, context):
        r = by.get((system, context))
        if r is None:
            return "not run (a shorter context failed) | "
        if "error" in r:
            return f"{r['error']} | "
        return f"{r['rss'] / mib:.0f} | {r['step_ms']:.0f}"
    for context in args.contexts:
        lines.append(f"| {context} | {cells('Transformers', context)} | {cells('remat', context)} |")
    lines += ["", "| RSS cap | longest context, Transformers checkpointing on | longest context, remat full "
              "| remat / Transformers |", "|---|---|---|---|"]
    for cap in args.caps:
        longest = {}
        for system in ("Transformers", "remat"):
            fits = [r["context"] for r in rows
                    if r["system"] == system and "error" not in r and r["rss"] <= cap * 2**30]
            longest[system] = max(fits, default=0)
        label = {s: ("none" if not c else f"{c}" + (" (the longest tried)" if c == args.contexts[-1] else ""))
                 for s, c in longest.items()}
        ratio = f"{longest['remat'] / longest['Transformers']:.1f}" if longest["Transformers"] else "n/a"
        if longest["remat"] == args.contexts[-1] and longest["Transformers"]:
            ratio = "≥ " + ratio
        lines.append(f"| {cap:g} GiB | {label['Transformers']} | {label['remat']} | {ratio} |")
    return "\n".join(lines)


def table(model, precision, rows):
    mib = 1 << 20
    hf = {r["plan"]: r for r in rows if r["system"] == "Transformers"}
    lines = [f"\n**{MODELS[model]}, {precision}, batch 1 x 1024 tokens**\n",
             "| system | plan | step ms | peak RSS MiB | planned = measured | heap in a step | grad_digest "
             "| Transformers / remat step | RSS above the floor, remat / Transformers |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['plan']} | failed: {r['error']} | | | | | | |")
            continue
        ratio = floor_ratio = ""
        if r["system"] == "remat":
            peer = hf.get("checkpointing off" if r["plan"] == "none" else "checkpointing on")
            if peer and "error" not in peer:
                ratio = f"{peer['step_ms'] / r['step_ms']:.2f} (vs {peer['plan']})"
                floor = 16 * r["params"]
                floor_ratio = f"{(r['rss'] - floor) / max(1, peer['rss'] - floor):.2f}"
        same = ("yes" if r["planned"] == r["measured"] else f"NO ({r['planned']} / {r['measured']})") \
            if r["system"] == "remat" else ""
        heap, digest = (str(r["heap"]), f"`{r['grad_digest']}`") if r["system"] == "remat" else ("", "")
        lines.append(f"| {r['system']} | {r['plan']} | {r['step_ms']:.0f} | {r['rss'] / mib:.0f} | {same} | {heap} "
                     f"| {digest} | {ratio} | {floor_ratio} |")
    return "\n".join(lines + budget_lines(rows))


def budget_lines(rows):
    """Each budget plan against the fastest named policy whose planned peak fits the same budget (measured steps)."""
    named = [r for r in rows if r["system"] == "remat" and "error" not in r and "budget" not in r]
    lines = []
    for r in rows:
        if "budget" not in r or "error" in r:
            continue
        fits = [u for u in named if u["planned"] <= r["budget"]]
        head = f"- {r['plan']}, kernel costs {r['costs']}: {r['step_ms']:.0f} ms"
        if not fits:
            lines.append(f"{head}; no named policy fits its budget")
            continue
        best = min(fits, key=lambda u: u["step_ms"])
        gain = 100 * (1 - r["step_ms"] / best["step_ms"])
        lines.append(f"{head}; the fastest named policy that fits it: {best['plan']}, {best['step_ms']:.0f} ms; "
                     f"the budget plan is {abs(gain):.1f}% {'faster' if gain >= 0 else 'slower'}")
    return ["", *lines] if lines else []


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["model"], r["precision"]) for r in results})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (model, precision) in zip(axes[0], keys):
        for r in results:
            if (r["model"], r["precision"]) != (model, precision) or "error" in r:
                continue
            remat = r["system"] == "remat"
            ax.scatter(r["rss"] / 2**30, r["step_ms"] / 1e3, marker="o" if remat else "s",
                       color="tab:blue" if remat else "tab:orange")
            ax.annotate(r["plan"].replace("checkpointing ", "HF ckpt "), (r["rss"] / 2**30, r["step_ms"] / 1e3),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{MODELS[model]}, {precision}")
        ax.set_xlabel("peak RSS (GiB)")
        ax.set_ylabel("step (s)")
        ax.grid(alpha=0.3)
    fig.suptitle("remat plans (circles) against Transformers (squares)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,smollm2")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--policies", default=",".join(POLICIES), help="remat's named policies to run")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="budget plans, percent of the none plan's activations ('' for none)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps a row (after one warm-up step)")
    ap.add_argument("--data-dir", default=str(ROOT / "build/data/fortunes-bpe"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/hf.json"))
    ap.add_argument("--cost-table", default=str(ROOT / "bench/results/hf-costs.json"),
                    help="the kernel cost table the budget rows' planner reads (calibrated first, per model and precision)")
    ap.add_argument("--plot", default=str(ROOT / "docs/results/hf.png"))
    ap.add_argument("--sweep", action="store_true",
                    help="instead: the context sweep, the longest context each side trains under each RSS cap")
    ap.add_argument("--contexts", default="1024,2048,4096,8192",
                    help="the sweep's contexts (remat's trainers: train-<model> at 1024, train-<model>-t<T>)")
    ap.add_argument("--caps", default="4,8", help="the sweep's RSS caps in GiB")
    ap.add_argument("--sweep-timeout", type=float, default=1800, help="seconds a sweep process may run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--precision", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return hf_worker(args)
    models, precisions = args.models.split(","), args.precisions.split(",")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    if args.steps < 1 or not set(models) <= set(MODELS) or not set(precisions) <= {"fp32", "bf16"} \
            or any(not 0 < b < 100 for b in budgets):
        sys.exit("hf.py: --models from gpt2,smollm2, --precisions from fp32,bf16, --steps >= 1, budgets in (0, 100)")
    args.tokens = os.path.join(args.data_dir, "train.bin")
    if not os.path.exists(args.tokens):
        sys.exit(f"hf.py: no token file {args.tokens} (make train-gpt2 writes it)")
    args.contexts = sorted(int(c) for c in args.contexts.split(","))
    args.caps = sorted(float(c) for c in args.caps.split(","))
    if args.contexts[0] < 1 or args.caps[0] <= 0:
        sys.exit("hf.py: --contexts and --caps are positive")
    for m in models:
        for context in (args.contexts if args.sweep else [1024]):
            trainer = f"train-{m}" if context == 1024 else f"train-{m}-t{context}"
            if not os.access(ROOT / "build/bin" / trainer, os.X_OK):
                sys.exit(f"hf.py: build/bin/{trainer} is missing (cmake --build build --target {trainer})")
    print(f"CPU: {cpu_line()[0]}; {os.cpu_count()} threads")
    if args.sweep:
        return sweep_main(args, models, precisions)
    results = []
    for model in models:
        for precision in precisions:
            rows = [hf_row(args, model, precision, False), hf_row(args, model, precision, True)]
            policies = args.policies.split(",")
            for policy in policies:
                rows.append(remat_row(args, model, precision, ["--checkpoint-policy", policy], policy))
            none = next((r for r in rows if r["plan"] == "none" and "error" not in r), None)
            calibration = calibrate(args, model, precision) if budgets and none else "no none plan to size budgets"
            for b in budgets:
                if none is None or calibration:
                    rows.append({"system": "remat", "plan": f"budget {b}%", "error": f"calibration: {calibration}"})
                    continue
                size = none["planned"] - none["activations"] + none["activations"] * b // 100
                rows.append(remat_row(args, model, precision, ["--memory-budget", str(size), "--cost-table",
                                                               args.cost_table], f"budget {b}% ({size / 2**20:.0f} MiB)"))
                rows[-1]["budget"] = size
            for r in rows:
                r.update(model=model, precision=precision)
            print(table(model, precision, rows), flush=True)
            results += rows
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot: {os.path.relpath(args.plot, ROOT)}")


def sweep_main(args, models, precisions):
    print(f"Context sweep: the longest context trained under each RSS cap, at batch 1 (contexts {args.contexts}; "
          f"a process is stopped once its RSS passes {args.caps[-1]:g} GiB or after {args.sweep_timeout:g} s)")
    results = []
    for model in models:
        for precision in precisions:
            rows = context_sweep(args, model, precision)
            print(sweep_table(model, precision, rows, args), flush=True)
            results += rows
    out = pathlib.Path(args.out).with_name("hf-context.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
