#!/usr/bin/env python3
"""The model of bench/gpt2s.cppm in PyTorch, timed like bench-gpu, and the two side by side.

GPT-2-small shape (12 pre-LayerNorm blocks, 768 wide, 12 heads, T=1024, vocab 50304, fused q/k/v,
tanh GELU, dropout 0), AdamW, in float32 without TF32 and in bf16 autocast (fp32 master weights,
as remat's --bf16). Policies: no
checkpointing, and torch.utils.checkpoint per block (use_reentrant=False) on every block (full)
and on every second block (every_n_layers=2). Peak memory is torch.cuda.max_memory_allocated.
With --remat FILE (bench-gpu --out FILE) it prints one table with both and the ratios against
PyTorch at remat's precision; remat's error or skipped rows, and a missing or empty FILE, are
reported and the PyTorch side is printed anyway. A PyTorch run that fails (out of memory, say)
gives an error row.
Without a CUDA device it prints [SKIP] and exits 0.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

V, T, L, H, C = 50304, 1024, 12, 12, 768


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, every):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(C), nn.Linear(C, V)
        self.every = every  # 0: no checkpointing; n: blocks 0, n, 2n... checkpointed

    def forward(self, idx, labels):
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for i, blk in enumerate(self.blocks):
            if self.every and i % self.every == 0:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return F.cross_entropy(self.head(self.ln_f(x)).view(-1, V), labels.view(-1))


def run(policy, every, batch, steps, dtype):
    torch.manual_seed(1)
    model = GPT(every).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    idx = torch.randint(V, (batch, T), device="cuda")
    labels = torch.randint(V, (batch, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(idx, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    rate = batch * T * steps / (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return {"policy": policy, "dtype": dtype, "tokens_per_s": rate, "peak_bytes": peak}


def load_remat(path):
    """bench-gpu's rows by policy and its precision; ({}, "bf16") when there are none."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"remat: no results from {path} ({e})")
        return {}, "bf16"
    if data.get("skipped"):
        print(f"remat: skipped ({data['skipped']})")
    for r in data.get("rows", []):
        if "error" in r or "skipped" in r:
            print(f"remat {r['policy']}: {'error: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']}")
    rows = {r["policy"]: r for r in data.get("rows", []) if "tokens_per_s" in r}
    return rows, data.get("precision", "bf16")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--remat", help="bench-gpu --out FILE, to print side by side")
    ap.add_argument("--out", help="write the PyTorch rows as JSON here")
    args = ap.parse_args()
    remat, precision = load_remat(args.remat) if args.remat else ({}, "bf16")
    if not torch.cuda.is_available():
        print("[SKIP] no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for d in ("fp32", "bf16"):
        for p, e in (("none", 0), ("full", 1), ("every_n_layers=2", 2)):
            try:
                rows.append(run(p, e, args.batch_size, args.steps, d))
            except Exception as ex:  # out of memory, say: the other runs still go
                print(f"torch {d} {p}: error: {ex}".splitlines()[0], flush=True)
                rows.append({"policy": p, "dtype": d, "error": str(ex)})
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"batch_size": args.batch_size, "steps": args.steps, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}, batch {args.batch_size} x {T} tokens, "
          f"{args.steps} timed steps")
    same = {r["policy"]: r for r in rows if r["dtype"] == precision and "error" not in r}
    other = {r["policy"]: r for r in rows if r["dtype"] != precision and "error" not in r}
    other_name = "fp32" if precision == "bf16" else "bf16"
    print(f"remat {precision} against PyTorch {precision} (PyTorch {other_name} for reference)")
    print(f"{'policy':<18} {'remat tok/s':>12} {'torch tok/s':>12} {'remat/torch':>12} {'torch ' + other_name:>11} "
          f"{'remat peak MiB':>15} {'torch peak MiB':>15} {'peak ratio':>11}")
    for policy in ("none", "full", "every_n_layers=2", "selective", "full+offload"):
        r, t, o = remat.get(policy), same.get(policy), other.get(policy)
        cell = lambda v, fmt: format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
        rr = r["tokens_per_s"] if r else None
        tr = t["tokens_per_s"] if t else None
        rp = r["measured_peak_bytes"] / 2**20 if r else None
        tp = t["peak_bytes"] / 2**20 if t else None
        print(f"{policy:<18} {cell(rr, '12.0f')} {cell(tr, '12.0f')} {cell(rr / tr if rr and tr else None, '12.3f')} "
              f"{cell(o['tokens_per_s'] if o else None, '11.0f')} {cell(rp, '15.0f')} {cell(tp, '15.0f')} "
              f"{cell(rp / tp if rp and tp else None, '11.3f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
