#!/usr/bin/env python3
"""Loads a model mnist_ddp saved and evaluates it in PyTorch (Python).

    python3 scripts/evaluate_model.py MODEL.pt [DATA_RAW_DIR]

MODEL.pt is <path>/mnist_model.pt or a checkpoint's model-<n>.pt: a state dict
named as the PyTorch DDP example saves it ("module.conv1.weight", ...).
DATA_RAW_DIR (default data/MNIST/raw) holds t10k-{images-idx3,labels-idx1}-ubyte[.gz].
Prints "test top-1 P% (C of N)".
"""
import gzip
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """The PyTorch DDP example's network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.bn2 = nn.BatchNorm2d(64)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def read_idx(raw_dir, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(raw_dir, name)
        if os.path.exists(path):
            with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
                data = f.read()
            dims = data[3]
            shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
            return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)
    sys.exit(f"evaluate_model: no {stem}[.gz] in {raw_dir}")


def main():
    model_path = sys.argv[1]
    raw_dir = sys.argv[2] if len(sys.argv) > 2 else "data/MNIST/raw"
    # A dict of tensors named as the reference saves them. LibTorch's writer
    # tags the dict with its TorchScript type (torch.jit._pickle.restore_type_tag),
    # which the weights_only default of PyTorch 2.6 and later refuses.
    state = torch.load(model_path, weights_only=False)
    model = Net()
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    model.eval()
    images = (read_idx(raw_dir, "t10k-images-idx3-ubyte").float().div(255).sub(0.1307).div(0.3081)).unsqueeze(1)
    labels = read_idx(raw_dir, "t10k-labels-idx1-ubyte").long()
    with torch.no_grad():
        correct = sum(int((model(images[i:i + 1000]).argmax(1) == labels[i:i + 1000]).sum())
                      for i in range(0, len(labels), 1000))
    print(f"test top-1 {100.0 * correct / len(labels):.4f}% ({correct} of {len(labels)})")


if __name__ == "__main__":
    main()
