#!/usr/bin/env python3
"""Byte-level BPE token files for remat's token trainers (remat_add_trainer(... DATA tokens)).

  bpe.py train [--corpus DIR] [--vocab 4096] --out DIR
      trains a byte-level BPE tokenizer (Hugging Face `tokenizers`) on the training split of a
      folder of text files and writes DIR/train.bin, DIR/val.bin (llm.c's layout: a header of 256
      int32 -- magic 20240520, version 1, token count -- then uint16 tokens) and DIR/tokenizer.json.
      The corpus is read as the text trainer reads it (trainer/data.cpp, load_corpus): every regular
      file of DIR (not a link, not fortune's .dat / .u8 index files), sorted by name, concatenated;
      the first 90% of the bytes train, the rest validate. Same input, same output, byte for byte.
  bpe.py decode --tokenizer FILE
      copies stdin to stdout, with each line `sample ids: 12 7 ...` (a token trainer's sample) decoded
      to `sample:` and its text.
"""
import os
import sys
import argparse
import struct
from array import array

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256  # llm.c's dev/data/data_common.py
VAL_FRACTION = 0.1


def corpus_files(folder):
    names = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path) and os.path.splitext(name)[1] not in (".dat", ".u8"):
            names.append(name)
    return [os.path.join(folder, n) for n in sorted(names, key=os.fsencode)]


def read_corpus(folder):
    files = corpus_files(folder)
    data = b"".join(open(f, "rb").read() for f in files)
    if not files or not data:
        sys.exit(f"{folder}: no text files")
    split = int(len(data) * (1 - VAL_FRACTION))  # as load_corpus: the first 90% of the bytes
    while split < len(data) and (data[split] & 0xC0) == 0x80:  # not inside a UTF-8 character
        split += 1
    try:
        return files, data[:split].decode("utf-8"), data[split:].decode("utf-8")
    except UnicodeDecodeError as e:
        sys.exit(f"{folder}: not UTF-8 text ({e})")


def train_tokenizer(text, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok


def write_tokens(path, ids):
    tokens = array("H", ids)  # uint16
    if sys.byteorder != "little":
        tokens.byteswap()
    header = struct.pack("<256i", MAGIC, VERSION, len(tokens), *([0] * (HEADER_INTS - 3)))
    with open(path + ".tmp", "wb") as f:
        f.write(header)
        f.write(tokens.tobytes())
    os.replace(path + ".tmp", path)


def train(args):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not 256 < args.vocab < 65536:
        sys.exit(f"--vocab {args.vocab}: a byte-level BPE over uint16 tokens needs 256 < vocab < 65536")
    files, train_text, val_text = read_corpus(args.corpus)
    tok = train_tokenizer(train_text, args.vocab)
    os.makedirs(args.out, exist_ok=True)
    sizes = {}
    for name, text in (("train", train_text), ("val", val_text)):
        ids = tok.encode(text).ids
        if tok.decode(ids) != text:
            sys.exit(f"{args.corpus}: the {name} split does not decode back to its text")
        write_tokens(os.path.join(args.out, name + ".bin"), ids)
        sizes[name] = (len(text.encode("utf-8")), len(ids))
    tok.save(os.path.join(args.out, "tokenizer.json"))
    nbytes = sum(b for b, _ in sizes.values())
    ntokens = sum(t for _, t in sizes.values())
    print(
        f"bpe.py: {len(files)} files of {args.corpus}, {nbytes} bytes -> {ntokens} tokens "
        f"(train {sizes['train'][1]}, val {sizes['val'][1]}), vocab {tok.get_vocab_size()}, "
        f"{nbytes / ntokens:.2f} bytes/token; written to {args.out}"
    )


def decode(args):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    prefix = "sample ids:"
    for line in sys.stdin:
        if line.startswith(prefix):
            ids = [int(t) for t in line[len(prefix) :].split()]
            line = "sample:\n" + tok.decode(ids) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train", help="train the tokenizer and write the token files")
    t.add_argument("--corpus", default="/usr/share/games/fortunes", help="folder of text files")
    t.add_argument("--vocab", type=int, default=4096, help="vocabulary size (256 < vocab < 65536)")
    t.add_argument("--out", required=True, help="output folder")
    d = sub.add_parser("decode", help="decode the `sample ids:` lines of a trainer's output")
    d.add_argument("--tokenizer", required=True, help="tokenizer.json")
    args = p.parse_args()
    train(args) if args.mode == "train" else decode(args)


if __name__ == "__main__":
    main()
