#!/usr/bin/env python3
"""ctest torch_roundtrip: a model's weights go from remat to PyTorch and back (issue 25, item 2).

  .venv/bin/python tests/torch_roundtrip.py <train-mlp> <train-gpt> <scratch folder>

For the MLP and the GPT example, each remat run at --dropout 0 (the losses are then functions of
the weights and the batch alone):
  a. remat trains 3 steps and writes DIR/snapshot-3/ (--output-dir DIR --save-steps 3).
  b. The `safetensors` package reads its model.safetensors: metadata format "pt" and the model's
     name, every tensor F32 with its metadata CRC-32 (crc32.<name>, 8 hex digits) equal to
     zlib.crc32 of its bytes; the PyTorch copy of the example (bench/torch_cpu.py's GPTModel or
     MLPModel, whose state_dict names are remat's) loads it with load_state_dict(strict=True).
  c. remat starts from that file (--init-from, 1 step, --save-initial X): X's parameters equal the
     snapshot's bit for bit, and remat's first-step loss equals PyTorch's on X's batch.
  d. Weights written by PyTorch: the PyTorch model takes one SGD step (lr 0.1) on that batch, then
     every tensor is scaled elementwise by 1 + 0.01 N(0, 1) (seed 0, so that every value changes,
     unused embedding rows too), and safetensors.torch.save_file writes its state_dict (metadata
     format "pt" only: no CRC-32s, no model name, as a file made elsewhere). remat --init-from that
     file --save-initial Y: Y's parameters equal PyTorch's bit for bit, and remat's first-step loss
     equals PyTorch's on Y's batch (the perturbation must move the loss by more than 100x the limit,
     or this would not tell the two weight sets apart).
  e. A file with one tensor of the wrong shape (a linear weight transposed: remat's internal
     [in, out] layout) and one tensor missing is refused: exit 2, one line on stderr that names both,
     and no training step (no JSON summary).

Tolerance: |remat - PyTorch| <= 1e-5 on the mean cross-entropy (absolute; the losses are 1.7 to 5).
Both sides compute in fp32 and differ only in the order of their sums (remat's Halide kernels and
MKL GEMMs against PyTorch's ATen kernels: GEMMs of up to 784 terms, LayerNorm and softmax
reductions through 16 blocks); measured at 5e-8 to 5e-7, so the limit leaves a factor of 20. It is
tighter than bench/torch_cpu.py's 1e-4 because this test is about equality, not speed: an exact GELU
in place of remat's tanh one moves the MLP's loss by 2e-5 and passes at 1e-4, not here. A weight in
the wrong place is far outside: the GPT's attention projections transposed move its loss by 0.37,
two blocks' weights swapped by 1.5e-2 to 2e-2, one LayerNorm weight scaled by 1% by 3e-4 to 6e-4.

Prints one line per check with its figures; exits 1 with a line saying what failed.
"""
import json
import os
import shutil
import subprocess
import sys
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import torch_cpu  # noqa: E402  (the PyTorch copies of the examples)

TOLERANCE = 1e-5
STEPS = 3
checks = 0


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        sys.exit(f"torch_roundtrip: FAILED: {what}")


