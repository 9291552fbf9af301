"""remat's GPT-2 and Llama trainers against the real Transformers (pinned in the Makefile).

For each architecture (GPT2LMHeadModel, LlamaForCausalLM) at the widths its trainer was built for
(the trainer's --plan-report is not needed: the config is given here and the trainer checks it):
1. Transformers makes the model (from_config, seed 0) and save_pretrained writes the folder.
2. remat starts from it (--init-from DIR), takes one AdamW step on a batch of random tokens with
   --save-initial (the batch), --save-gradients and --save-hf.
3. The same batch through Transformers in float64: remat's first loss within 1e-5 relative; its
   gradients' error (the worst tensor's, of that tensor's largest magnitude) at most WORSE x the
   error of Transformers' own fp32 gradients against the same reference (or a floor); and the
   weights after torch.optim.AdamW's step (the same hyperparameters, weight decay on the linear
   weights as remat decays them) each within the bound that error gives (adamw_bound).
4. --save-hf after a step of learning rate 0 is the folder read, tensor for tensor, bit for bit;
   Transformers loads it with no missing or unexpected keys, and the logits of both are equal.
5. A config.json that differs in a shape field is refused: exit 2, one line naming the field.
6. At learning rate 0 on a file of one repeated token, a second step's gradients are the first's, bit for bit.

With --full, the full-size trainers (train-gpt2, train-smollm2) at their published configs (slow;
outside the default ctest: docs/tests.md).

Bounds (fp32 kernels against float64): each gradient entry is a sum over the batch's rows of
products of activations that went through at most 2 L + 3 GEMMs of inner width K <= 4 C (or the
vocabulary, for the head), each adding a relative rounding error of about u sqrt(K) with u = 2^-24.
How far that carries depends on the model's conditioning (the tiny Llama's q and k gradients are
small differences of large terms: PyTorch's own fp32 errs by 9e-6 of their scale there, by 1.4e-6
on GPT-2's worst tensor), so the limit is not a number picked once but PyTorch's fp32 error on the
same model and batch, times FP32_WORSE: remat sums in other orders (its own tiles, its attention's
chunks), not more coarsely. Seen (AMD EPYC, 2026-12-07): tiny GPT-2 1.1x, tiny Llama 1.7x.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import torch
from safetensors.numpy import load_file
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

LOSS_LIMIT = 1e-5        # relative, fp32 first loss against float64
FP32_GRADIENT_FLOOR, FP32_WORSE = 2.0 ** -18, 4.0  # the floor: 64 u of a tensor's largest magnitude
# --bf16 (activations, their gradients and GEMM operands rounded to bf16, 2^-9 relative each, fp32
# accumulation and master weights) against the same float64 reference, beside Transformers under
# torch.autocast(bfloat16) on its fp32 weights: per layer a few roundings of 2^-9, through 2 L + 3
# GEMMs, and remat's error at most BF16_WORSE x autocast's (or the floor, whichever is larger).
# Seen (AMD EPYC): GPT-2 tiny 1.4x, SmolLM2 full 1.6x; the Llama tiny (head_dim 16, biases, llama3
# RoPE) 3.4x on its q and k projections only (2.5e-1 against 7.4e-2; its other tensors 0.5-1.6x;
# in fp32 too its q and k gradients are the worst, 20x the others: ill-conditioned there). Not
# explained yet: a guess is attention's delta, read from the bf16 output as FlashAttention does,
# where autocast's softmax backward uses its fp32 probabilities.
BF16_LOSS_LIMIT, BF16_GRADIENT_FLOOR, BF16_WORSE = 1e-3, 5e-2, 4.0
LR, WEIGHT_DECAY, BATCH = 1e-3, 0.1, 2

TINY = {
    "gpt2": GPT2Config(vocab_size=37, n_positions=1024, n_layer=2, n_head=3, n_embd=24, n_inner=40,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": LlamaConfig(vocab_size=41, hidden_size=24, intermediate_size=20, num_hidden_layers=3,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                         attention_bias=True, mlp_bias=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 8.0,
                                          "original_max_position_embeddings": 64},
                         max_position_embeddings=128, tie_word_embeddings=True),
}
FULL = {
    "gpt2": GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}
# The wrong shape field each architecture is refused for (a value no config here has).
WRONG = {"gpt2": lambda c: ("n_head", 4), "llama": lambda c: ("num_key_value_heads", c.num_attention_heads)}



def write_tokens(path, ids):  # llm.c's layout, as scripts/bpe.py writes it
    header = struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253))
    with open(path, "wb") as f:
        f.write(header + np.asarray(ids, dtype=np.uint16).tobytes())


def run(trainer, *args, expect=0):
    p = subprocess.run([trainer, *map(str, args)], capture_output=True, text=True)
    if p.returncode != expect:
        sys.exit(f"{os.path.basename(trainer)} {' '.join(map(str, args))}: exit {p.returncode}, expected {expect}\n"
                 f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def adamw_bound(g, dg, p):
    """How far one AdamW step from gradients g (float64, magnitudes) may move a weight p when the
    gradient has an error of at most dg: the first step moves it by lr g / (|g| + eps), whose
    derivative in g is lr eps / (|g| + eps)^2 (at most 2 lr where the error can flip the sign),
    plus remat's fp32 rounding of the weight (2 ulp) and of the step (2^-20 lr)."""
    eps = 1e-8
    moved = np.minimum(LR * eps * dg / (g + eps) ** 2, 2 * LR)
    return moved + np.abs(p) * 2.0 ** -22 + LR * 2.0 ** -20


