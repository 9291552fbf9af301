#!/usr/bin/env python3
"""The GPT, Llama and MLP examples in PyTorch with remat's math, trained on the CPU from remat's weights.

Loads the parameters and the first batch that `train-<model> --save-initial FILE` wrote
(the trainer's hyper-parameters come from the file's metadata; the parameters under the names and
layouts of remat's model.safetensors, which are the state_dict names of the module trees here:
stages.<s>.blocks.<b>.layers.<l>.<param>, l counting remat's parameter-free layers too, which are
placeholders here; a linear's weight [out, in] as nn.Linear's), checks that the first step's loss
equals remat's (--expect-loss, from a dropout-0 remat run) before anything else counts, then
trains --steps steps on that batch and prints one JSON line: per-step times, first and last loss.

The math is remat's (generators/kinds/<kind>/algorithm.h). GPT: LayerNorm eps 1e-5, tanh GELU,
causal attention scaled by 1/sqrt(D) (F.scaled_dot_product_attention), token + position embedding,
dropout after the embedding, on the attention probabilities and at the end of both residual
branches. Llama: token embedding only; RMSNorm x / sqrt(mean x^2 + 1e-6) * weight; bias-free
linears; qkv columns [q (4 heads) | k (2 heads) | v (2 heads)]; RoPE base 10000 on q and k in the
rotate-half form (feature e < D/2 turns with e + D/2, as HF's Llama and GPT-NeoX, not interleaved
pairs); grouped-query attention, query head h reading key / value head h // 2 (repeat_interleave);
SwiGLU silu(a) * b of the up-projection's halves [a | b]; dropout only on the attention
probabilities. All: final norm, linear head, loss = mean cross-entropy over all rows, AdamW
(decoupled weight decay on linear weights only) with remat's warm-up + cosine learning-rate
schedule. Policies as PyTorch users write them: none; full = torch.utils.checkpoint per block;
every_n_layers=N = blocks 0, N, 2N... (as HF Transformers); sqrt_n = checkpoint_sequential with
ceil(sqrt(L)) segments; selective = selective activation checkpointing saving matmul outputs and
recomputing the rest.
Errors (mismatching loss, bad input, a failing torch.compile) end with one line on stderr and a
non-zero exit: 1 for a loss mismatch, 2 for bad input, 3 when torch.compile fails.
"""
import argparse
import functools
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

PROG = "torch_cpu.py"
GPT = dict(V=128, T=64, L=6, H=4, C=128)             # examples/gpt/gpt.cppm
GPT_BPE = dict(V=4096, T=64, L=4, H=4, C=128)        # examples/gpt_bpe/gpt_bpe.cppm
LLAMA = dict(V=128, T=64, L=6, H=4, KV=2, C=128, Hd=352)  # examples/llama/llama.cppm
MLP = dict(W=28 * 28, C=256, Hd=512, L=16, K=10)     # examples/mlp/mlp.cppm


def fail(message, code=2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(code)


class Free(nn.Identity):
    """A parameter-free remat layer (a residual marker, RoPE, attention, GELU, SwiGLU, dropout, the
    loss): it holds its layer's place in `layers`, so that the others keep remat's index l; the
    block's forward does its math."""
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def extra_repr(self):
        return self.kind


class Block(nn.Module):
    """One remat block: `layers` in remat's layer order, the l of stages.<s>.blocks.<b>.layers.<l>."""
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Stage(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


class Embedding(nn.Module):  # remat's embedding layer: token + position (token_embedding: token only)
    def __init__(self, V, T, C, positions=True):
        super().__init__()
        self.token, self.position = nn.Embedding(V, C), nn.Embedding(T, C) if positions else None

    def forward(self, idx):
        x = self.token(idx)
        return x if self.position is None else x + self.position(torch.arange(idx.shape[1]))


def layer(l):  # a block's layer l under a readable name (not a second module: no second state_dict name)
    return property(lambda self: self.layers[l])


class GPTBlock(Block):
    def __init__(self, C, H, p):
        super().__init__(Free("residual("), nn.LayerNorm(C, eps=1e-5), nn.Linear(C, 3 * C),
                         Free("causal_self_attention"), nn.Linear(C, C), Free("dropout"), Free(")residual"),
                         Free("residual("), nn.LayerNorm(C, eps=1e-5), nn.Linear(C, 4 * C), Free("gelu"),
                         nn.Linear(4 * C, C), Free("dropout"), Free(")residual"))
        self.H, self.p = H, p

    ln1, qkv, proj, ln2, fc, fc2 = (layer(l) for l in (1, 2, 4, 8, 9, 11))

    def forward(self, x):
        B, T, C = x.shape
        p = self.p if self.training else 0.0
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(B, T, C)), p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), p, self.training)


