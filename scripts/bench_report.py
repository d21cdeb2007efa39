#!/usr/bin/env python3
"""The bench scripts' tables, from the summary.json that each run writes.

    python3 scripts/bench_report.py hooks RUN_DIR...   prints the hooks table
    python3 scripts/bench_report.py bench FACTS JSON RUN_DIR...
        prints scripts/bench.sh's table and writes its figures to JSON
    python3 scripts/bench_report.py profile TRACE STEPS MS_PER_STEP
        prints the operators that take a profiled step's time (the Chrome
        trace of `mnist_ddp_bench profile`), by self time

Each RUN_DIR is one run's --path; runs of the same --compression are
repeats, summarised by their median. FACTS holds scripts/bench.sh's other
measurements, one "key=value" per line.
"""
import json
import os
import statistics
import sys


def parse(run_dir):
    """The numbers of one run: steps, images/s, ms/step and its parts, bytes/step, top-1."""
    path = os.path.join(run_dir, "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"bench_report: {path}: {e} (did the run fail?)")
    if not summary.get("finished") or not summary.get("epochs"):
        sys.exit(f"bench_report: {path}: the run did not finish")
    arguments = summary["arguments"]
    # The hook, and the precision flags where a run set them (a default run records neither).
    config = " ".join([arguments["compression"]] + [f"--{flag} {arguments[flag]}" for flag in ("amp", "accumulate")
                                                     if flag in arguments]
                      + (["--no-check-collectives"] if arguments.get("no_check_collectives") == "true" else []))
    run = {"compression": arguments["compression"], "config": config, "startup_s": summary["startup_s"]}
    training = summary["training"]
    for key in ["steps", "seconds", "images_per_s", "ms_per_step", "forward_ms", "backward_ms", "waiting_ms",
                "optimizer_ms"]:
        run[key] = training[key]
    run["bytes_per_step"] = summary["compression"]["bytes_per_step"]
    run["ratio_to_none"] = summary["compression"]["ratio_to_none"]
    last = summary["epochs"][-1]["test"]
    run["test_loss"], run["top1"] = last["loss"], last["top1"]
    return run


def median_by(runs, key):
    """Runs grouped by `key`, each field the median over the group."""
    groups = {}
    for run in runs:
        groups.setdefault(run[key], []).append(run)
    return {name: {f: (statistics.median(r[f] for r in group) if isinstance(group[0][f], (int, float)) else group[0][f])
                   for f in group[0]}
            for name, group in groups.items()}


HOOKS = ["none", "fp16", "powersgd", "powersgd_fp16", "batched_powersgd_fp16", "bf16"]


def by_config(run_dirs):
    """Medians by hook and flags: the hooks in HOOKS's order, then rows with flags, as they ran."""
    runs = median_by([parse(d) for d in run_dirs], "config")
    order = {name: i for i, name in enumerate(HOOKS)}
    return dict(sorted(runs.items(), key=lambda item: order.get(item[0], len(HOOKS))))


def hooks_table(run_dirs):
    runs = by_config(run_dirs)
    none = runs["none"]
    repeats = len(run_dirs) // len(runs)
    print(f"| hook | images/s | vs none | ms/step | ms/step waiting on communication | bytes/step on the wire "
          f"| less than none | test top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['images_per_s']:.0f} | {100 * r['images_per_s'] / none['images_per_s']:.0f}% "
              f"| {r['ms_per_step']:.1f} | {r['waiting_ms']:.1f} | {int(r['bytes_per_step']):,} "
              f"| {r['ratio_to_none']:.2f}x | {r['top1']:.2f}% |")
    print(f"\nMedians of {repeats} alternating run(s) per hook, {int(none['steps'])} steps each.")
    check_cost(runs)


def check_cost(runs):
    """The check's cost: each row run with --no-check-collectives beside the same row checked."""
    off = " --no-check-collectives"
    rows = [(name[: -len(off)], r) for name, r in runs.items() if name.endswith(off) and name[: -len(off)] in runs]
    if not rows:
        return
    print("\nThe check's cost (images/s checked against unchecked, the same run):")
    for name, unchecked in rows:
        checked = runs[name]
        cost = 100 * (1 - checked["images_per_s"] / unchecked["images_per_s"])
        print(f"- {name}: {checked['images_per_s']:.0f} against {unchecked['images_per_s']:.0f} images/s, "
              f"{cost:+.1f}% ({checked['ms_per_step']:.1f} against {unchecked['ms_per_step']:.1f} ms/step)")


def read_facts(path):
    """FACTS as a dict of lists: a key given once per round has one value per round."""
    facts = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            facts.setdefault(key, []).append(value)
    return facts


def limit(lines):
    """The median of compute-limit rounds: "images/s ms/step forward backward optimizer"."""
    keys = ["images_per_s", "ms_per_step", "forward_ms", "backward_ms", "optimizer_ms"]
    rounds = [dict(zip(keys, map(float, line.split()))) for line in lines]
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


def slopes(facts):
    """ms/step of each slope run: (wall of the long run - wall of the short) / their steps' difference,
    per round, medians."""
    out = {}
    for key, values in facts.items():
        if not key.startswith("slope_"):
            continue
        walls = [tuple(map(int, v.split())) for v in values]  # (steps, ms) in run order
        per_round = []
        for (short_steps, short_ms), (long_steps, long_ms) in zip(walls[0::2], walls[1::2]):
            per_round.append((long_ms - short_ms) / (long_steps - short_steps))
        out[key[6:]] = statistics.median(per_round)
    return out


def bench_table(facts_path, json_path, run_dirs):
    facts = read_facts(facts_path)
    hooks = by_config(run_dirs)
    tuned = limit(facts["limit_tuned"])
    plain = limit(facts["limit_plain"]) if "limit_plain" in facts else None
    processes = int(facts["processes"][0])
    ends = {}
    for key, values in facts.items():
        if key.startswith("e2e_"):
            run_dir, millis = values[0].split()
            ends[key[4:]] = dict(parse(run_dir), wall_s=int(millis) / 1000)
    for r in hooks.values():
        r["scaling_efficiency"] = r["images_per_s"] / (processes * tuned["images_per_s"])
        r["vs_none"] = r["images_per_s"] / hooks["none"]["images_per_s"]

    def dash(value, form):
        return "-" if value is None else format(value, form)

    print(f"Fashion-MNIST, batch 32 per process; device: {facts['device'][0]}; CPU: {facts['cpu'][0]} cores; "
          f"BLAS: {facts['blas'][0]}\n")
    print("| run | images/s | ms/step | forward | backward | of which waiting | optimizer | bytes/step on the wire "
          "| vs none | scaling efficiency | test top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in [("compute limit, 1 core, as set up here", tuned),
                     ("compute limit, 1 core, LibTorch as installed", plain)]:
        if r:
            print(f"| {label} | {r['images_per_s']:.0f} | {r['ms_per_step']:.1f} | {r['forward_ms']:.1f} "
                  f"| {r['backward_ms']:.1f} | - | {r['optimizer_ms']:.1f} | - | - | - | - |")
    for name, r in hooks.items():
        print(f"| {processes} process{'es' if processes > 1 else ''}, {name} | {r['images_per_s']:.0f} | {r['ms_per_step']:.1f} "
              f"| {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | {r['waiting_ms']:.1f} | {r['optimizer_ms']:.1f} "
              f"| {int(r['bytes_per_step']):,} | {100 * r['vs_none']:.0f}% | {r['scaling_efficiency']:.2f} "
              f"| {r['top1']:.2f}% |")
    for name, r in ends.items():
        span = "one full epoch" if "partial_epoch" not in facts else f"{int(r['steps'])} steps of an epoch, 1,000 test images"
        print(f"| {span}, {name}: "
              f"{r['wall_s']:.1f} s from launch (startup {r['startup_s']:.2f} s) "
              f"| {r['images_per_s']:.0f} | {r['ms_per_step']:.1f} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} "
              f"| {r['waiting_ms']:.1f} | {r['optimizer_ms']:.1f} | {int(r['bytes_per_step']):,} | - "
              f"| {r['images_per_s'] / (processes * tuned['images_per_s']):.2f} | {r['top1']:.2f}% |")

    steps = int(hooks["none"]["steps"])
    rounds = len(run_dirs) // len(hooks)
    print(f"\nHooks: medians of {rounds} alternating round(s) of {steps} steps, PowerSGD from step 10; "
          f"limits: medians of {len(facts['limit_tuned'])} rounds.")
    targets = {
        "scaling_efficiency_none": [hooks["none"]["scaling_efficiency"], ">=", 0.90],
        "scaling_efficiency_powersgd_fp16": [hooks["powersgd_fp16"]["scaling_efficiency"], ">=", 0.90],
        "slowest_hook_vs_none": [min(r["vs_none"] for name, r in hooks.items() if name in HOOKS), ">=", 0.95],
        "startup_s": [max(r["startup_s"] for r in ends.values()), "<", 3.0],
    }
    slope = slopes(facts)
    if "mnist_ddp_1" in slope:
        targets["scaling_efficiency_2_workers_vs_1"] = [slope["mnist_ddp_1"] / slope["mnist_ddp"], ">=", 0.85]
    if "python_ddp" in slope:
        targets["step_rate_vs_python_ddp"] = [slope["python_ddp"] / slope["mnist_ddp"], ">=", 1.5]
    if plain:
        targets["limit_vs_installed"] = [tuned["images_per_s"] / plain["images_per_s"], ">=", 1.5]
    if slope:
        names = {"mnist_ddp": f"mnist_ddp, {processes} workers, SyncBatchNorm",
                 "mnist_ddp_1": "mnist_ddp, 1 worker",
                 "python_ddp": f"PyTorch's Python DDP, {processes} workers, "
                               + ("SyncBatchNorm" if facts["device"][0] != "cpu" else "per-process BatchNorm")}
        first, second = (facts["slope_mnist_ddp"][i].split()[0] for i in (0, 1))
        print(f"\nms/step as the slope from a {first}-step to a {second}-step run, launch to exit, compression none "
              f"(medians of {len(facts['slope_mnist_ddp']) // 2} alternating rounds):\n")
        print("| run | ms/step | images/s per worker |\n|---|---:|---:|")
        for name, ms in slope.items():
            print(f"| {names[name]} | {ms:.1f} | {32000 / ms:.0f} |")
    print("\n| target | measured | goal | met |\n|---|---:|---:|---|")
    for name, (value, op, goal) in targets.items():
        met = value >= goal if op == ">=" else value < goal
        print(f"| {name.replace('_', ' ')} | {value:.2f} | {op} {goal} | {'yes' if met else 'no'} |")
    if "breakdown" in facts:
        print(f"\nWhere a {processes}-process step goes (ms/step; \"local\": DDP without communication): "
              f"{facts['breakdown'][0]}")

    results = {
        "machine": {"device": facts["device"][0], "cpu": facts["cpu"][0], "blas": facts["blas"][0],
                    "processes": processes},
        "compute_limit": {"tuned": tuned, "as_installed": plain},
        "hooks": hooks,
        "end_to_end": ends,
        "slopes_ms_per_step": slope,
        "targets": {name: {"measured": value, "goal": f"{op} {goal}"} for name, (value, op, goal) in targets.items()},
        "breakdown": facts.get("breakdown", [None])[0],
    }
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def profile_table(trace_path, steps, ms_per_step, top=12):
    """Self time per operator: each event's duration less its children's, on its own thread."""
    with open(trace_path) as f:
        events = [e for e in json.load(f) if e.get("ph") == "X"]
    self_us, calls = {}, {}
    for tid in {e["tid"] for e in events}:
        stack = []  # open events: [end, name, children's time]
        for e in sorted((e for e in events if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                end, name, children, dur = stack.pop()
                self_us[name] = self_us.get(name, 0) + dur - children
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
            calls[e["name"]] = calls.get(e["name"], 0) + 1
        for end, name, children, dur in stack:
            self_us[name] = self_us.get(name, 0) + dur - children
    total = sum(self_us.values()) / 1000 / steps
    print(f"| operator (self time) | ms/step | share of the step | calls/step |\n|---|---:|---:|---:|")
    for name, us in sorted(self_us.items(), key=lambda kv: -kv[1])[:top]:
        ms = us / 1000 / steps
        print(f"| {name} | {ms:.2f} | {100 * ms / ms_per_step:.0f}% | {calls[name] / steps:.0f} |")
    print(f"| all operators | {total:.2f} | {100 * total / ms_per_step:.0f}% | |")
    print(f"| outside any operator (waiting, DDP and hook bookkeeping, profiler) | {ms_per_step - total:.2f} "
          f"| {100 * (ms_per_step - total) / ms_per_step:.0f}% | |")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "hooks":
        hooks_table(sys.argv[2:])
    elif len(sys.argv) == 5 and sys.argv[1] == "profile":
        profile_table(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) >= 5 and sys.argv[1] == "bench":
        bench_table(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(__doc__)