def decayed(name):  # remat decays its linears' weights (not embeddings, norms, biases)
    return name.endswith(".weight") and any(k in name for k in ("attn.c_", "mlp.c_", "_proj")) \
        and "norm" not in name


def check(arch, trainer, config, work, T):
    d = os.path.join(work, arch)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases and norm gains away from 0 and 1, so that a mix-up shows
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder = os.path.join(d, "in")
    model.save_pretrained(folder)
    rng = np.random.default_rng(1)
    data = os.path.join(d, "data")
    os.makedirs(data)
    for split in ("train", "val"):
        write_tokens(os.path.join(data, f"{split}.bin"), rng.integers(0, config.vocab_size, 64 * T).tolist())
    common = ["--data-dir", data, "--batch-size", BATCH, "--max-steps", 1, "--dropout", 0, "--warmup-steps", 0,
              "--lr-scheduler-type", "constant", "--eval-samples", 0, "--json"]
    out = run(trainer, "--init-from", folder, *common, "--learning-rate", LR, "--weight-decay", WEIGHT_DECAY,
              "--save-initial", os.path.join(d, "initial.safetensors"), "--save-gradients", os.path.join(d, "grads"),
              "--save-hf", os.path.join(d, "stepped"))
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    initial = load_file(os.path.join(d, "initial.safetensors"))
    inputs = torch.from_numpy(initial["inputs"].astype(np.int64))
    labels = torch.from_numpy(initial["labels"].astype(np.int64))

    ref, loss = transformers_step(folder, inputs, labels, torch.float64)
    rel = abs(summary["loss_first"] - loss.item()) / loss.item()
    print(f"{arch}: first loss remat {summary['loss_first']:.8f}, Transformers (float64) {loss.item():.8f}, "
          f"relative {rel:.2e} (limit {LOSS_LIMIT:g})")
    ok = rel <= LOSS_LIMIT

    grads = load_file(os.path.join(d, "grads", "gradients.safetensors"))
    params = dict(ref.named_parameters())
    if set(grads) != set(params):
        print(f"{arch}: gradient names differ: remat only {sorted(set(grads) - set(params))}, "
              f"Transformers only {sorted(set(params) - set(grads))}")
        return False
    reference = {n: p.grad.numpy() for n, p in params.items()}
    worst, worst_name = worst_gradient(grads, reference)
    torch32 = transformers_step(folder, inputs, labels, torch.float32)[0]
    hf_worst, hf_name = worst_gradient({n: p.grad.numpy() for n, p in torch32.named_parameters()}, reference)
    limit = max(FP32_GRADIENT_FLOOR, FP32_WORSE * hf_worst)
    print(f"{arch}: gradients of {len(grads)} tensors against float64, worst remat {worst:.2e} of its scale "
          f"({worst_name}), Transformers fp32 {hf_worst:.2e} ({hf_name}) (limit {limit:.2g})")
    ok = ok and worst <= limit

    # one AdamW step as torch.optim.AdamW takes it, from Transformers' float64 gradients
    groups = [{"params": [p for n, p in params.items() if decayed(n)], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in params.items() if not decayed(n)], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8).step()
    stepped = load_file(os.path.join(d, "stepped", "model.safetensors"))
    worst, worst_name = 0.0, ""
    for name, p in params.items():
        g, after = np.abs(p.grad.numpy()), p.detach().numpy()
        bound = adamw_bound(g, limit * g.max(), after)
        ratio = (np.abs(stepped[name].astype(np.float64) - after) / bound).max()
        if ratio > worst:
            worst, worst_name = ratio, name
    print(f"{arch}: weights after one AdamW step, worst {worst:.2e} of its bound in {worst_name} "
          f"(limit 1)")
    ok = ok and worst <= 1

    # the folder back, unchanged: a step of learning rate 0
    run(trainer, "--init-from", folder, *common, "--learning-rate", 0, "--save-hf", os.path.join(d, "out"))
    a, b = load_file(os.path.join(folder, "model.safetensors")), load_file(os.path.join(d, "out", "model.safetensors"))
    same = set(a) == set(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))
                                    for k in a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back, info = AutoModelForCausalLM.from_pretrained(os.path.join(d, "out"), output_loading_info=True)
    missing = {k: v for k, v in info.items() if v}
    with torch.no_grad():
        equal = torch.equal(AutoModelForCausalLM.from_pretrained(folder)(input_ids=inputs).logits,
                            back(input_ids=inputs).logits)
    print(f"{arch}: --save-hf round trip: {len(a)} tensors {'bit-equal' if same else 'DIFFERENT'}; loading info "
          f"{missing or 'clean'}; {len(caught)} warnings; logits {'equal' if equal else 'DIFFERENT'}")
    ok = ok and same and not missing and not caught and equal

    ok = check_bf16(arch, trainer, d, folder, common, inputs, labels, reference, loss.item()) and ok

    field, value = WRONG[arch](config)
    wrong = os.path.join(d, "wrong")
    shutil.copytree(folder, wrong)
    with open(os.path.join(wrong, "config.json")) as f:
        c = json.load(f)
    c[field] = value
    with open(os.path.join(wrong, "config.json"), "w") as f:
        json.dump(c, f)
    p = run(trainer, "--init-from", wrong, *common, expect=2)
    lines = p.stderr.strip().splitlines()
    named = len(lines) == 1 and f"config.json: {field} is {value}," in lines[0]
    print(f"{arch}: a config.json with {field} {value}: {lines}")
    return ok and named