@functools.cache
def rope_tables(T, D):  # cos, sin of t 10000^(-2i/D) for i < D/2, each repeated for the pair's two halves: [T, D]
    angle = torch.outer(torch.arange(T, dtype=torch.float64), 10000.0 ** (-2 * torch.arange(D // 2) / D))
    return torch.cat([angle.cos(), angle.cos()], 1).float(), torch.cat([angle.sin(), angle.sin()], 1).float()


def rope(x, cos, sin):  # rotate-half: y(e) = x(e) cos - x(e + D/2) sin, y(e + D/2) = x(e + D/2) cos + x(e) sin
    lo, hi = x.float().chunk(2, dim=-1)  # in fp32, rounded to x's type (bf16 under autocast) as remat's
    return (x.float() * cos + torch.cat([-hi, lo], dim=-1) * sin).to(x.dtype)


class LlamaBlock(Block):
    def __init__(self, C, H, KV, Hd, p):
        D = C // H
        super().__init__(Free("residual("), nn.RMSNorm(C, eps=1e-6), nn.Linear(C, (H + 2 * KV) * D, bias=False),
                         Free("rope"), Free("causal_self_attention"), nn.Linear(C, C, bias=False), Free(")residual"),
                         Free("residual("), nn.RMSNorm(C, eps=1e-6), nn.Linear(C, 2 * Hd, bias=False), Free("swiglu"),
                         nn.Linear(Hd, C, bias=False), Free(")residual"))
        self.H, self.KV, self.p = H, KV, p

    norm1, qkv, proj, norm2, up, down = (layer(l) for l in (1, 2, 5, 8, 9, 11))

    def forward(self, x):
        B, T, C = x.shape
        H, KV, D = self.H, self.KV, C // self.H
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in self.qkv(self.norm1(x)).split([C, KV * D, KV * D], 2))
        cos, sin = rope_tables(T, D)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)  # query head h: kv h // (H/KV)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=2)
        return x + self.down(F.silu(gate) * up)


class MLPBlock(Block):
    def __init__(self, C, Hd):
        super().__init__(Free("residual("), nn.LayerNorm(C, eps=1e-5), nn.Linear(C, Hd), Free("gelu"),
                         nn.Linear(Hd, C), Free(")residual"))

    ln, fc, fc2 = (layer(l) for l in (1, 2, 4))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc(self.ln(x)), approximate="tanh"))


class RematModel(nn.Module):
    """A remat example as a PyTorch module tree whose state_dict names are those of remat's
    model.safetensors: `stages` (the model's stages), each with `blocks`, each with `layers`.
    Stage 1 is the repeated blocks (which the policies checkpoint); stages 0 and 2 one block each."""
    def __init__(self, stem, blocks, head):
        super().__init__()
        self.stages = nn.ModuleList([Stage([Block(*stem)]), Stage(blocks), Stage([Block(*head)])])

    @property
    def blocks(self):
        return self.stages[1].blocks

    def head_loss(self, x, labels):  # the final norm, linear, mean cross-entropy over all rows
        ln_f, head = self.stages[2].blocks[0].layers[:2]
        logits = head(ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).long())

    def forward(self, inputs, labels, policy="none"):  # the loss
        return self.head_loss(run_blocks(self.blocks, self.stem(inputs), policy), labels)