def remat(binary, *args, expect=0):
    cmd = [binary, "--eval-samples", "0", "--dropout", "0", "--json", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    check(p.returncode == expect, f"{' '.join(cmd)} exited with {p.returncode}, not {expect}:\n{p.stderr[-3000:]}")
    return p


def summary(p):
    return json.loads(p.stdout.strip().splitlines()[-1])


def params_of(path):
    """The parameters of a remat-written safetensors file (its batch left out), with its metadata."""
    f = safe_open(path, "pt")
    return {k: f.get_tensor(k) for k in f.keys() if k not in torch_cpu.BATCH}, f.metadata() or {}


def bit_identical(a, b):
    """The names whose tensors differ in dtype, shape or any bit (float32 compared as int32)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or not torch.equal(a[k].contiguous().view(torch.int32), b[k].contiguous().view(torch.int32)))


def pytorch_loss(model, f):
    model.eval()
    with torch.no_grad():
        return model(f.get_tensor("inputs"), f.get_tensor("labels")).item()


def compare_losses(name, what, ours, theirs):
    diff = abs(ours - theirs)
    print(f"{name}: {what}: remat {ours:.7f}, PyTorch {theirs:.7f}, |difference| {diff:.1e} (limit {TOLERANCE:g})")
    check(diff <= TOLERANCE, f"{name}: {what}: remat's loss {ours:.7f} and PyTorch's {theirs:.7f} differ by {diff:.2e}")


def read_snapshot(name, path, model):  # b.
    f = safe_open(path, "pt")
    meta = f.metadata() or {}
    check(meta.get("format") == "pt" and meta.get("model") == name,
          f"{path}: metadata format {meta.get('format')!r}, model {meta.get('model')!r}")
    names = list(f.keys())
    crcs = {k[len("crc32."):] for k in meta if k.startswith("crc32.")}
    check(crcs == set(names), f"{path}: CRC-32s for {sorted(crcs ^ set(names))[:5]} but not for their tensors, or back")
    mine = model.state_dict()
    for k in names:
        dtype, shape = f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()
        check(dtype == "F32", f"{path}: {k} is {dtype}, not F32")
        check(k in mine and list(mine[k].shape) == shape,
              f"{path}: {k} {shape}: " + (f"PyTorch's is {list(mine[k].shape)}" if k in mine else "not a PyTorch name"))
        crc = f"{zlib.crc32(f.get_tensor(k).numpy().tobytes()):08x}"
        check(meta[f"crc32.{k}"] == crc, f"{path}: {k}: metadata CRC-32 {meta[f'crc32.{k}']}, its bytes' {crc}")
    torch_cpu.load_params(model, f, path)  # load_state_dict(strict=True); every mismatch in one error
    print(f"{name}: b. {os.path.basename(path)}: {len(names)} tensors, all F32 with PyTorch's shapes and matching "
          f"CRC-32s; {type(model).__name__} loads it (strict)")


def perturb(model, f):  # d.: one SGD step on the batch, then 1% seeded noise on every value
    model.train()
    model.zero_grad()
    model(f.get_tensor("inputs"), f.get_tensor("labels")).backward()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
            p *= 1 + 0.01 * torch.randn(p.shape, generator=generator)
    model.zero_grad()


def refuse_bad_file(name, binary, state, work):  # e.
    bad = dict(state)
    wrong = next(k for k in state if k.startswith("stages.1.blocks.0.") and state[k].dim() == 2)
    missing = next(k for k in state if k.startswith("stages.2.") and k.endswith(".bias"))
    bad[wrong] = state[wrong].t().contiguous()
    del bad[missing]
    path = os.path.join(work, "bad.safetensors")
    save_file(bad, path, metadata={"format": "pt"})
    p = remat(binary, "--init-from", path, "--max-steps", 1, expect=2)
    lines = p.stderr.strip().splitlines()
    check(len(lines) == 1, f"{name}: e. {len(lines)} lines on stderr, not one:\n{p.stderr[-3000:]}")
    check(wrong in lines[0] and missing in lines[0], f"{name}: e. the line names not both {wrong} and {missing}: {lines[0]}")
    check("loss_first" not in p.stdout, f"{name}: e. a JSON summary on stdout: a step was run")
    print(f"{name}: e. {wrong} transposed and {missing} missing: exit 2, one line: {lines[0]}")


def roundtrip(name, binary, scratch):
    work = os.path.join(scratch, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out = os.path.join(work, "out")

    # a. remat trains and writes a snapshot
    trained = summary(remat(binary, "--output-dir", out, "--save-steps", STEPS, "--max-steps", STEPS))
    snapshot = os.path.join(out, f"snapshot-{STEPS}", "model.safetensors")
    check(os.path.isfile(snapshot), f"{name}: {snapshot} was not written")
    print(f"{name}: a. remat trained {STEPS} steps (loss {trained['loss_first']:.7f} -> {trained['loss_last']:.7f}) "
          f"and wrote {os.path.relpath(snapshot, scratch)}")

    # b. the safetensors package and PyTorch read it
    model = torch_cpu.MODELS[name](0.0)
    read_snapshot(name, snapshot, model)

    # c. remat starts from it: the same weights, the same loss as PyTorch's
    x = os.path.join(work, "x.safetensors")
    first = summary(remat(binary, "--init-from", snapshot, "--max-steps", 1, "--save-initial", x))
    x_params, _ = params_of(x)
    snap_params, _ = params_of(snapshot)
    differ = bit_identical(x_params, snap_params)
    check(not differ, f"{name}: c. --save-initial after --init-from differs from the snapshot in {differ[:5]}")
    fx = safe_open(x, "pt")
    loss_c = pytorch_loss(model, fx)
    compare_losses(name, f"c. first-step loss from the snapshot ({len(x_params)} tensors bit-identical in "
                   "--save-initial)", first["loss_first"], loss_c)

    # d. weights written by PyTorch load back into remat
    perturb(model, fx)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    from_torch = os.path.join(work, "from_pytorch.safetensors")
    save_file(state, from_torch, metadata={"format": "pt"})
    y = os.path.join(work, "y.safetensors")
    second = summary(remat(binary, "--init-from", from_torch, "--max-steps", 1, "--save-initial", y))
    y_params, _ = params_of(y)
    differ = bit_identical(y_params, state)
    check(not differ, f"{name}: d. remat's parameters after --init-from differ from PyTorch's in {differ[:5]}")
    loss_d = pytorch_loss(model, safe_open(y, "pt"))
    check(abs(loss_d - loss_c) > 100 * TOLERANCE,
          f"{name}: d. the perturbation moved PyTorch's loss by only {abs(loss_d - loss_c):.1e}")
    compare_losses(name, f"d. first-step loss from PyTorch's weights (SGD step + 1% noise: {loss_c:.7f} -> "
                   f"{loss_d:.7f}; {len(y_params)} tensors bit-identical)", second["loss_first"], loss_d)

    # e. a file that does not fit is refused, every mismatch named
    refuse_bad_file(name, binary, state, work)


def main():
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} <train-mlp> <train-gpt> <scratch folder>")
    train_mlp, train_gpt, scratch = sys.argv[1:]
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    for name, binary in (("mlp", train_mlp), ("gpt", train_gpt)):
        roundtrip(name, binary, scratch)
    print(f"torch_roundtrip: {checks} checks passed")


if __name__ == "__main__":
    main()
