#!/usr/bin/env python3
"""Reads mnist_ddp's own log lines back into numbers, for the bench scripts.

    python3 scripts/runlog.py hooks RUN_DIR...   prints the hooks table

Each RUN_DIR is one run's --path (its mnist_train.log); runs of the same
--compression are repeats, summarised by their median.
"""
import os
import re
import statistics
import sys

PATTERNS = {
    "compression": re.compile(r"\| compression: (\S+)"),
    "training": re.compile(
        r"Training: (\d+) steps in ([\d.]+) s, ([\d.]+) images/s, ([\d.]+) ms/step \(forward ([\d.]+), "
        r"backward ([\d.]+) of which ([\d.]+) waiting on communication, optimizer ([\d.]+)\)"),
    "wire": re.compile(r"Compression: \S+ (\d+) bytes/step on the wire, ([\d.]+)x less than none"),
    "test": re.compile(r"Test Epoch: \d+: Average loss: ([\d.]+), Top 1 Acc: ([\d.]+)%"),
}


def parse(run_dir):
    """The numbers of one run: steps, images/s, ms/step and its parts, bytes/step, top-1."""
    with open(os.path.join(run_dir, "mnist_train.log")) as f:
        text = f.read()
    run = {}
    if m := PATTERNS["compression"].search(text):
        run["compression"] = m.group(1)
    if m := PATTERNS["training"].search(text):
        keys = ["steps", "seconds", "images_per_s", "ms_per_step", "forward_ms", "backward_ms", "waiting_ms",
                "optimizer_ms"]
        run.update({k: float(v) for k, v in zip(keys, m.groups())})
    if m := PATTERNS["wire"].search(text):
        run["bytes_per_step"], run["ratio_to_none"] = int(m.group(1)), float(m.group(2))
    tests = PATTERNS["test"].findall(text)
    if tests:
        run["test_loss"], run["top1"] = float(tests[-1][0]), float(tests[-1][1])
    missing = {"compression", "images_per_s", "bytes_per_step", "top1"} - run.keys()
    if missing:
        sys.exit(f"runlog: {run_dir}: no {', '.join(sorted(missing))} in mnist_train.log (did the run fail?)")
    return run


def median_by(runs, key):
    """Runs grouped by `key`, each field the median over the group."""
    groups = {}
    for run in runs:
        groups.setdefault(run[key], []).append(run)
    return {name: {f: (statistics.median(r[f] for r in group) if isinstance(group[0][f], (int, float)) else group[0][f])
                   for f in group[0]}
            for name, group in groups.items()}


def hooks_table(run_dirs):
    runs = median_by([parse(d) for d in run_dirs], "compression")
    none = runs["none"]
    repeats = len(run_dirs) // len(runs)
    print(f"| hook | images/s | vs none | ms/step | ms/step waiting on communication | bytes/step on the wire "
          f"| less than none | test top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ["none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16"]:
        if name not in runs:
            continue
        r = runs[name]
        print(f"| {name} | {r['images_per_s']:.0f} | {100 * r['images_per_s'] / none['images_per_s']:.0f}% "
              f"| {r['ms_per_step']:.1f} | {r['waiting_ms']:.1f} | {int(r['bytes_per_step']):,} "
              f"| {r['ratio_to_none']:.2f}x | {r['top1']:.2f}% |")
    print(f"\nMedians of {repeats} alternating run(s) per hook, {int(none['steps'])} steps each.")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "hooks":
        sys.exit(__doc__)
    hooks_table(sys.argv[2:])