class GPTModel(RematModel):
    def __init__(self, p=0.0, dims=GPT):
        V, T, L, H, C = (dims[k] for k in "VTLHC")
        super().__init__([Embedding(V, T, C), Free("dropout")], [GPTBlock(C, H, p) for _ in range(L)],
                         [nn.LayerNorm(C, eps=1e-5), nn.Linear(C, V), Free("softmax_cross_entropy")])
        self.p = p

    def stem(self, idx):
        x = self.stages[0].blocks[0].layers[0](idx)
        return F.dropout(x, self.p if self.training else 0.0, self.training)


class LlamaModel(RematModel):
    def __init__(self, p=0.0):  # p: attention dropout, its only dropout
        V, T, L, H, KV, C, Hd = (LLAMA[k] for k in ("V", "T", "L", "H", "KV", "C", "Hd"))
        super().__init__([Embedding(V, T, C, positions=False)], [LlamaBlock(C, H, KV, Hd, p) for _ in range(L)],
                         [nn.RMSNorm(C, eps=1e-6), nn.Linear(C, V, bias=False), Free("softmax_cross_entropy")])

    def stem(self, idx):
        return self.stages[0].blocks[0].layers[0](idx)


class MLPModel(RematModel):
    def __init__(self, p=0.0):  # no dropout layers
        W, C, Hd, L, K = (MLP[k] for k in ("W", "C", "Hd", "L", "K"))
        super().__init__([nn.Linear(W, C)], [MLPBlock(C, Hd) for _ in range(L)],
                         [nn.LayerNorm(C, eps=1e-5), nn.Linear(C, K), Free("softmax_cross_entropy")])

    def stem(self, x):
        return self.stages[0].blocks[0].layers[0](x)


MODELS = {"gpt": GPTModel, "gpt_bpe": lambda p=0.0: GPTModel(p, GPT_BPE), "llama": LlamaModel, "mlp": MLPModel}
BATCH = ("inputs", "labels")  # what --save-initial writes beside the parameters


def load_params(model, f, what):
    """remat's tensor names (stages.<s>.blocks.<b>.layers.<l>.<param>; a linear weight [out, in] as
    nn.Linear's) are the model's state_dict names: load_state_dict(strict=True) from the safetensors
    file f (safe_open), after listing every missing, unexpected and wrong-shaped tensor in one error."""
    state = {k: f.get_tensor(k) for k in f.keys() if k not in BATCH}
    mine = model.state_dict()
    problems = ([f"{k} missing" for k in sorted(mine.keys() - state.keys())] +
                [f"{k} unexpected" for k in sorted(state.keys() - mine.keys())] +
                [f"{k} has shape {list(state[k].shape)}, not {list(mine[k].shape)}"
                 for k in sorted(mine.keys() & state.keys()) if state[k].shape != mine[k].shape])
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        fail(f"{what}: {len(problems)} tensors do not fit the {type(model).__name__}: {'; '.join(problems[:8])}{more}")
    model.load_state_dict(state, strict=True)


def selective_policy(ctx, op, *args, **kwargs):  # save GEMM outputs, recompute everything else
    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.linear.default}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def run_blocks(blocks, x, policy):
    if policy == "sqrt_n":
        return checkpoint_sequential(blocks, math.ceil(math.sqrt(len(blocks))), x, use_reentrant=False)
    every = 1 if policy == "full" else int(policy.split("=")[1]) if policy.startswith("every_n_layers=") else 0
    for i, blk in enumerate(blocks):
        if policy == "selective":
            x = checkpoint(blk, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, selective_policy))
        elif every and i % every == 0:
            x = checkpoint(blk, x, use_reentrant=False)
        else:
            x = blk(x)
    return x


