#!/usr/bin/env python3
"""Corrupt datasets and token files given to the real trainers: each must end with exactly one
line on stderr naming the file and the problem, exit status 2, and no training step (no "step"
progress line). One good dataset per trainer first shows the fixtures themselves train.

    hostile_input.py TRAIN_MLP TRAIN_GPT TRAIN_GPT_BPE SCRATCH_DIR"""
import gzip, os, random, shutil, struct, subprocess, sys

mlp, gpt, gpt_bpe, scratch = sys.argv[1:5]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
failures = []


def folder(name, files):
    path = os.path.join(scratch, name)
    os.makedirs(path)
    for file, data in files.items():
        with open(os.path.join(path, file), "wb") as f:
            f.write(data)
    return path


def run(program, args):
    r = subprocess.run([program, *args], capture_output=True, text=True, errors="replace", timeout=120)
    return r.returncode, r.stdout, r.stderr


def stepped(out, err):
    return any(line.startswith("step") for line in (out + err).splitlines())


def expect_error(case, program, args, *needles):
    code, out, err = run(program, args)
    lines = err.splitlines()
    name = os.path.basename(program)
    problems = []
    if code != 2:
        problems.append(f"exit status {code}, not 2")
    if len(lines) != 1 or not lines[0].startswith(f"{name}: error: "):
        problems.append(f"{len(lines)} lines on stderr, not one '{name}: error: ...'")
    problems += [f"no '{n}' in the message" for n in needles if n not in err]
    if stepped(out, err):
        problems.append("it trained a step")
    print(f"{'ok  ' if not problems else 'FAIL'} {case}: {err.strip()!r}")
    if problems:
        failures.append(f"{case}: {'; '.join(problems)}\n  stdout: {out[-500:]!r}\n  stderr: {err[-1500:]!r}")


def expect_training(case, program, args):
    code, out, err = run(program, args)
    ok = code == 0 and stepped(out, err)
    print(f"{'ok  ' if ok else 'FAIL'} {case}: exit {code}")
    if not ok:
        failures.append(f"{case}: exit {code}, a step: {stepped(out, err)}\n  stderr: {err[-1500:]!r}")


