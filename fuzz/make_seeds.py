#!/usr/bin/env python3
"""Writes fuzz/seeds/<target>/: the valid inputs each fuzz target starts from (fuzz.h's parts:
a 2-byte little-endian length before each part but the last). Run it again after changing an
input format; libFuzzer grows its own corpus from these (build-fuzz/corpus/<target>/)."""
import gzip, json, os, struct

here = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    os.makedirs(os.path.join(here, "seeds", target), exist_ok=True)
    with open(os.path.join(here, "seeds", target, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def parts(*files):
    return b"".join(struct.pack("<H", len(f)) + f for f in files[:-1]) + files[-1]


def idx(dims, data):
    return bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + bytes(data)


def mt19937_64(seed):  # std::mt19937_64's state after seeding, as operator<< writes it
    x, mask = [seed], (1 << 64) - 1
    for i in range(1, 312):
        x.append((6364136223846793005 * (x[-1] ^ (x[-1] >> 62)) + i) & mask)
    return " ".join(map(str, x + [312]))


images, labels = idx([3, 28, 28], [i % 256 for i in range(3 * 784)]), idx([3], [0, 9, 4])
write("idx", "plain", parts(images, labels))
write("idx", "gzip", parts(gzip.compress(images, mtime=0), gzip.compress(labels, mtime=0)))

text = "A fortune a day keeps the doctor away.\n\tUnknown\n%\nÜber café.\n" * 12
write("text", "folder", parts(text.encode(), text[:200].encode(), gzip.compress(text.encode(), mtime=0), b"\0\1\2"))

tokens = struct.pack("<200H", *[(i * 37) % 4096 for i in range(200)])
write("tokens", "raw", tokens)
write("tokens", "llmc", struct.pack("<256i", 20240520, 1, 200, *[0] * 253) + tokens)

write("data_state", "images", "\0" + mt19937_64(5489) + " 2 2 0 1")
write("data_state", "text", "\1" + mt19937_64(42))

write("flags", "config", '{"per_device_train_batch_size": 8, "gradient_checkpointing": true, '
      '"gradient_checkpointing_kwargs": {"every_n_layers": 2, "offload": true}, "learning_rate": 1e-3}')
write("flags", "policy", "--checkpoint-policy s1:every_n_layers=2+selective --max-steps 3\n"
      '{"dropout": 0.1, "lr_scheduler_type": "constant", "bf16": false}')
write("flags", "budget", "--memory-budget 1.5GiB --seed=7 --bf16 True\n")


def safetensors(tensors, metadata):
    header, data = {"__metadata__": metadata}, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


write("safetensors", "model", safetensors({"stages.1.blocks.0.layers.1.weight": ("F32", [2, 3], struct.pack("<6f", *range(6))),
                                           "stages.1.blocks.0.layers.1.bias": ("BF16", [2], b"\x80\x3f\x00\x40"),
                                           "inputs": ("I32", [1, 2], struct.pack("<2i", 7, 9))},
                                          {"format": "pt", "crc32.inputs": "00000000"}))