def learning_rate(meta, step, max_steps):  # trainer/.cpp; step counts from 1
    lr, warmup = float(meta["learning_rate"]), int(meta["warmup_steps"])
    if step <= warmup:
        return lr * step / max(1, warmup)
    if meta["lr_scheduler_type"] == "constant":
        return lr
    progress = (step - warmup - 1) / max(1, max_steps - warmup)
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def status_bytes(field):  # VmRSS, VmHWM
    with open("/proc/self/status") as s:
        return next(int(l.split()[1]) * 1024 for l in s if l.startswith(field + ":"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True, help="the safetensors file of train-<model> --save-initial")
    ap.add_argument("--policy", default="none", help="none | full | selective | every_n_layers=N | sqrt_n")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout while timing (the loss check uses 0)")
    ap.add_argument("--expect-loss", type=float, required=True, help="remat's first-step loss at dropout 0")
    ap.add_argument("--bf16", action="store_true", help="torch.autocast('cpu', dtype=torch.bfloat16)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step (forward, backward, AdamW)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args()
    if a.steps < 1 or a.threads < 1 or not 0 <= a.dropout < 1:
        fail("--steps and --threads must be >= 1 and --dropout in [0, 1)")
    if not re.fullmatch(r"none|full|selective|sqrt_n|every_n_layers=[1-9]\d*", a.policy):
        fail(f"--policy {a.policy}: not one of none, full, selective, every_n_layers=N (N >= 1), sqrt_n")
    torch.set_num_threads(a.threads)
    rss_after_import = status_bytes("VmRSS")
    try:
        f = safe_open(a.init, "pt")
        meta = f.metadata() or {}
        kind = meta["model"]
    except Exception as e:  # a missing, truncated or foreign file
        fail(f"--init {a.init}: not a remat --save-initial file ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if kind not in MODELS:
        fail(f"--init {a.init}: model {kind}; this script knows {', '.join(MODELS)}")
    if a.dropout > 0 and kind == "mlp":
        fail("--dropout: the mlp model has no dropout layers")
    torch.manual_seed(int(meta.get("seed", 0)))
    model = MODELS[kind](a.dropout)
    load_params(model, f, f"--init {a.init}")
    inputs, labels = f.get_tensor("inputs"), f.get_tensor("labels")

    def loss_of(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            return model(x, y, a.policy)

    decayed = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]  # remat: linear weights only
    plain = [p for p in model.parameters() if all(p is not d for d in decayed)]
    lr = torch.tensor(0.0)  # a tensor, so that a compiled step is not recompiled when it changes
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": float(meta["weight_decay"])},
                             {"params": plain, "weight_decay": 0.0}], lr=lr,
                            betas=(float(meta["beta1"]), float(meta["beta2"])), eps=float(meta["eps"]), fused=True)

    def train_step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step_fn = torch.compile(train_step) if a.compile else train_step
    tolerance = 5e-3 if a.bf16 else 1e-4  # bf16: activations and GEMM operands rounded differently

    def check(loss):
        if not abs(loss - a.expect_loss) <= tolerance:
            fail(f"first-step loss {loss:.7f} differs from remat's {a.expect_loss:.7f} by "
                 f"{abs(loss - a.expect_loss):.2e} (limit {tolerance:g}); the models are not the same", 1)

    if a.dropout > 0:  # the check needs remat's dropout-0 loss: one forward without dropout first
        model.eval()
        with torch.no_grad():
            check(loss_of(inputs, labels).item())
        model.train()
    step_ms, losses = [], []
    for step in range(1, a.steps + 1):
        lr.fill_(learning_rate(meta, step, a.steps))
        t0 = time.perf_counter()
        try:
            loss = step_fn(inputs, labels).item()
        except Exception as e:
            if not a.compile:
                raise
            fail(f"torch.compile failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}", 3)
        step_ms.append((time.perf_counter() - t0) * 1000)
        losses.append(loss)
        if step == 1 and a.dropout == 0:
            check(loss)
    print(json.dumps({"system": "torch.compile" if a.compile else "pytorch", "model": kind, "policy": a.policy,
                      "precision": "bf16" if a.bf16 else "fp32", "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "steps": a.steps, "dropout": a.dropout,
                      "batch_size": inputs.shape[0], "loss_first": losses[0], "loss_last": losses[-1],
                      "step_ms": step_ms, "rss_after_import_bytes": rss_after_import,
                      "vm_hwm_bytes": status_bytes("VmHWM")}))


if __name__ == "__main__":
    main()