# ---- Fashion-MNIST idx files (train-mlp): 200 images of 28 x 28, labels 0..9, gzip'ed ----------
def idx(dims, data, kind=8):
    return bytes([0, 0, kind, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + bytes(data)


rng = random.Random(25)
images = idx([200, 28, 28], [rng.randrange(256) for _ in range(200 * 784)])
labels = idx([200], [i % 10 for i in range(200)])
gz = lambda data: gzip.compress(data, mtime=0)
good = {"train-images-idx3-ubyte.gz": gz(images), "train-labels-idx1-ubyte.gz": gz(labels),
        "t10k-images-idx3-ubyte.gz": gz(images), "t10k-labels-idx1-ubyte.gz": gz(labels)}
mlp_args = ["--max-steps", "1", "--eval-samples", "0", "--data-dir"]
expect_training("mlp: the good fixture", mlp, mlp_args + [folder("mlp-good", good)])


def mlp_case(name, file, data, *needles):
    path = folder(f"mlp-{name}", {**good, file: data})
    expect_error(f"mlp: {name}", mlp, mlp_args + [path], os.path.join(path, file), *needles)


train_images, train_labels = "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"
mlp_case("truncated images", train_images, gz(images[:50000]), "truncated or corrupt")
mlp_case("wrong magic", train_images, gz(idx([200, 28, 28], images[16:], kind=9)), "not an idx file")
mlp_case("two dimensions", train_images, gz(idx([200, 784], images[16:])), "not an idx file")
mlp_case("label out of range", train_labels, gz(labels[:8 + 57] + bytes([10]) + labels[8 + 58:]),
         "label 10 at row 57 is not below the 10 classes")
mlp_case("truncated gzip", train_images, gz(images)[:20000], "truncated gzip")
bad_crc = bytearray(gz(images))
bad_crc[-6] ^= 1
mlp_case("gzip checksum", train_images, bytes(bad_crc), "corrupt gzip")
mlp_case("no images", train_images, gz(idx([0, 28, 28], [])), "size of 0")
mlp_case("sizes that wrap", train_images, gz(idx([2**32 - 1, 2**32 - 1, 2**32 - 1], [])), "truncated or corrupt")
narrow = folder("mlp-width", {**good, train_images: gz(idx([200, 27, 27], images[16:16 + 200 * 729]))})
expect_error("mlp: 27 x 27 images", mlp, mlp_args + [narrow], narrow, "729 pixels but the model takes 784")
few = {**good, train_images: gz(idx([3, 28, 28], images[16:16 + 3 * 784])), train_labels: gz(idx([3], [1, 2, 3]))}
expect_error("mlp: fewer images than a batch", mlp, mlp_args + [folder("mlp-few", few)],
             "3 training images are fewer than a batch of")
expect_error("mlp: more labels than images", mlp, mlp_args + [folder("mlp-count", {**good, train_labels: gz(idx([201], [0] * 201))})],
             "has 200 images but", "has 201 labels")

# ---- text folders (train-gpt) -------------------------------------------------------------------
text = ("Q: How many programmers does it take to change a light bulb?\nA: None, that's a hardware "
        "problem.\n%\nÜber den Wolken muss die Freiheit wohl grenzenlos sein.\n%\n").encode() * 40
gpt_args = ["--max-steps", "1", "--eval-samples", "0", "--batch-size", "2", "--data-dir"]
expect_training("gpt: the good fixture", gpt, gpt_args + [folder("gpt-good", {"a": text, "b": text[:3000]})])
binary = folder("gpt-binary", {f"r{i}": rng.randbytes(20000) for i in range(3)})
expect_error("gpt: random binary files", gpt, gpt_args + [binary], os.path.join(binary, "r0"), "are not text")
one_bad = folder("gpt-one-binary", {"a": text, "b": text, "c.png": rng.randbytes(5000)})
expect_error("gpt: one binary file among text", gpt, gpt_args + [one_bad], os.path.join(one_bad, "c.png"),
             "are not text (printable ASCII, whitespace or UTF-8); a text corpus file may have at most 10%")
empty = folder("gpt-empty", {})
expect_error("gpt: empty folder", gpt, gpt_args + [empty], empty, "no text files")
empty_files = folder("gpt-empty-files", {"a": b"", "b": b""})
expect_error("gpt: only empty files", gpt, gpt_args + [empty_files], empty_files, "no text files")
compressed = gz(text)
cut = folder("gpt-truncated-gzip", {"a": text, "b.gz": compressed[:len(compressed) // 2]})
expect_error("gpt: truncated gzip file", gpt, gpt_args + [cut], os.path.join(cut, "b.gz"), "truncated gzip")
short = folder("gpt-short", {"a": b"too short\n"})
expect_error("gpt: fewer characters than a sequence", gpt, gpt_args + [short], short, "too few for sequences of 64")
expect_error("gpt: no such folder", gpt, gpt_args + [os.path.join(scratch, "nonexistent")], "no such folder")

# ---- token files (train-gpt-bpe: vocabulary 4096, T = 64) ---------------------------------------
tokens = [(i * 37) % 4096 for i in range(1000)]
raw = lambda t: struct.pack(f"<{len(t)}H", *t)
header = lambda count, magic=20240520, version=1: struct.pack("<256i", magic, version, count, *[0] * 253)
val = folder("tokens-val", {"val.bin": header(len(tokens)) + raw(tokens)})
bpe_args = ["--max-steps", "1", "--eval-samples", "0", "--batch-size", "1"]
val_file = os.path.join(val, "val.bin")
expect_training("gpt-bpe: the good fixture", gpt_bpe,
                bpe_args + ["--data-dir", folder("tokens-good", {"train.bin": raw(tokens), "val.bin": raw(tokens)})])


def token_case(name, data, *needles):
    path = os.path.join(folder(f"tokens-{name.replace(' ', '-')}", {"train.bin": data}), "train.bin")
    expect_error(f"gpt-bpe: {name}", gpt_bpe, bpe_args + ["--train-file", path, "--validation-file", val_file],
                 path, *needles)


token_case("odd size", raw(tokens) + b"x", "2001 bytes, an odd size")
token_case("token past the vocabulary", raw(tokens[:500] + [4096] + tokens[501:]),
           "token 4096 at index 500 is not below the model's vocabulary of 4096")
token_case("llm.c count too large", header(1001) + raw(tokens), "the llm.c header says 1001 tokens but 2000 bytes")
token_case("llm.c count negative", header(-5) + raw(tokens), "the llm.c header says -5 tokens")
token_case("llm.c header truncated", header(1000)[:700], "truncated llm.c header")
token_case("llm.c version 2", header(1000, version=2) + raw(tokens), "llm.c header version 2")
token_case("empty file", b"", "empty file")
token_case("too few tokens", raw(tokens[:64]), "64 tokens are too few for sequences of 64")
bad_val = os.path.join(folder("tokens-bad-val", {"train.bin": raw(tokens), "val.bin": raw(tokens) + b"x"}), "val.bin")
expect_error("gpt-bpe: odd-sized val.bin under --data-dir", gpt_bpe,
             bpe_args + ["--data-dir", os.path.dirname(bad_val)], bad_val, "an odd size")

if failures:
    print(f"\n{len(failures)} case(s) failed:\n" + "\n".join(failures))
    sys.exit(1)
print("every corrupt dataset and token file: one line, exit status 2, no training step")
