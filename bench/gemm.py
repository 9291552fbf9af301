#!/usr/bin/env python3
"""remat's CPU GEMM beside torch.matmul at every GEMM shape of the example models and of the GPT-2 and SmolLM2 blocks, fp32 and bf16, in one run.

Runs build/bin/bench-gemm --json (remat's host GEMM: sequential MKL in row bands on Halide's threads, what the
kernels call, with fp32 operands and with bf16 operands and fp32 out), then times torch.matmul on the same shapes, transposes and thread count in fp32 and in bf16
(bf16 operands, bf16 out as torch gives), both systems alternately for --rounds rounds, and prints each one's best
round per shape: GF/s of remat and torch in fp32 with the ratio remat / torch (goal: >= 0.90 at every shape), GF/s of
remat and torch in bf16, remat's bf16 / fp32 ratio and remat / torch in bf16. On a CPU with neither AVX512_BF16 nor
AMX-BF16, MKL and PyTorch convert bf16 to fp32, so bf16 cannot beat fp32 there (the output says so). Writes
bench/results/gemm.json.
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
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(shown)}", bool(flags & {"avx512_bf16", "amx_bf16"})


def torch_ms(torch, s, reps, dtype):
    """torch.matmul's median ms at shape s, operands and out of dtype."""
    a = torch.rand(s["k"], s["m"], dtype=dtype).t() if s["trans_a"] else torch.rand(s["m"], s["k"], dtype=dtype)
    b = torch.rand(s["n"], s["k"], dtype=dtype).t() if s["trans_b"] else torch.rand(s["k"], s["n"], dtype=dtype)
    out = torch.empty(s["m"], s["n"], dtype=dtype)
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
    remat, torch_best, torch_bf16_best = None, {}, {}
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
                best["remat_bf16_gflops"] = max(best["remat_bf16_gflops"], s["remat_bf16_gflops"])
                best["remat_bf16_ms"] = min(best["remat_bf16_ms"], s["remat_bf16_ms"])
        torch.set_num_threads(remat["threads"])
        for s in remat["shapes"]:
            for dtype, best in ((torch.float32, torch_best), (torch.bfloat16, torch_bf16_best)):
                t = torch_ms(torch, s, args.reps, dtype)
                best[s["shape"]] = min(best.get(s["shape"], t), t)
    cpu, bf16_native = cpu_line()
    print(f"CPU: {cpu}")
    if not bf16_native:
        print("note: this CPU has neither avx512_bf16 nor amx_bf16, so MKL and PyTorch convert bf16 operands to fp32: "
              "bf16 cannot be faster than fp32 here")
    print(f"{remat['threads']} threads, median of {args.reps}, best of {args.rounds} alternating rounds; remat: "
          f"row bands on Halide's threads (fp32: MKL's sequential sgemm; bf16: {remat['bf16_kernel']}, fp32 out); torch "
          f"{torch.__version__} matmul (fp32; bf16 with bf16 out)")
    print(f"{'shape':<20} {'m':>5} {'n':>5} {'k':>5} {'remat GF/s':>10} {'torch GF/s':>10} {'remat/torch':>11} "
          f"{'remat bf16 GF/s':>15} {'torch bf16 GF/s':>15} {'bf16/fp32 (remat)':>17} {'remat/torch bf16':>16}")
    rows, worst = [], None
    for s in remat["shapes"]:
        t, t16 = torch_best[s["shape"]], torch_bf16_best[s["shape"]]
        gflop = 2.0 * s["m"] * s["n"] * s["k"] / 1e9
        torch_gflops, torch_bf16_gflops = gflop / (t / 1e3), gflop / (t16 / 1e3)
        ratio = s["remat_gflops"] / torch_gflops
        bf16_ratio = s["remat_bf16_gflops"] / torch_bf16_gflops
        bf16_over_fp32 = s["remat_bf16_gflops"] / s["remat_gflops"]
        worst = ratio if worst is None else min(worst, ratio)
        print(f"{s['shape']:<20} {s['m']:>5} {s['n']:>5} {s['k']:>5} {s['remat_gflops']:>10.1f} {torch_gflops:>10.1f} "
              f"{ratio:>11.2f} {s['remat_bf16_gflops']:>15.1f} {torch_bf16_gflops:>15.1f} {bf16_over_fp32:>17.2f} "
              f"{bf16_ratio:>16.2f}")
        rows.append(dict(s, torch_ms=t, torch_gflops=torch_gflops, remat_over_torch=ratio, torch_bf16_ms=t16,
                         torch_bf16_gflops=torch_bf16_gflops, remat_bf16_over_torch_bf16=bf16_ratio,
                         remat_bf16_over_fp32=bf16_over_fp32))

    def spread(key):
        v = sorted(r[key] for r in rows)
        return f"worst {v[0]:.2f}, median {v[len(v) // 2]:.2f}"

    print(f"remat/torch (fp32): {spread('remat_over_torch')} "
          f"(goal: >= 0.90 at every shape, {'met' if worst >= 0.9 else 'not met'})")
    print(f"remat/torch (bf16): {spread('remat_bf16_over_torch_bf16')}; bf16/fp32 (remat): "
          f"{spread('remat_bf16_over_fp32')}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"cpu": cpu, "bf16_native": bf16_native, "threads": remat["threads"],
                               "torch": torch.__version__, "shapes": rows, "worst_remat_over_torch": worst}, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    main()
