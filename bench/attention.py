#!/usr/bin/env python3
"""remat's CPU attention beside PyTorch's scaled_dot_product_attention, forward + backward, in one run.

Runs build/bin/bench-attention (remat's attention: what the CPU kernels call, GPT-2's 12 heads and SmolLM2's 9 / 3
heads of 64, batch 1, causal) and times torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
forward and backward on the same shapes, threads and precision (fp32; bf16 tensors for torch, bf16 storage with
fp32 arithmetic for remat), both alternately for --rounds rounds, best round each. Prints the CPU and one row per
shape: ms of each, and torch / remat (goal: >= 1.0 everywhere). Writes bench/results/attention.json.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from gemm import cpu_line  # noqa: E402


def torch_ms(torch, T, H, KV, D, dtype, reps):
    """Median ms of SDPA forward and of its backward (grouped heads expanded as Transformers does)."""
    F = torch.nn.functional
    q = torch.randn(1, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(1, KV, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(1, KV, T, D, dtype=dtype, requires_grad=True)
    dout = torch.randn(1, H, T, D, dtype=dtype)

    def forward():
        kk = k.repeat_interleave(H // KV, dim=1) if KV != H else k
        vv = v.repeat_interleave(H // KV, dim=1) if KV != H else v
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    fwd, bwd = [], []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        q.grad = k.grad = v.grad = None
        if r:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lengths", nargs="*", type=int, default=[1024, 4096, 8192], help="context lengths")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per shape (median)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both systems (best round each)")
    ap.add_argument("--bench-attention", default=str(ROOT / "build/bin/bench-attention"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/attention.json"))
    args = ap.parse_args()
    if args.reps < 1 or args.rounds < 1 or min(args.lengths) < 1:
        sys.exit("attention.py: --reps, --rounds and the lengths must be >= 1")
    try:
        import torch
    except ImportError:
        sys.exit("attention.py: PyTorch is missing (make bench-py-pkgs installs it)")
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    best = {}
    for _ in range(args.rounds):
        run = subprocess.run([args.bench_attention, "--reps", str(args.reps), *map(str, args.lengths)],
                             capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"attention.py: {args.bench_attention} failed: {run.stderr.strip()}")
        for r in json.loads(run.stdout)["rows"]:
            key = (r["T"], r["H"], r["KV"], r["precision"])
            dtype = torch.bfloat16 if r["precision"] == "bf16" else torch.float32
            tf, tb = torch_ms(torch, r["T"], r["H"], r["KV"], r["D"], dtype, args.reps)
            remat_ms, torch_total = r["forward_ms"] + r["backward_ms"], tf + tb
            old = best.get(key)
            best[key] = {**r, "remat_ms": min(remat_ms, old["remat_ms"]) if old else remat_ms,
                         "torch_forward_ms": tf, "torch_backward_ms": tb,
                         "torch_ms": min(torch_total, old["torch_ms"]) if old else torch_total}
    print(f"CPU: {cpu_line()[0]}; {threads} threads; PyTorch {torch.__version__}")
    print("| model heads | T | precision | remat fwd+bwd ms | SDPA fwd+bwd ms | SDPA / remat |")
    print("|---|---|---|---|---|---|")
    for (T, H, KV, prec), r in sorted(best.items()):
        name = "GPT-2 12/12" if KV == H else f"SmolLM2 {H}/{KV}"
        print(f"| {name} | {T} | {prec} | {r['remat_ms']:.1f} | {r['torch_ms']:.1f} | {r['torch_ms'] / r['remat_ms']:.2f} |")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(list(best.values()), indent=1) + "\n")


if __name__ == "__main__":
    main()