def transformers_step(folder, inputs, labels, dtype, autocast=False):
    """Transformers' model from the folder in dtype (eager attention), its loss on the batch and its
    gradients (in the parameters' .grad); under torch.autocast(bfloat16) when asked."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.to(dtype).reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return model, loss


def worst_gradient(grads, reference):
    worst, worst_name = 0.0, ""
    for name, g in reference.items():
        err = np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-30)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def check_bf16(arch, trainer, d, folder, common, inputs, labels, reference, loss64):
    """remat --bf16 and Transformers under autocast, both against the float64 reference."""
    out = run(trainer, "--init-from", folder, *common, "--bf16", "--learning-rate", LR,
              "--save-gradients", os.path.join(d, "grads-bf16"))
    remat_loss = json.loads(out.stdout.strip().splitlines()[-1])["loss_first"]
    remat_worst, remat_name = worst_gradient(load_file(os.path.join(d, "grads-bf16", "gradients.safetensors")), reference)
    hf, hf_loss = transformers_step(folder, inputs, labels, torch.float32, autocast=True)
    hf_worst, hf_name = worst_gradient({n: p.grad.numpy() for n, p in hf.named_parameters()}, reference)
    loss_err, hf_loss_err = abs(remat_loss - loss64) / loss64, abs(hf_loss.item() - loss64) / loss64
    limit = max(BF16_GRADIENT_FLOOR, BF16_WORSE * hf_worst)
    print(f"{arch} bf16 against float64: first loss remat {loss_err:.2e}, autocast {hf_loss_err:.2e} (limit "
          f"{BF16_LOSS_LIMIT:g}); gradients remat {remat_worst:.2e} ({remat_name}), autocast {hf_worst:.2e} "
          f"({hf_name}) (limit {limit:.2g})")
    return loss_err <= BF16_LOSS_LIMIT and remat_worst <= limit


def check_second_step(arch, trainer, config, work, T):
    """At learning rate 0, on a token file of one repeated token (every window, so every batch, the same), the
    last of two steps' gradients are the first step's, bit for bit: no gradient keeps a part of an earlier step
    (a table shared with a later stage, the tied token table, once made its stage's other gradients, the
    position table's, add up over steps)."""
    d = os.path.join(work, arch + "-repeat")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for split in ("train", "val"):
        write_tokens(os.path.join(d, f"{split}.bin"), [config.vocab_size // 2] * (8 * (T + 1)))
    grads = []
    for steps in (1, 2):
        run(trainer, "--data-dir", d, "--batch-size", BATCH, "--max-steps", steps, "--learning-rate", 0,
            "--eval-samples", 0, "--save-gradients", os.path.join(d, f"grads{steps}"))
        grads.append(load_file(os.path.join(d, f"grads{steps}", "gradients.safetensors")))
    differ = sorted(n for n in grads[0] if not np.array_equal(grads[0][n], grads[1][n]))
    print(f"{arch}: a second step on the same batch at learning rate 0: {len(grads[0]) - len(differ)} of "
          f"{len(grads[0])} gradients bit-equal to the first step's" + (f"; differ: {differ}" if differ else ""))
    return not differ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt2")
    ap.add_argument("--llama")
    ap.add_argument("--work", required=True)
    ap.add_argument("--full", action="store_true", help="the trainers are the full-size ones")
    a = ap.parse_args()
    print(f"Transformers {transformers.__version__}, PyTorch {torch.__version__}")
    configs = FULL if a.full else TINY
    T = {"gpt2": configs["gpt2"].n_positions, "llama": 1024 if a.full else 6}
    ok = True
    for arch, trainer in (("gpt2", a.gpt2), ("llama", a.llama)):
        if trainer:
            ok = check(arch, trainer, configs[arch], a.work, T[arch]) and ok
            ok = check_second_step(arch, trainer, configs[arch], a.work, T[arch]) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
