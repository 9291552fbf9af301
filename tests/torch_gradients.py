#!/usr/bin/env python3
"""ctest torch_gradients: every example's and zoo model's gradients against PyTorch's, from outside remat.

  python3 tests/torch_gradients.py <work folder> <trainer>...

Each trainer takes one step (dropout 0: the masks are remat's counters) with --save-initial (the
parameters, the batch and, in its metadata, the model as written: stages of layers) and
--save-gradients. This script builds the same model from that description out of PyTorch's own
operations (F.layer_norm, F.gelu, F.scaled_dot_product_attention, F.cross_entropy, ...) and takes its
gradients by autograd in float64: nothing of remat's arithmetic is reused. Per tensor, the largest
|remat - PyTorch| over the tensor's largest |PyTorch| must stay within the limit; the worst tensor
of each run is printed.

fp32: remat's float32 kernels against float64: sums of K <= 512 products in float32 through a few
GEMMs per block, a relative error of about 2^-24 sqrt(K) L: FP32_LIMIT 2e-5 (the transformers_models
test measures PyTorch's own fp32 error instead, on models people train: 1.4e-6 to 9e-6 of a tensor's
scale at its widths).
bf16 (--bf16: activations, their gradients and GEMM operands in bf16, fp32 accumulation and master
weights): the reference rounds where remat rounds (every layer's output and the gradient flowing into
it, each GEMM's input and weight, and inside attention P before P v and dS before its products with q
and k, as PyTorch's bf16 attention does; to bf16 by round-to-nearest-even; float64 otherwise), so what
is left is the order of float32 sums and a rounding flipped by them: BF16_LIMIT 2e-2.
The GPT-2 and SmolLM2 trainers at small widths (train-gpt2-tiny, train-smol-tiny) save their
gradients by Transformers' names and layouts: the reference's are renamed, transposed (GPT-2's Conv1D)
and split (Llama's q/k/v and gate/up projections, fused in remat) to them here, independently of the
trainer's own mapping (trainer/transformers.cpp). transformers_models.py compares the same trainers
with Transformers itself.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file

FP32_LIMIT, BF16_LIMIT = 2e-5, 2e-2
torch.set_num_threads(2)


class RoundBf16(torch.autograd.Function):  # the value and the gradient through it, rounded to bf16
    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(torch.float64)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(torch.float64)


class RoundValue(torch.autograd.Function):  # the value rounded to bf16, the gradient through it not
    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(torch.float64)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundGradient(torch.autograd.Function):  # the value as it is, the gradient through it rounded to bf16
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(torch.float64)


def rotate(x, layer, T):  # rotate-half RoPE of the q and k heads of [rows, (H + 2 KV) D]
    H, KV = layer["heads"], layer["kv_heads"]
    D = layer["out"] // (H + 2 * KV)
    i = torch.arange(D // 2, dtype=torch.float64)
    f = layer["rope_theta"] ** (-2.0 * i / D)
    if "rope_llama3" in layer:  # Transformers' _compute_llama3_parameters
        s = layer["rope_llama3"]
        wavelength = 2 * np.pi / f
        original = s["original_max_position_embeddings"]
        smooth = (original / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        f = torch.where(wavelength < original / s["high_freq_factor"], f,
                        torch.where(wavelength > original / s["low_freq_factor"], f / s["factor"],
                                    (1 - smooth) * f / s["factor"] + smooth * f))
    t = (torch.arange(x.shape[0]) % T).to(torch.float64)
    angle = torch.cat([t[:, None] * f[None, :]] * 2, dim=1)
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    heads = x[:, :(H + KV) * D].reshape(x.shape[0], H + KV, D)
    half = torch.cat([-heads[..., D // 2:], heads[..., :D // 2]], dim=-1)
    return torch.cat([(heads * cos + half * sin).reshape(x.shape[0], -1), x[:, (H + KV) * D:]], dim=1)


def attention(x, layer, T, bf16):  # causal, grouped-query: [rows, (H + 2 KV) D] -> [rows, H D]
    H, KV = layer["heads"], layer["kv_heads"]
    D = layer["in"] // (H + 2 * KV)
    B = x.shape[0] // T
    q = x[:, :H * D].reshape(B, T, H, D).transpose(1, 2)
    k = x[:, H * D:(H + KV) * D].reshape(B, T, KV, D).transpose(1, 2).repeat_interleave(H // KV, dim=1)
    v = x[:, (H + KV) * D:].reshape(B, T, KV, D).transpose(1, 2).repeat_interleave(H // KV, dim=1)
    if not bf16:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # P rounded before P v, dS before its products with q and k
        scores = RoundGradient.apply(q @ k.transpose(-1, -2) / np.sqrt(D))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        out = RoundValue.apply(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)) @ v
    return out.transpose(1, 2).reshape(B * T, H * D)


def forward(model, P, inputs, labels, bf16):
    r = RoundBf16.apply if bf16 else (lambda t: t)
    T = max(model["input"]["block_size"], 1)
    x = None if model["input"]["block_size"] else r(P["inputs"])
    for s, stage in enumerate(model["stages"]):
        for b in range(stage["repeat"]):
            skips = []
            for k, layer in enumerate(stage["layers"]):
                name, kind = f"stages.{s}.blocks.{b}.layers.{k}", layer["kind"]
                if kind == "embedding":
                    x = P[name + ".token.weight"][inputs.reshape(-1)]
                    if layer["bias"]:  # a position table
                        x = x + P[name + ".position.weight"][torch.arange(x.shape[0]) % T]
                elif kind == "residual(":
                    skips.append(x)
                    continue
                elif kind == "residual sum":
                    x = x + skips.pop()
                elif kind == "linear":
                    tie = layer.get("tied_to")
                    w = P[f"stages.{tie['stage']}.blocks.0.layers.{tie['layer']}.token.weight" if tie else name + ".weight"]
                    x = F.linear(r(x), r(w), P.get(name + ".bias"))
                elif kind == "layer_norm":
                    x = F.layer_norm(x, (x.shape[1],), P[name + ".weight"], P.get(name + ".bias"), layer["eps"])
                elif kind == "rms_norm":
                    x = x * torch.rsqrt((x * x).mean(dim=1, keepdim=True) + layer["eps"]) * P[name + ".weight"]
                elif kind == "gelu":
                    x = F.gelu(x, approximate="none" if layer["exact"] else "tanh")
                elif kind == "relu":
                    x = F.relu(x)
                elif kind == "relu2":
                    x = F.relu(x) ** 2
                elif kind == "swiglu":
                    x = F.silu(x[:, :layer["out"]]) * x[:, layer["out"]:]
                elif kind == "rope":
                    x = rotate(x, layer, T)
                elif kind == "causal_self_attention":
                    x = attention(x, layer, T, bf16)
                elif kind != "dropout":  # dropout 0: the identity
                    sys.exit(f"torch_gradients.py: no PyTorch form for layer kind {kind!r} ({name})")
                x = r(x)
    return F.cross_entropy(x, labels.reshape(-1).long())


def transformers_names(model, grads, architecture):  # the reference's gradients as Transformers saves them
    out, stages = {}, model["stages"]
    embedding = "transformer.w{}e.weight" if architecture == "gpt2" else "model.embed_{}.weight"
    out[embedding.format("t" if architecture == "gpt2" else "tokens")] = grads["stages.0.blocks.0.layers.0.token.weight"]
    if "stages.0.blocks.0.layers.0.position.weight" in grads:
        out["transformer.wpe.weight"] = grads["stages.0.blocks.0.layers.0.position.weight"]
    if architecture == "gpt2":
        parts = [["ln_1"], ["attn.c_attn"], ["attn.c_proj"], ["ln_2"], ["mlp.c_fc"], ["mlp.c_proj"]]
        prefix, final = "transformer.h.{}.", "transformer.ln_f"
    else:
        parts = [["input_layernorm"], ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 ["self_attn.o_proj"], ["post_attention_layernorm"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
        prefix, final = "model.layers.{}.", "model.norm"
    for b in range(stages[1]["repeat"]):
        params = [k for k, layer in enumerate(stages[1]["layers"]) if layer["kind"] in ("layer_norm", "rms_norm", "linear")]
        for k, names in zip(params, parts):
            layer = stages[1]["layers"][k]
            for suffix in ("weight", "bias"):
                g = grads.get(f"stages.1.blocks.{b}.layers.{k}.{suffix}")
                if g is None:
                    continue
                if len(names) == 3:  # q, k, v rows of the fused projection
                    H, KV = stages[1]["layers"][k + 1]["heads"], stages[1]["layers"][k + 1]["kv_heads"]
                    D = layer["out"] // (H + 2 * KV)
                    pieces = np.split(g, [H * D, (H + KV) * D])
                elif len(names) == 2:  # gate, up
                    pieces = np.split(g, 2)
                else:
                    pieces = [g.T if architecture == "gpt2" and layer["kind"] == "linear" and suffix == "weight" else g]
                for name, piece in zip(names, pieces):
                    out[prefix.format(b) + name + "." + suffix] = piece
    last = len(stages) - 1
    out[final + ".weight"] = grads[f"stages.{last}.blocks.0.layers.0.weight"]
    if f"stages.{last}.blocks.0.layers.0.bias" in grads:
        out[final + ".bias"] = grads[f"stages.{last}.blocks.0.layers.0.bias"]
    if f"stages.{last}.blocks.0.layers.1.weight" in grads:  # an untied head
        out["lm_head.weight"] = grads[f"stages.{last}.blocks.0.layers.1.weight"]
    return out


def tokens(path, vocab, count, seed):  # llm.c's layout (scripts/bpe.py)
    ids = np.random.default_rng(seed).integers(0, vocab, count, dtype=np.uint16)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)) + ids.tobytes())


def check(trainer, work, bf16):
    name = os.path.basename(trainer) + (" --bf16" if bf16 else "")
    out = os.path.join(work, name.replace(" --", "-"))
    os.makedirs(out)
    args = [trainer, "--max-steps", "1", "--eval-samples", "0", "--sample-length", "0", "--dropout", "0",
            "--batch-size", "8", "--save-initial", os.path.join(out, "initial.safetensors"), "--save-gradients", out]
    run = subprocess.run(args + (["--bf16"] if bf16 else []) + DATA.get(os.path.basename(trainer), []),
                         capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{name}: the trainer failed (exit {run.returncode}): {run.stderr.strip()[-400:]}")
        return False
    with open(os.path.join(out, "initial.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    model = json.loads(header["__metadata__"]["remat.model"])
    initial = load_file(os.path.join(out, "initial.safetensors"))
    got = load_file(os.path.join(out, "gradients.safetensors"))
    P = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k not in ("inputs", "labels"))
         for k, v in initial.items() if k != "labels" and not (k == "inputs" and v.dtype == np.int32)}
    inputs = torch.tensor(initial["inputs"].astype(np.int64)) if initial["inputs"].dtype == np.int32 else None
    loss = forward(model, P, inputs, torch.tensor(initial["labels"]), bf16)
    loss.backward()
    limit, worst, ok = (BF16_LIMIT if bf16 else FP32_LIMIT), (0.0, ""), True
    reference = {k: t.grad.numpy() for k, t in P.items() if k != "inputs"}
    architecture = TRANSFORMERS.get(os.path.basename(trainer))
    if architecture:
        reference = transformers_names(model, reference, architecture)
    if set(got) != set(reference):
        print(f"{name}: gradients of {sorted(set(got) ^ set(reference))} on one side only")
        return False
    for k, g in got.items():
        ref = reference[k]
        error = float(np.abs(g.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
        worst = max(worst, (error, k))
        if error > limit:
            print(f"{name}: {k} differs by {error:.2e} of its largest magnitude (limit {limit:.0e})")
            ok = False
    print(f"{name}: {len(got)} gradients, worst {worst[0]:.2e} ({worst[1]}), limit {limit:.0e}; loss "
          f"{loss.item():.6f}")
    return ok


TRANSFORMERS = {"train-gpt2-tiny": "gpt2", "train-smol-tiny": "llama"}  # trainers saving Transformers' names
DATA = {}  # trainer -> its data flags (token models get a file of random tokens of their vocabulary)


def main():
    work, trainers = sys.argv[1], sys.argv[2:]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    for trainer in trainers:
        vocab = {"train-gpt-bpe": 4096, "train-zoo-gated": 11, "train-unusual": 40, "train-gpt2-tiny": 37,
                 "train-smol-tiny": 41}.get(os.path.basename(trainer))
        if vocab:
            files = [os.path.join(work, f"{os.path.basename(trainer)}-{part}.bin") for part in ("train", "val")]
            for i, path in enumerate(files):
                tokens(path, vocab, 16 * 1025, i)  # 16 windows of GPT-2 tiny's 1024
            DATA[os.path.basename(trainer)] = ["--train-file", files[0], "--validation-file", files[1]]
    results = [check(t, work, bf16) for t in trainers for bf16 in (False, True)]
    print(f"{sum(results)} of {len(results)} runs within their limits")
    sys.exit(0 if all(results) else 1)


main()
