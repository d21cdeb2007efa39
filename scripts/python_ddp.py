#!/usr/bin/env python3
"""PyTorch's own Python DistributedDataParallel on the reference's Net: the
baseline scripts/bench.sh measures mnist_ddp against.

    python3 scripts/python_ddp.py --steps 240 [--nproc 2] [--data-dir data] [--dataset fashion-mnist]
        [--nnodes 2 --node-rank K --master-addr A --master-port P] [--model resnet --warmup 5]

--model resnet trains examples/resnet_model.hpp's ResNet instead of Net (lr
0.05, momentum 0.9, no weight decay, as examples/resnet.cpp; for
scripts/bench_library.sh), and --warmup K starts the clock after K steps.

Trains --steps steps on --nproc Gloo processes on the CPU (or, with --cuda,
one NCCL process per visible GPU) with the reference's settings: batch 32
per process, SGD lr 0.01, momentum 0.9, weight decay 5e-4, a
DistributedSampler shuffled with seed 0. Each process gets cores / nproc
intra-op threads, as mnist_ddp's workers do. PyTorch's SyncBatchNorm
refuses CPU tensors, so on the CPU the BatchNorm layers stay per-process;
with --cuda they are converted, as the reference does. The batches are
sliced from the normalised data set held in memory (no DataLoader worker
processes), which favours this baseline. With --nnodes, this is node
--node-rank of a job whose rank 0 listens at --master-addr:--master-port
(scripts/bench_network.sh runs one node in each of two network
namespaces). Rank 0 prints "steps N in S s", timed from the start of its
training loop.
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evaluate_model import Net, read_idx  # noqa: E402  the reference's Net and an IDX reader

RAW_DIRS = {"mnist": "MNIST/raw", "fashion-mnist": "FashionMNIST/raw"}


def conv3x3(c_in, c_out):
    return torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)


class Block(torch.nn.Module):
    """conv-bn-relu-conv-bn, plus the input: examples/resnet_model.hpp's Block."""

    def __init__(self, channels):
        super().__init__()
        self.body = torch.nn.Sequential(conv3x3(channels, channels), torch.nn.BatchNorm2d(channels), torch.nn.ReLU(),
                                        conv3x3(channels, channels), torch.nn.BatchNorm2d(channels))

    def forward(self, x):
        return F.relu(x + self.body(x))


class ResNet(torch.nn.Module):
    """examples/resnet_model.hpp's ResNet, layer for layer."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(conv3x3(1, 16), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), Block(16),
                                            torch.nn.MaxPool2d(2), Block(16), torch.nn.AdaptiveAvgPool2d(1))
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def worker(local_rank, args, port):
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
    rank, world = args.node_rank * args.nproc + local_rank, args.nnodes * args.nproc
    dist.init_process_group("nccl" if args.cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank) if args.cuda else torch.device("cpu")
    torch.manual_seed(0)
    raw = os.path.join(args.data_dir, RAW_DIRS[args.dataset])
    images = (read_idx(raw, "train-images-idx3-ubyte").float().div_(255).sub_(0.1307).div_(0.3081)).unsqueeze(1)
    labels = read_idx(raw, "train-labels-idx1-ubyte").long()
    images, labels = images.to(device), labels.to(device)
    sampler = torch.utils.data.DistributedSampler(range(len(labels)), num_replicas=world, rank=rank,
                                                  shuffle=True, seed=0)
    model = ResNet() if args.model == "resnet" else Net()
    if args.cuda:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if args.cuda else None)
    if args.compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if args.model == "resnet":
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        loss_of = F.cross_entropy
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        loss_of = F.nll_loss
    ddp.train()
    step, epoch, start = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device)
        for first in range(0, len(order) - args.batch_size + 1, args.batch_size):
            batch = order[first:first + args.batch_size]
            optimizer.zero_grad()
            loss = loss_of(ddp(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.warmup:
                start = time.time()
            if step == args.steps:
                break
        epoch += 1
    if args.cuda:
        torch.cuda.synchronize()
    if rank == 0:
        print(f"steps {step - args.warmup} in {time.time() - start:.3f} s", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--dataset", choices=sorted(RAW_DIRS), default="fashion-mnist")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--compression", choices=["none", "fp16"], default="none")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--model", choices=["net", "resnet"], default="net")
    parser.add_argument("--warmup", type=int, default=0, help="steps before the clock starts")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0, help="0: a free one (one node only)")
    args = parser.parse_args()
    if args.cuda:
        if not torch.cuda.is_available():
            sys.exit("python_ddp: --cuda, but this torch sees no GPU")
        args.nproc = torch.cuda.device_count()
    args.threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)  # the cores this process may use
    port = args.master_port
    if port == 0:
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.nproc)


if __name__ == "__main__":
    main()
