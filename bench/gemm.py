#!/usr/bin/env python3
"""remat's CPU GEMM beside torch.matmul at every GEMM shape of the example models, in one run.

Runs build/bin/bench-gemm --json (remat's host GEMM: sequential MKL in row bands on Halide's threads, what the fp32
kernels call, and the Halide schedule it replaced at the forward shapes), then times
torch.matmul on the same shapes, transposes and thread count, both alternately for --rounds
rounds, and prints each one's best round per shape with the ratio remat / torch (goal: >= 0.90
at every shape). Writes bench/results/gemm.json.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_line():
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    shown = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(shown)}"


def torch_ms(torch, s, reps):
    a = torch.rand(s["k"], s["m"]).t() if s["trans_a"] else torch.rand(s["m"], s["k"])
    b = torch.rand(s["n"], s["k"]).t() if s["trans_b"] else torch.rand(s["k"], s["n"])
    out = torch.empty(s["m"], s["n"])
    torch.matmul(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30, help="timed runs per shape (median)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both systems (best round per shape)")
    ap.add_argument("--bench-gemm", default=str(ROOT / "build/bin/bench-gemm"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemm.json"))
    args = ap.parse_args()
    if args.reps < 1:
        sys.exit("gemm.py: --reps must be >= 1")
    try:
        import torch
    except ImportError:
        sys.exit("gemm.py: PyTorch is not installed in this Python (make bench-cpu installs it)")
    if args.rounds < 1:
        sys.exit("gemm.py: --rounds must be >= 1")
    # remat and torch alternately, `rounds` times; each keeps its best round per shape (the
    # machine's speed drifts between the rounds more than within one)
    remat, torch_best = None, {}
    for _ in range(args.rounds):
        try:
            run = subprocess.run([args.bench_gemm, str(args.reps), "--json"], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"gemm.py: {args.bench_gemm} failed: {getattr(e, 'stderr', '') or e}")
        this = json.loads(run.stdout.strip().splitlines()[-1])
        if remat is None:
            remat = this
        else:
            for best, s in zip(remat["shapes"], this["shapes"]):
                best["remat_gflops"] = max(best["remat_gflops"], s["remat_gflops"])
                best["remat_ms"] = min(best["remat_ms"], s["remat_ms"])
                if s["halide_ms"]:
                    best["halide_ms"] = min(best["halide_ms"], s["halide_ms"])
        torch.set_num_threads(remat["threads"])
        for s in remat["shapes"]:
            t = torch_ms(torch, s, args.reps)
            torch_best[s["shape"]] = min(torch_best.get(s["shape"], t), t)
    print(f"CPU: {cpu_line()}")
    print(f"fp32, {remat['threads']} threads, median of {args.reps}, best of {args.rounds} alternating rounds; remat: "
          f"sequential MKL in row bands on Halide's threads; torch {torch.__version__} matmul; Halide schedule pinned "
          f"{remat['halide_target']}")
    print(f"{'shape':<20} {'m':>5} {'n':>5} {'k':>5} {'remat GF/s':>10} {'torch GF/s':>10} {'remat/torch':>11} {'halide GF/s':>11}")
    rows, worst = [], None
    for s in remat["shapes"]:
        t = torch_best[s["shape"]]
        gflop = 2.0 * s["m"] * s["n"] * s["k"] / 1e9
        torch_gflops = gflop / (t / 1e3)
        ratio = s["remat_gflops"] / torch_gflops
        worst = ratio if worst is None else min(worst, ratio)
        halide = f"{gflop / (s['halide_ms'] / 1e3):.1f}" if s["halide_ms"] else "-"
        print(f"{s['shape']:<20} {s['m']:>5} {s['n']:>5} {s['k']:>5} {s['remat_gflops']:>10.1f} {torch_gflops:>10.1f} "
              f"{ratio:>11.2f} {halide:>11}")
        rows.append(dict(s, torch_ms=t, torch_gflops=torch_gflops, remat_over_torch=ratio))
    ratios = sorted(r["remat_over_torch"] for r in rows)
    print(f"remat/torch: worst {worst:.2f}, median {ratios[len(ratios) // 2]:.2f} "
          f"(goal: >= 0.90 at every shape, {'met' if worst >= 0.9 else 'not met'})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"cpu": cpu_line(), "threads": remat["threads"], "torch": torch.__version__,
                               "shapes": rows, "worst_remat_over_torch": worst}, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    main()
